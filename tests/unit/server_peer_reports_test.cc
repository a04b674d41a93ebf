// Gray failures: a member whose round failed reports the peers it could not reach over the data
// network. A report alone evicts nobody, nor do many against a peer that has not said it reaches
// nobody; once the accused's own report agrees (it reached none of its peers) while an accuser
// reached others, the peer is declared dead and the generation moves on, an elastic job going
// on without it. A partition, whose sides each reach their own, evicts nobody, in any order.
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/membership/peer_reports.h"
#include "server/store/state_store.h"
#include "tests/unit/running_job_fixture.h"

namespace modelavg::server {
namespace {

// The rule alone (server/membership/peer_reports.h).
PeerReport Report(int32_t reporter, std::vector<int32_t> unreachable,
                  std::vector<int32_t> reachable, absl::Time at) {
  PeerReport r;
  r.reporter = reporter;
  r.unreachable = std::move(unreachable);
  r.reachable = std::move(reachable);
  r.at = at;
  return r;
}

std::vector<int32_t> Ranks(const std::vector<ConfirmedPeer>& c) {
  std::vector<int32_t> out;
  for (const ConfirmedPeer& p : c) out.push_back(p.rank);
  return out;
}

const auto kAll = [](int32_t) { return true; };

TEST(PeerReportsRule, OneReportAloneConfirmsNothing) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {3}, {1, 2}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
}

TEST(PeerReportsRule, ManyReportsWithoutTheSuspectsOwnConfirmNothing) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {3}, {1, 2}, t0));
  reports.Add(1, Report(1, {3}, {0, 2}, t0));
  reports.Add(1, Report(2, {3}, {0, 1}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
  // The suspect's own report, reaching nobody, confirms them.
  reports.Add(1, Report(3, {0, 1, 2}, {}, t0));
  const std::vector<ConfirmedPeer> c = reports.Confirmed(1, t0, kAll);
  ASSERT_EQ(Ranks(c), std::vector<int32_t>{3});
  EXPECT_EQ(c[0].reporters, (std::vector<int32_t>{0, 1, 2}));
  // Not for another generation, nor once the reports expired, nor with the accusers out of the
  // round.
  EXPECT_TRUE(reports.Confirmed(2, t0, kAll).empty());
  EXPECT_TRUE(reports.Confirmed(1, t0 + absl::Seconds(6), kAll).empty());
  EXPECT_TRUE(reports.Confirmed(1, t0, [](int32_t r) { return r == 3; }).empty());
  // A report of a newer generation forgets the older ones.
  reports.Add(2, Report(2, {3}, {0}, t0));
  EXPECT_EQ(reports.size(), 1u);
  EXPECT_TRUE(reports.Confirmed(2, t0, kAll).empty());
}

TEST(PeerReportsRule, ASuspectThatReachedSomeoneIsNotConfirmed) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {3}, {1, 2}, t0));
  reports.Add(1, Report(1, {3}, {0, 2}, t0));
  reports.Add(1, Report(3, {0, 1}, {2}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
}

TEST(PeerReportsRule, OneReporterAndAnIsolatedSuspectConfirm) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {3}, {1}, t0));
  // The suspect's own report: it reached nobody. Its accusation of rank 0 counts for nothing:
  // rank 0 reached others, rank 3 reached none.
  reports.Add(1, Report(3, {0, 1}, {}, t0));
  EXPECT_EQ(Ranks(reports.Confirmed(1, t0, kAll)), std::vector<int32_t>{3});
}

TEST(PeerReportsRule, TwoIsolatedAccusingEachOtherConfirmNothing) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {1}, {}, t0));
  reports.Add(1, Report(1, {0}, {}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
}

TEST(PeerReportsRule, APartitionEvictsNobody) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {2, 3}, {1}, t0));
  reports.Add(1, Report(1, {2, 3}, {0}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());  // one side has spoken
  reports.Add(1, Report(2, {0, 1}, {3}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
  reports.Add(1, Report(3, {0, 1}, {2}, t0));
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
}

TEST(PeerReportsRule, APeerReachedByAnyoneIsNotConfirmed) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  PeerReports reports(absl::Seconds(5));
  reports.Add(1, Report(0, {3}, {1}, t0));
  reports.Add(1, Report(1, {3}, {0}, t0));
  reports.Add(1, Report(3, {0, 1}, {}, t0));
  ASSERT_EQ(Ranks(reports.Confirmed(1, t0, kAll)), std::vector<int32_t>{3});
  reports.Add(1, Report(2, {}, {3, 0, 1}, t0));  // rank 2 reaches it
  EXPECT_TRUE(reports.Confirmed(1, t0, kAll).empty());
}

// The rule in a running job.
class PeerReportsJobTest : public RunningJobTest {
 protected:
  PeerReportsJobTest() : RunningJobTest("g") {}

  absl::StatusOr<v1::ReportPeerFailureResponse> ReportOf(Job& job, int rank,
                                                         std::vector<int32_t> unreachable,
                                                         std::vector<int32_t> reachable,
                                                         int64_t generation = 1) {
    v1::ReportPeerFailureRequest req;
    req.set_job_id("g");
    req.set_rank(rank);
    req.set_generation(generation);
    req.set_credential(credentials_[rank]);
    req.set_step(6);
    req.set_level(0);
    for (int32_t r : unreachable) req.add_unreachable_ranks(r);
    for (int32_t r : reachable) req.add_reachable_ranks(r);
    req.set_reason("Gloo all-reduce timed out");
    v1::ReportPeerFailureResponse resp;
    absl::Status s = job.ReportPeerFailure(req, &resp);
    if (!s.ok()) return s;
    return resp;
  }

  void BeatAll(Job& job) {
    for (int r = 0; r < 4; ++r) Beat(job, r, 6);
  }
};

TEST_F(PeerReportsJobTest, AReportAloneDoesNotEvict) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  ASSERT_EQ(State(*job).state(), v1::RUNNING);
  absl::StatusOr<v1::ReportPeerFailureResponse> r = ReportOf(*job, 0, {3}, {1, 2});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());
  EXPECT_EQ(r->generation(), 1);
  // Every member goes on beating: the accused stays a member for as long as that lasts, the
  // report expiring on the way.
  for (int i = 0; i < 20; ++i) {
    BeatAll(*job);
    clock_.Advance(absl::Milliseconds(500));
    job->CheckStaleness();
  }
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 1);
  EXPECT_EQ(state.live_world_size(), 4);
  // An expired report does not combine with a fresh one.
  r = ReportOf(*job, 1, {3}, {0, 2});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());
  EXPECT_EQ(State(*job).generation(), 1);
}

TEST_F(PeerReportsJobTest, ConfirmedReportsEvictAndTheElasticJobGoesOn) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  ASSERT_TRUE(ReportOf(*job, 0, {3}, {1, 2}).ok());
  absl::StatusOr<v1::ReportPeerFailureResponse> r = ReportOf(*job, 1, {3}, {0, 2});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());  // two accusers, but the accused has said nothing
  EXPECT_EQ(State(*job).generation(), 1);
  // The gray member's own report: it reached none of its peers.
  r = ReportOf(*job, 3, {0, 1, 2}, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::vector<int32_t>(r->declared_dead().begin(), r->declared_dead().end()),
            std::vector<int32_t>{3});
  EXPECT_EQ(r->generation(), 2);
  EXPECT_EQ(r->state(), v1::RUNNING);
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 3);
  EXPECT_EQ(state.deaths(), 1);
  EXPECT_NE(state.last_change().reason().find("rank 3 unreachable"), std::string::npos)
      << state.last_change().reason();
  // A late report of generation 1 (rank 2's) changes nothing more.
  r = ReportOf(*job, 2, {3}, {0, 1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());
  EXPECT_EQ(r->generation(), 2);
  EXPECT_EQ(State(*job).generation(), 2);
}

TEST_F(PeerReportsJobTest, TheSuspectReportingFirstIsConfirmedByOneReport) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  // The gray member reports first: it reached nobody. Its word against rank 0 counts for
  // nothing once rank 0 reports reaching others.
  absl::StatusOr<v1::ReportPeerFailureResponse> r = ReportOf(*job, 3, {0}, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());
  r = ReportOf(*job, 0, {3}, {1});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::vector<int32_t>(r->declared_dead().begin(), r->declared_dead().end()),
            std::vector<int32_t>{3});
  EXPECT_EQ(State(*job).live_world_size(), 3);
}

TEST_F(PeerReportsJobTest, APartitionEvictsNobody) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  for (auto [rank, unreachable, reachable] :
       std::vector<std::tuple<int, std::vector<int32_t>, std::vector<int32_t>>>{
           {0, {2, 3}, {1}}, {1, {2, 3}, {0}}, {2, {0, 1}, {3}}, {3, {0, 1}, {2}}}) {
    absl::StatusOr<v1::ReportPeerFailureResponse> r =
        ReportOf(*job, rank, unreachable, reachable);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->declared_dead().empty());
  }
  EXPECT_EQ(State(*job).generation(), 1);
}

TEST_F(PeerReportsJobTest, BadReportsAreRefusedClearly) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  absl::StatusOr<v1::ReportPeerFailureResponse> r = ReportOf(*job, 0, {7}, {});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("rank 7"), std::string::npos) << r.status();
  credentials_[1] = "not-the-credential";
  r = ReportOf(*job, 1, {3}, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  // A report of an older generation is answered with the current one and records nothing.
  r = ReportOf(*job, 0, {3}, {1}, /*generation=*/0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generation(), 1);
  r = ReportOf(*job, 2, {3}, {0});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->declared_dead().empty());
}

}  // namespace
}  // namespace modelavg::server
