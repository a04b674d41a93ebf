// Elastic jobs (JobSpec.min_world_size) in the coordinator core: a death or a departure while
// RUNNING moves the job to a new generation of the survivors, vacant ranks keep their numbers,
// decisions list the live members, and below min_world_size the job falls back to PENDING.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "server/job_registry.h"
#include "server/membership.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

void JoinAll(Membership& m) {
  for (int32_t r = 0; r < m.world_size(); ++r) {
    ASSERT_TRUE(m.Join("w" + std::to_string(r), "h", r, kT0, "j").ok());
  }
  ASSERT_EQ(m.state(), v1::RUNNING);
}

TEST(ElasticMembershipTest, StrictByDefault_DeathFallsBackToPending) {
  Membership m(4);
  EXPECT_FALSE(m.elastic());
  JoinAll(m);
  const MembershipChange c = m.Die({2}, "rank 2 heartbeat timeout", kT0);
  EXPECT_TRUE(c.generation_changed);
  EXPECT_FALSE(c.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);
}

TEST(ElasticMembershipTest, Death_ShrinksIntoNewGenerationOfSurvivors_RankVacant) {
  Membership m(4, /*min_world_size=*/2);
  EXPECT_TRUE(m.elastic());
  JoinAll(m);
  m.ClearDelta();
  const MembershipChange c = m.Die({2}, "rank 2 heartbeat timeout", kT0);
  EXPECT_TRUE(c.generation_changed);
  EXPECT_TRUE(c.shrunk);
  EXPECT_EQ(c.old_generation, 1);
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 3);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(2));
  for (int32_t r : {0, 1, 3}) {
    EXPECT_TRUE(m.InRound(r)) << r;
    EXPECT_EQ(m.member(r).generation, 2) << r;
  }
  EXPECT_EQ(m.member(2).state, v1::DEAD);
  // The transition is hard state: the header, the dead rank and the survivors' generation.
  const JobDelta delta = m.PeekDelta();
  ASSERT_TRUE(delta.header.has_value());
  EXPECT_EQ(delta.header->generation, 2);
  EXPECT_EQ(delta.header->state, v1::RUNNING);
  EXPECT_TRUE(delta.clear_comm_ids);
  EXPECT_EQ(delta.members.size(), 4u);
}

TEST(ElasticMembershipTest, SurvivorsHeartbeatsWithTheirJoinGenerationStillCount) {
  Membership m(3, 2);
  JoinAll(m);
  m.Die({1}, "rank 1 heartbeat timeout", kT0);
  ASSERT_EQ(m.generation(), 2);
  // Rank 0 still reports generation 1 (it learns of the change later); that keeps it alive.
  m.Heartbeat(0, 1, 7, kT0 + absl::Seconds(2));
  m.Heartbeat(2, 2, 8, kT0 + absl::Seconds(2));
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(3), absl::Milliseconds(1500)), IsEmpty());
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(4), absl::Milliseconds(1500)), ElementsAre(0, 2));
}

TEST(ElasticMembershipTest, LeaveShrinks_TwoDeathsAtOnce_ThenBelowMinFallsBackToPending) {
  Membership m(6, 3);
  JoinAll(m);
  absl::StatusOr<Membership::LeaveResult> left = m.Leave(5, "finished early", kT0, "j");
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->change.shrunk);
  EXPECT_EQ(m.generation(), 2);
  const MembershipChange two = m.Die({0, 1}, "ranks 0, 1 heartbeat timeout", kT0);
  EXPECT_TRUE(two.shrunk);
  EXPECT_EQ(m.generation(), 3);
  EXPECT_EQ(m.round_size(), 3);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(0, 1, 5));
  // 2 of 6 alive, min 3: fails loudly, as a strict job does.
  const MembershipChange below = m.Die({3}, "rank 3 heartbeat timeout", kT0);
  EXPECT_TRUE(below.generation_changed);
  EXPECT_FALSE(below.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(m.round_size(), 0);
}

TEST(ElasticMembershipTest, JoinWhileRunningElastic_FailedPreconditionNamingVacancies) {
  Membership m(4, 2);
  JoinAll(m);
  m.Die({1}, "rank 1 heartbeat timeout", kT0);
  absl::StatusOr<Membership::JoinResult> j = m.Join("new", "h", 1, kT0, "j");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(j.status().message(), HasSubstr("vacant: 1"));
  EXPECT_THAT(j.status().message(), HasSubstr("min_world_size"));
}

TEST(ElasticSpecTest, MinWorldSizeOutOfRange_InvalidArgument) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(job_id: "e" world_size: 4 mode: PERIODIC levels { period: 1 group_size: 4 })pb",
      &spec));
  for (int v : {0, 1, 4}) {
    spec.set_min_world_size(v);
    EXPECT_TRUE(ScheduleSpecFromProto(spec).ok()) << v;
  }
  for (int v : {-1, 5}) {
    spec.set_min_world_size(v);
    absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
    ASSERT_FALSE(s.ok()) << v;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("min_world_size"));
  }
}

// Through the Job: the decisions and GetJob of a shrunk job.
class ElasticJobTest : public ::testing::Test {
 protected:
  ElasticJobTest() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    registry_ = std::make_unique<JobRegistry>(options);
  }

  // World 4: levels (period 1, groups of 2), (period 2, the world); min_world_size 1.
  std::shared_ptr<Job> MakeRunningJob() {
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        R"pb(job_id: "e" world_size: 4 mode: HIERARCHICAL min_world_size: 1
             levels { period: 1 group_size: 2 } levels { period: 2 group_size: 4 })pb",
        &spec));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry_->Find("e");
    for (int r = 0; r < 4; ++r) {
      v1::JoinRequest request;
      request.set_job_id("e");
      request.set_worker_id(absl::StrCat("w", r));
      request.set_rank(r);
      job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                [this](absl::StatusOr<v1::JoinResponse> r) {
                  if (r.ok()) credentials_[r->rank()] = r->credential();
                });
    }
    return job;
  }

  // Every rank but `dead` heartbeats; then the clock passes the heartbeat timeout.
  void Kill(Job& job, std::vector<int> dead, int64_t generation) {
    clock_.Advance(absl::Seconds(2));
    for (int r = 0; r < 4; ++r) {
      if (std::find(dead.begin(), dead.end(), r) != dead.end()) continue;
      v1::HeartbeatRequest hb;
      hb.set_job_id("e");
      hb.set_rank(r);
      hb.set_generation(generation);
      hb.set_step(3);
      hb.set_credential(credentials_[r]);
      v1::HeartbeatResponse reply;
      if (job.Heartbeat(hb, &reply).ok() && reply.generation() == generation) continue;
    }
    clock_.Advance(absl::Seconds(2));
    job.CheckStaleness();
  }

  FakeClock clock_;
  std::unique_ptr<JobRegistry> registry_;
  // rank -> its member's credential (JoinResponse.credential).
  std::map<int, std::string> credentials_;
};

TEST_F(ElasticJobTest, DeadRank_DecisionsListLiveMembers_EmptyBlockDoesNotAverage) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Kill(*job, {3}, 1);
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.state(), v1::RUNNING);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 3);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(3));
  EXPECT_THAT(state.last_change().reason(), HasSubstr("rank 3"));

  v1::GetScheduleRequest req;
  req.set_job_id("e");
  req.set_from_step(1);
  req.set_count(2);  // step 1: level 0 (pairs); step 2: level 1 (the world)
  req.set_rank(2);
  v1::GetScheduleResponse resp;
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  ASSERT_EQ(resp.decisions_size(), 2);
  EXPECT_THAT(resp.decisions(0).ranks(), ElementsAre(2, 3));
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(2));
  EXPECT_THAT(resp.decisions(1).members(), ElementsAre(0, 1, 2));
  EXPECT_EQ(resp.decisions(1).generation(), 2);

  // Both ranks of block 1 gone: listed for every subgroup, block 1 no longer averages.
  Kill(*job, {2, 3}, 2);
  state.Clear();
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 3);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(2, 3));
  req.clear_rank();
  req.set_count(1);
  resp.Clear();
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  ASSERT_EQ(resp.decisions_size(), 1);
  EXPECT_EQ(resp.decisions(0).subgroup(), 0);
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(0, 1));
}

TEST_F(ElasticJobTest, StrictJob_DecisionMembersEqualRanks) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(job_id: "e" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 })pb",
      &spec));
  ASSERT_TRUE(registry_->CreateJob(spec, nullptr).ok());
  std::shared_ptr<Job> job = *registry_->Find("e");
  v1::GetScheduleRequest req;
  req.set_job_id("e");
  req.set_from_step(0);
  req.set_count(1);
  v1::GetScheduleResponse resp;
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(0, 1));
  v1::Job state;
  job->ToProto(&state);
  EXPECT_THAT(state.vacant_ranks(), IsEmpty());
}

}  // namespace
}  // namespace modelavg::server
