// Real NCCL ranks on one GPU: every rank a modelavg-trace-worker process (--backend=nccl) with
// its own NCCL_HOSTID, so that NCCL takes them for different hosts (it refuses two ranks of one
// communicator on one GPU of one host: "Duplicate GPU detected") and joins them over its socket
// transport. A coordinator on loopback; values checked by the averaging rule alone
// (tests/integration/trace_check.h), every rank, every step, as the Gloo trace tests do.
//
// Covered: 2, 4 and 8 ranks, in place (one buffer: zero copy) and staged (256 tensors apart in
// memory at misaligned offsets); a three-level hierarchical job of 8; an elastic job where one
// rank is killed with SIGKILL and a replacement is admitted; a rank stopped with SIGSTOP, whose
// peers must fail within heartbeat timeout + 1 s (+ a start-up margin). Float32 only (the trace
// worker's dtype). Skips without a usable CUDA device, saying why; fails instead with
// MODELAVG_REQUIRE_GPU=1. The programs it starts are the build's, or those named by the
// environment variables MODELAVG_COORDINATOR_BIN and MODELAVG_TRACE_WORKER_BIN (a packed copy
// on another machine, bench/gpu_bench.sh --prebuilt).
#include <signal.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/gpu/gpu_test_env.h"

namespace modelavg::testing {
// The environment's `name`, else the build's program.
inline std::string ProgramFromEnv(const char* name, const char* built) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(built);
}
}  // namespace modelavg::testing
#define MODELAVG_COORDINATOR_BIN \
  ::modelavg::testing::ProgramFromEnv("MODELAVG_COORDINATOR_BIN", MODELAVG_COORDINATOR_BIN_DEFAULT)
#define MODELAVG_TRACE_WORKER_BIN \
  ::modelavg::testing::ProgramFromEnv("MODELAVG_TRACE_WORKER_BIN", MODELAVG_TRACE_WORKER_BIN_DEFAULT)
// The harness's Gloo worker is not used here.
#define MODELAVG_CLIENT_WORKER_BIN "unused"
#include "tests/integration/client_job_harness.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

constexpr int64_t kHeartbeatMs = 2000;

class NcclMultiRankTest : public ::testing::Test {
 protected:
  void SetUp() override { MODELAVG_REQUIRE_OR_SKIP_GPU(); }

  // Starts a trace worker for `job` (rank -1: a replacement, any rank) with its own host id.
  Process* Start(Cluster& cluster, const std::string& job, int world, int rank,
                 const std::vector<std::string>& flags) {
    const int index = static_cast<int>(workers_.size());
    std::vector<std::string> argv = {
        "/usr/bin/env", absl::StrCat("NCCL_HOSTID=modelavg-", job, "-", index),
        "NCCL_DEBUG=WARN", MODELAVG_TRACE_WORKER_BIN,
        "--coordinator=" + cluster.coordinator().address(), "--job=" + job,
        absl::StrCat("--world_size=", world), "--backend=nccl", "--join_timeout_ms=60000",
        "--collective_timeout_ms=60000", "--log_level=info"};
    if (rank >= 0) argv.push_back(absl::StrCat("--rank=", rank));
    for (const std::string& f : flags) argv.push_back(f);
    workers_.push_back(std::make_unique<Process>(
        argv, absl::StrCat(cluster.dir(), "/", job, "-worker", index)));
    return workers_.back().get();
  }

  // Starts ranks 0..world-1 of `job` with `flags` and waits for every one to exit 0 (call it
  // inside ASSERT_NO_FATAL_FAILURE).
  void RunWorld(Cluster& cluster, const std::string& job, int world,
                const std::vector<std::string>& flags) {
    for (int r = 0; r < world; ++r) Start(cluster, job, world, r, flags);
    for (auto& w : workers_) {
      const std::optional<int> code = w->Wait(absl::Seconds(240));
      ASSERT_TRUE(code.has_value()) << "a rank hung" << Errors();
      ASSERT_EQ(*code, 0) << Errors();
    }
  }

  std::vector<Trace> Traces() {
    std::vector<Trace> out;
    for (size_t i = 0; i < workers_.size(); ++i) {
      absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("worker ", i), workers_[i]->out());
      EXPECT_TRUE(t.ok()) << t.status();
      if (t.ok()) out.push_back(*std::move(t));
    }
    return out;
  }

  // Every averaging of `traces` is the mean of its members; returns how many were checked.
  int64_t ExpectTracesHold(const std::vector<int32_t>& group_sizes) {
    const TraceCheckResult r = CheckTraces(Traces(), group_sizes);
    EXPECT_TRUE(r.errors.empty()) << absl::StrJoin(r.errors, "\n");
    return r.averages;
  }

  std::string Errors() {
    std::string s;
    for (size_t i = 0; i < workers_.size(); ++i) {
      const std::string& e = workers_[i]->err();
      absl::StrAppend(&s, "\nworker ", i, " stderr (tail):\n",
                      e.size() > 2000 ? e.substr(e.size() - 2000) : e);
    }
    return s;
  }

  std::vector<std::unique_ptr<Process>> workers_;
};

struct WorldCase {
  const char* name;
  int world;
  v1::Mode mode;
  std::vector<std::pair<int64_t, int32_t>> levels;
  bool staged;
};

class NcclWorldTest : public NcclMultiRankTest, public ::testing::WithParamInterface<WorldCase> {};

TEST_P(NcclWorldTest, EveryRankEveryStep_TheMeanOfItsGroup) {
  const WorldCase& c = GetParam();
  Cluster cluster(absl::StrCat("nccl-", c.name));
  ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
  const std::string job = c.name;
  ASSERT_TRUE(cluster.admin()->CreateJob(MakeSpec(job, c.world, c.mode, c.levels, 1)).ok());
  constexpr int64_t kSteps = 12;
  std::vector<std::string> flags = {absl::StrCat("--steps=", kSteps), "--numel=300000"};
  if (c.staged) {
    flags.push_back("--tensors=256");
    flags.push_back("--cuda_gap_elems=3");
  }
  for (int r = 0; r < c.world; ++r) Start(cluster, job, c.world, r, flags);
  for (auto& w : workers_) {
    const std::optional<int> code = w->Wait(absl::Seconds(180));
    ASSERT_TRUE(code.has_value()) << "a rank hung" << Errors();
    ASSERT_EQ(*code, 0) << Errors();
  }
  std::vector<int32_t> sizes;
  for (const auto& l : c.levels) sizes.push_back(l.second);
  EXPECT_GT(ExpectTracesHold(sizes), 0);
  for (const Trace& t : Traces()) EXPECT_EQ(t.lines.size(), static_cast<size_t>(kSteps)) << t.who;
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, NcclWorldTest,
    ::testing::Values(
        WorldCase{"w2", 2, v1::PERIODIC, {{1, 2}}, false},
        WorldCase{"w2staged", 2, v1::PERIODIC, {{1, 2}}, true},
        WorldCase{"w4", 4, v1::PERIODIC, {{2, 4}}, false},
        WorldCase{"w4staged", 4, v1::PERIODIC, {{2, 4}}, true},
        WorldCase{"w8", 8, v1::PERIODIC, {{1, 8}}, false},
        WorldCase{"w8staged", 8, v1::PERIODIC, {{1, 8}}, true},
        WorldCase{"h8", 8, v1::HIERARCHICAL, {{1, 2}, {2, 4}, {4, 8}}, false},
        WorldCase{"h8staged", 8, v1::HIERARCHICAL, {{1, 2}, {2, 4}, {4, 8}}, true}),
    [](const ::testing::TestParamInfo<WorldCase>& i) { return std::string(i.param.name); });

// Streaming sync on CUDA parameters through real NCCL ranks: one outer level of 4 fragments,
// each fragment's INT8 pseudo-gradient all-reduced in the background for sync_delay steps and
// mixed with the local parameters, every rank every step against the streaming reference within
// the INT8 bound (docs/streaming.md), as tests/integration/client_streaming_test checks Gloo.
TEST_F(NcclMultiRankTest, Streaming_Fragments_Delay_Mix_Int8_EveryRankFollowsTheReference) {
  Cluster cluster("nccl-streaming");
  ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
  constexpr int kWorld = 4;
  constexpr int kTensors = 8;
  constexpr int64_t kSteps = 34;
  v1::JobSpec spec;
  spec.set_job_id("nccl-streaming");
  spec.set_world_size(kWorld);
  spec.set_warmup_steps(1);
  spec.set_mode(v1::PERIODIC);
  v1::Level* l = spec.add_levels();
  l->set_period(8);
  l->set_group_size(kWorld);
  l->set_fragments(4);
  l->set_sync_delay(1);
  l->set_mix(0.5);
  l->set_payload(v1::INT8);
  l->mutable_outer()->set_lr(1.0);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  // 8 tensors of 1001 elements: a fragment's parts (one per rank) straddle its two tensors, so
  // an INT8 block mixes them.
  ASSERT_NO_FATAL_FAILURE(RunWorld(
      cluster, spec.job_id(), kWorld,
      {absl::StrCat("--steps=", kSteps), absl::StrCat("--numel=", kTensors * 1001),
       absl::StrCat("--tensors=", kTensors)}));
  const std::vector<Trace> traces = Traces();
  ASSERT_EQ(traces.size(), static_cast<size_t>(kWorld));
  const auto want = StreamingReference(spec, kSteps, kTensors);
  int inexact = 0;
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << traces[r].who;
    std::vector<double> allowed(kTensors, 0.0);
    for (int64_t s = 0; s < kSteps; ++s) {
      const TraceLine& line = traces[r].lines[s];
      const StreamingStep& w = want[s][line.rank];
      EXPECT_EQ(line.action, w.average ? "AVERAGE" : "SKIP") << line.text;
      if (w.average) EXPECT_EQ(line.fragment, w.fragment) << line.text;
      ASSERT_EQ(line.values.size(), static_cast<size_t>(kTensors)) << line.text;
      double m_fragment = 0;
      for (double m : w.max_delta) m_fragment = std::max(m_fragment, m);
      for (int t = 0; t < kTensors; ++t) {
        // INT8: 2 M / 254 per outer step, M at most the fragment's largest |A - x|.
        if (w.max_delta[t] > 0) allowed[t] += 2 * m_fragment / 254 * 1.01;
        const double tol = std::max(1e-4, 2e-6 * std::fabs(w.values[t])) + allowed[t];
        EXPECT_NEAR(line.values[t], w.values[t], tol) << line.text << " tensor " << t;
        inexact += std::fabs(line.values[t] - w.values[t]) > 1e-3;
      }
    }
  }
  EXPECT_GT(inexact, 0) << "the payload was not compressed";
}

// Error feedback on CUDA parameters through real NCCL ranks (the device residual, the INT4
// kernels, StreamingLevel's device glue): one outer level of 2 fragments of 32 elements (one
// INT4 block each), INT4 with error_feedback 0.9, blocking (with a mix) and with sync_delay 1,
// every rank every step against the streaming reference that models the payload and the
// residual (model_payload), as tests/integration/client_streaming_test's ClientFeedbackTest
// checks Gloo.
TEST_F(NcclMultiRankTest, Streaming_Int4_ErrorFeedback_EveryRankFollowsTheModelledReference) {
  constexpr int kWorld = 4;
  constexpr int kTensors = 8;
  constexpr int64_t kSteps = 26;
  for (int64_t delay : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("sync_delay ", delay));
    const std::string job = absl::StrCat("nccl-feedback-", delay);
    Cluster cluster(job);
    ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
    v1::JobSpec spec;
    spec.set_job_id(job);
    spec.set_world_size(kWorld);
    spec.set_warmup_steps(1);
    spec.set_mode(v1::PERIODIC);
    v1::Level* l = spec.add_levels();
    l->set_period(4);
    l->set_group_size(kWorld);
    l->set_fragments(2);
    l->set_payload(v1::INT4);
    l->set_error_feedback(0.9);
    l->set_sync_delay(delay);
    if (delay == 0) l->set_mix(0.25);
    l->mutable_outer()->set_lr(0.7);
    l->mutable_outer()->set_momentum(0.9);
    l->mutable_outer()->set_nesterov(true);
    ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
    workers_.clear();
    ASSERT_NO_FATAL_FAILURE(RunWorld(
        cluster, job, kWorld,
        {absl::StrCat("--steps=", kSteps), absl::StrCat("--numel=", kTensors * 8),
         absl::StrCat("--tensors=", kTensors)}));
    const std::vector<Trace> traces = Traces();
    ASSERT_EQ(traces.size(), static_cast<size_t>(kWorld));
    const auto want = StreamingReference(spec, kSteps, kTensors, /*model_payload=*/true);
    const auto exact = StreamingReference(spec, kSteps, kTensors, /*model_payload=*/false);
    double apart = 0;
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << traces[r].who;
      for (int64_t s = 0; s < kSteps; ++s) {
        const TraceLine& line = traces[r].lines[s];
        const StreamingStep& w = want[s][line.rank];
        EXPECT_EQ(line.action, w.average ? "AVERAGE" : "SKIP") << line.text;
        ASSERT_EQ(line.values.size(), static_cast<size_t>(kTensors)) << line.text;
        for (int t = 0; t < kTensors; ++t) {
          const double tol = std::max(1e-4, 2e-6 * std::fabs(w.values[t]));
          EXPECT_NEAR(line.values[t], w.values[t], tol) << line.text << " tensor " << t;
          apart = std::max(apart, std::fabs(exact[s][line.rank].values[t] - w.values[t]));
        }
      }
    }
    EXPECT_GT(apart, 1e-2) << "the payload changed nothing: the test would not see it";
  }
}

TEST_F(NcclMultiRankTest, Elastic_OneRankKilled_ReplacementAdmitted_ValuesHold) {
  Cluster cluster("nccl-elastic");
  ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
  const std::string job = "elastic";
  v1::JobSpec spec = MakeSpec(job, 4, v1::HIERARCHICAL, {{2, 2}, {5, 4}}, 0, kHeartbeatMs);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  const std::vector<std::string> flags = {"--steps=150", "--numel=200000", "--step_delay_ms=20"};
  for (int r = 0; r < 4; ++r) Start(cluster, job, 4, r, flags);
  absl::SleepFor(absl::Seconds(3));
  // SIGKILL of rank 2, most likely inside a collective (the steps are back to back).
  kill(-workers_[2]->pid(), SIGKILL);
  workers_[2]->Wait(absl::Seconds(10));
  absl::SleepFor(absl::Milliseconds(kHeartbeatMs + 1000));
  Start(cluster, job, 4, /*rank=*/-1, flags);
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (i == 2) continue;
    const std::optional<int> code = workers_[i]->Wait(absl::Seconds(180));
    ASSERT_TRUE(code.has_value()) << "worker " << i << " hung" << Errors();
    EXPECT_EQ(*code, 0) << "worker " << i << Errors();
  }
  const TraceCheckResult r = CheckTraces(Traces(), {2, 4});
  EXPECT_TRUE(r.errors.empty()) << absl::StrJoin(r.errors, "\n");
  EXPECT_GT(r.admissions, 0) << "the replacement was never admitted" << Errors();
}

TEST_F(NcclMultiRankTest, Strict_OneRankStopped_PeersFailWithinTheHeartbeatTimeout) {
  Cluster cluster("nccl-stop");
  ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
  const std::string job = "stop";
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec(job, 3, v1::PERIODIC, {{1, 3}}, 0, kHeartbeatMs))
                  .ok());
  for (int r = 0; r < 3; ++r) {
    Start(cluster, job, 3, r, {"--steps=1000000", "--numel=200000"});
  }
  absl::SleepFor(absl::Seconds(3));
  ASSERT_FALSE(workers_[0]->Wait(absl::ZeroDuration()).has_value()) << Errors();
  const absl::Time stopped = absl::Now();
  kill(-workers_[1]->pid(), SIGSTOP);
  for (int r : {0, 2}) {
    const std::optional<int> code = workers_[r]->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still waits for the stopped rank";
    EXPECT_NE(*code, 0) << "rank " << r << " should have failed";
    // The bound of the issue, plus the poll and exit time of a process.
    EXPECT_LE(absl::Now() - stopped, absl::Milliseconds(kHeartbeatMs + 1000 + 500))
        << "rank " << r << Errors();
  }
  kill(-workers_[1]->pid(), SIGCONT);
}

}  // namespace
}  // namespace modelavg::testing
