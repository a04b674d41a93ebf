// A worker asked to stop (SIGTERM from `docker stop`, `podman stop` or a scheduler; SIGINT from
// Ctrl-C) leaves its job at once and exits with 128 + the signal, wherever it is: waiting for the
// world to join, sleeping between steps, or averaging while its peers stop too. The job then is
// FINISHED (a strict job whose every member left) or shrunk (an elastic job that goes on without
// it), and every value printed before the stop follows the averaging rule.
#include <signal.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

// How soon a stopped worker must be gone: the "within a second", with room for a loaded
// machine, and far below a container engine's grace period (10 s) before it kills.
constexpr absl::Duration kStopBound = absl::Seconds(2);

std::unique_ptr<Process> StartTraceWorker(Cluster& cluster, const std::string& job, int rank,
                                          int world, int64_t steps,
                                          std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                   "--coordinator=" + cluster.coordinator().address(),
                                   "--job=" + job,
                                   absl::StrCat("--rank=", rank),
                                   absl::StrCat("--world_size=", world),
                                   absl::StrCat("--steps=", steps),
                                   "--numel=64",
                                   "--join_timeout_ms=60000",
                                   "--collective_timeout_ms=60000"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return std::make_unique<Process>(argv,
                                   absl::StrCat(cluster.dir(), "/", job, "-rank", rank));
}

// Waits until `p` printed at least `lines` lines (or fails the test).
void WaitForLines(Process& p, size_t lines) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (p.OutLines().size() < lines && absl::Now() < deadline) {
    ASSERT_FALSE(p.Wait(absl::ZeroDuration()).has_value()) << p.err();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_GE(p.OutLines().size(), lines) << p.err();
}

// The job's state once it settles on `want` (or what it is at the deadline).
v1::JobState JobStateWithin(Cluster& cluster, const std::string& job, v1::JobState want) {
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::StatusOr<v1::Job> got = cluster.admin()->GetJob(job);
    if (got.ok()) state = got->state();
    if (state == want) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  return state;
}

TEST(StopSignalTest, SigtermWhileJoining_ExitsAtOnceWith143) {
  Cluster cluster("stop-joining");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()->CreateJob(MakeSpec("j", 2, v1::PERIODIC, {{1, 2}}, 0)).ok());
  // Rank 1 never comes: rank 0 waits for the world (join timeout 60 s).
  std::unique_ptr<Process> w = StartTraceWorker(cluster, "j", 0, 2, 10);
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time sent = absl::Now();
  w->Signal(SIGTERM);
  std::optional<int> code = w->Wait(kStopBound);
  ASSERT_TRUE(code.has_value()) << "still waiting for the world " << kStopBound
                                << " after SIGTERM";
  EXPECT_EQ(*code, 128 + SIGTERM) << w->err();
  EXPECT_THAT(w->err(), HasSubstr("stopped by SIGTERM while joining job j"));
  EXPECT_LT(absl::Now() - sent, kStopBound);
}

TEST(StopSignalTest, SigintBetweenSteps_LeavesAtOnceWith130) {
  Cluster cluster("stop-delay");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()->CreateJob(MakeSpec("d", 2, v1::PERIODIC, {{1, 2}}, 0)).ok());
  // Each sleeps a minute before every call: the signal comes in the middle of that sleep.
  std::vector<std::unique_ptr<Process>> w;
  for (int r = 0; r < 2; ++r) {
    w.push_back(StartTraceWorker(cluster, "d", r, 2, 10, {"--step_delay_ms=60000"}));
  }
  // Both joined (the job runs), then both are stopped in the middle of their minute's sleep.
  // The coordinator counts the job RUNNING before each worker has read its Join's answer (on a
  // loaded machine, milliseconds later): a signal in between cuts the Join short instead. Two
  // seconds leave every worker past its Join and still 58 s from its first call.
  ASSERT_EQ(JobStateWithin(cluster, "d", v1::RUNNING), v1::RUNNING);
  absl::SleepFor(absl::Seconds(2));
  for (auto& p : w) p->Signal(SIGINT);
  for (int r = 0; r < 2; ++r) {
    std::optional<int> code = w[r]->Wait(kStopBound);
    ASSERT_TRUE(code.has_value()) << "rank " << r << " slept on after SIGINT";
    EXPECT_EQ(*code, 128 + SIGINT) << w[r]->err();
    EXPECT_THAT(w[r]->err(), HasSubstr("stopped by SIGINT at step 0; left job d"));
  }
  EXPECT_EQ(JobStateWithin(cluster, "d", v1::FINISHED), v1::FINISHED);
}

TEST(StopSignalTest, SigtermToEveryRankMidRun_EachLeavesAndTheStrictJobFinishes) {
  Cluster cluster("stop-all");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  // Pairs every step, all four every 2: a rank is always in a round with others, so that some
  // are in a call when a peer leaves.
  ASSERT_TRUE(
      cluster.admin()->CreateJob(MakeSpec("all", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0)).ok());
  std::vector<std::unique_ptr<Process>> w;
  for (int r = 0; r < 4; ++r) w.push_back(StartTraceWorker(cluster, "all", r, 4, 1000000));
  ASSERT_NO_FATAL_FAILURE(WaitForLines(*w[0], 50));
  for (auto& p : w) p->Signal(SIGTERM);
  std::vector<Trace> traces;
  for (int r = 0; r < 4; ++r) {
    std::optional<int> code = w[r]->Wait(kStopBound);
    ASSERT_TRUE(code.has_value()) << "rank " << r << " ran on after SIGTERM";
    EXPECT_EQ(*code, 128 + SIGTERM) << w[r]->err();
    EXPECT_THAT(w[r]->err(), HasSubstr("left job all")) << "rank " << r;
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), w[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    traces.push_back(*std::move(t));
  }
  EXPECT_EQ(JobStateWithin(cluster, "all", v1::FINISHED), v1::FINISHED);
  // What each printed before it stopped follows the rule (a stopped rank prints no line for
  // the step it stopped at).
  TraceCheckResult check = CheckTraces(traces, {2, 4});
  EXPECT_TRUE(check.ok()) << check.Report();
}

TEST(StopSignalTest, SigtermToOneRankOfAnElasticJob_TheOthersGoOnWithoutIt) {
  Cluster cluster("stop-elastic");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  v1::JobSpec spec = MakeSpec("el", 3, v1::PERIODIC, {{1, 3}}, 0, /*heartbeat_ms=*/3000);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  constexpr int64_t kSteps = 400;
  std::vector<std::unique_ptr<Process>> w;
  for (int r = 0; r < 3; ++r) {
    w.push_back(StartTraceWorker(cluster, "el", r, 3, kSteps, {"--step_delay_ms=5"}));
  }
  ASSERT_NO_FATAL_FAILURE(WaitForLines(*w[2], 30));
  w[2]->Signal(SIGTERM);
  std::optional<int> code = w[2]->Wait(kStopBound);
  ASSERT_TRUE(code.has_value()) << "rank 2 ran on after SIGTERM";
  EXPECT_EQ(*code, 128 + SIGTERM) << w[2]->err();
  std::vector<Trace> traces;
  for (int r = 0; r < 3; ++r) {
    std::optional<int> c = w[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(c.has_value()) << "rank " << r;
    if (r < 2) EXPECT_EQ(*c, 0) << w[r]->err();
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), w[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    traces.push_back(*std::move(t));
  }
  // The survivors ran every step, the last ones without rank 2; the rule holds throughout.
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    EXPECT_EQ(traces[r].lines.back().members, (std::vector<int32_t>{0, 1})) << "rank " << r;
  }
  TraceCheckResult check = CheckTraces(traces, {3});
  EXPECT_TRUE(check.ok()) << check.Report();
  // An orderly departure: no death counted.
  absl::StatusOr<v1::Job> job = cluster.admin()->GetJob("el");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->deaths(), 0);
}

}  // namespace
}  // namespace modelavg::testing
