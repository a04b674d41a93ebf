// A member that found non-finite values in its contribution to a round reports it
// (ReportNonFinite). The coordinator records every report (Job.nonfinite_reports and
// last_nonfinite, a MEMBER_NON_FINITE event, the metric's figure); an elastic job retires the
// member as a failed one (DEAD, the report as the generation change's reason, the survivors in a
// new generation), a strict job keeps its generation (its members all failed the round and
// nothing changed). Bad reports are refused saying what is wrong, and a report that cannot be
// written changes nothing.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/printable.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "tests/unit/running_job_fixture.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

class NonFiniteReportTest : public RunningJobTest {
 protected:
  NonFiniteReportTest() : RunningJobTest("nf") {}

  v1::ReportNonFiniteRequest Report(int rank, int64_t generation = 1) {
    v1::ReportNonFiniteRequest req;
    req.set_job_id("nf");
    req.set_rank(rank);
    req.set_generation(generation);
    req.set_credential(credentials_[rank]);
    req.set_step(30);
    req.set_level(0);
    req.set_tensor(2);
    req.set_value("NaN");
    req.set_payload("parameters");
    return req;
  }

  absl::StatusOr<v1::ReportNonFiniteResponse> Send(Job& job,
                                                   const v1::ReportNonFiniteRequest& req) {
    v1::ReportNonFiniteResponse resp;
    absl::Status s = job.ReportNonFinite(req, &resp);
    if (!s.ok()) return s;
    return resp;
  }
};

// ReportNonFinite.payload reached the log raw: ESC and BEL sequences from a member could
// retitle or clear the terminal of whoever reads it. Now it is escaped in the log line, the
// recorded report and the generation change's reason.
TEST_F(NonFiniteReportTest, PayloadWithControlCharacters_EscapedInTheLogAndTheRecord) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  spdlog::default_logger()->sinks().push_back(sink);
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  v1::ReportNonFiniteRequest req = Report(3);
  req.set_payload("x\x1b]0;owned\x07\x1b[2J\xe2\x80\xaeparameters");
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, req);
  spdlog::default_logger()->sinks().pop_back();
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string escaped = "x\\e]0;owned\\x07\\e[2J\\u202eparameters";
  std::string logged;
  for (const std::string& line : sink->last_formatted()) {
    // (each line as formatted, less its end of line)
    if (absl::StrContains(line, "non-finite")) absl::StrAppend(&logged, absl::StripTrailingAsciiWhitespace(line));
  }
  EXPECT_THAT(logged, HasSubstr(escaped));
  const v1::Job state = State(*job);
  EXPECT_EQ(state.last_nonfinite().payload(), escaped);
  EXPECT_THAT(state.last_change().reason(), HasSubstr(escaped));
  for (const std::string& text : {logged, state.last_nonfinite().payload(),
                                  state.last_change().reason()}) {
    EXPECT_EQ(FindControlCharacter(text), absl::string_view::npos) << text;
  }
}

TEST_F(NonFiniteReportTest, ElasticJob_RetiresTheMemberWithTheReportAsReason) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  auto events = std::make_shared<RecordedEvents>();
  job->Watch(events);
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, Report(3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->retired());
  EXPECT_EQ(r->generation(), 2);
  EXPECT_EQ(r->state(), v1::RUNNING);

  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 3);
  EXPECT_THAT(state.vacant_ranks(), ::testing::ElementsAre(3));
  EXPECT_EQ(state.deaths(), 1);
  EXPECT_EQ(state.nonfinite_reports(), 1);
  EXPECT_EQ(state.last_nonfinite().rank(), 3);
  EXPECT_EQ(state.last_nonfinite().step(), 30);
  EXPECT_EQ(state.last_nonfinite().tensor(), 2);
  EXPECT_EQ(state.last_nonfinite().value(), "NaN");
  EXPECT_TRUE(state.last_nonfinite().retired());
  EXPECT_EQ(state.last_change().rank(), 3);
  EXPECT_EQ(state.last_change().reason(),
            "rank 3 contributed non-finite values (NaN in tensor 2 of its parameters) at step "
            "30, level 0");
  EXPECT_EQ(job->GetStats().nonfinite_reports, 1);
  // The history shows it as the generation change's reason.
  const std::vector<v1::GenerationChange> history = job->GenerationHistory();
  ASSERT_FALSE(history.empty());
  EXPECT_THAT(history.back().reason(), HasSubstr("non-finite values"));

  // Events: the report, then the generation change.
  std::vector<v1::JobEvent> seen = events->events();
  std::vector<v1::JobEvent::Kind> kinds;
  for (const v1::JobEvent& e : seen) kinds.push_back(e.kind());
  EXPECT_THAT(kinds, ::testing::ElementsAre(v1::JobEvent::SNAPSHOT,
                                            v1::JobEvent::MEMBER_NON_FINITE,
                                            v1::JobEvent::GENERATION_CHANGED));
  EXPECT_EQ(seen[1].rank(), 3);
  EXPECT_THAT(seen[1].message(), HasSubstr("retired"));

  // A second report by the same (now dead) rank is recorded and changes nothing.
  absl::StatusOr<v1::ReportNonFiniteResponse> again = Send(*job, Report(3));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->retired());
  EXPECT_EQ(again->generation(), 2);
  EXPECT_EQ(State(*job).nonfinite_reports(), 2);
  EXPECT_EQ(State(*job).deaths(), 1);
}

// Sharded replicas (replica_size): the reporting rank's whole replica is retired, as after a
// death (its other rank RETIRED by it), in one generation change; the other replica goes on.
TEST_F(NonFiniteReportTest, ElasticShardedJob_RetiresTheWholeReplica) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2 replica_size: 2");
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, Report(3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->retired());
  EXPECT_EQ(r->generation(), 2);
  EXPECT_EQ(r->state(), v1::RUNNING);
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 2);
  EXPECT_THAT(state.vacant_ranks(), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(state.members(3).state(), v1::DEAD);
  EXPECT_EQ(state.members(2).state(), v1::RETIRED);
  EXPECT_EQ(state.members(2).retired_by(), 3);
  EXPECT_EQ(state.members(0).state(), v1::ALIVE);
  EXPECT_EQ(state.members(1).state(), v1::ALIVE);
  EXPECT_EQ(state.nonfinite_reports(), 1);
  EXPECT_TRUE(state.last_nonfinite().retired());
  EXPECT_THAT(state.last_change().reason(), HasSubstr("non-finite values"));
  EXPECT_THAT(state.last_change().reason(), HasSubstr("replica 1 (ranks 2..3) retired"));
  ASSERT_EQ(job->GenerationHistory().size(), 2u);  // the start, then the report and its replica
}

TEST_F(NonFiniteReportTest, StrictJob_RecordedGenerationStays) {
  std::shared_ptr<Job> job = RunningJob("");
  auto events = std::make_shared<RecordedEvents>();
  job->Watch(events);
  v1::ReportNonFiniteRequest req = Report(1);
  req.set_value("-Inf");
  req.set_payload("pseudo-gradient");
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->retired());
  EXPECT_EQ(r->generation(), 1);
  EXPECT_EQ(r->state(), v1::RUNNING);
  const v1::Job state = State(*job);
  EXPECT_EQ(state.generation(), 1);
  EXPECT_EQ(state.deaths(), 0);
  EXPECT_EQ(state.nonfinite_reports(), 1);
  EXPECT_EQ(state.last_nonfinite().value(), "-Inf");
  EXPECT_EQ(state.last_nonfinite().payload(), "pseudo-gradient");
  EXPECT_FALSE(state.last_nonfinite().retired());
  std::vector<v1::JobEvent> seen = events->events();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].kind(), v1::JobEvent::MEMBER_NON_FINITE);
  EXPECT_EQ(seen[1].message(),
            "rank 1 contributed non-finite values (-Inf in tensor 2 of its pseudo-gradient) at "
            "step 30, level 0");
}

TEST_F(NonFiniteReportTest, BadReports_InvalidArgumentNamingTheField) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  struct Case {
    std::string what;
    std::function<void(v1::ReportNonFiniteRequest&)> spoil;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"rank", [](auto& r) { r.set_rank(4); }, "rank 4 is outside [0, 4)"},
      {"step", [](auto& r) { r.set_step(-1); }, "step -1"},
      {"level", [](auto& r) { r.set_level(1); }, "level 1"},
      {"tensor", [](auto& r) { r.set_tensor(-2); }, "tensor -2"},
      {"value", [](auto& r) { r.set_value("1.0"); }, "\"NaN\", \"+Inf\" or \"-Inf\""},
      {"payload", [](auto& r) { r.set_payload(std::string(65, 'x')); }, "at most 64"},
  };
  for (const Case& c : cases) {
    v1::ReportNonFiniteRequest req = Report(0);
    c.spoil(req);
    absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, req);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr(c.says)) << c.what;
  }
  // Another rank's credential.
  v1::ReportNonFiniteRequest req = Report(0);
  req.set_credential(credentials_[1]);
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  // Nothing was recorded.
  EXPECT_EQ(State(*job).nonfinite_reports(), 0);
  EXPECT_EQ(State(*job).generation(), 1);
}

TEST_F(NonFiniteReportTest, UnwrittenRetirement_ChangesAndRecordsNothing) {
  std::shared_ptr<Job> job = RunningJob("min_world_size: 2");
  store_.FailWrites(absl::InternalError("disk full"));
  absl::StatusOr<v1::ReportNonFiniteResponse> r = Send(*job, Report(2));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_EQ(State(*job).generation(), 1);
  EXPECT_EQ(State(*job).nonfinite_reports(), 0);
  // The retry, once the store takes it, retires the member.
  store_.FailWrites(absl::OkStatus());
  r = Send(*job, Report(2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->retired());
  EXPECT_EQ(State(*job).generation(), 2);
}

}  // namespace
}  // namespace modelavg::server
