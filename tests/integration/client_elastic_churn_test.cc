// Churn in an elastic job, with real processes: 4 modelavg-trace-worker ranks over Gloo on
// loopback (levels (2,2) and (5,4), heartbeat timeout 2 s, min_world_size 2), and a loop that
// kills a rank with SIGKILL, waits until the coordinator counts 3 live ranks, and starts a
// replacement without --rank, which the job admits. A death moves the job to generation N and the
// admission to N+1 a moment later, so a survivor is often still connecting generation N's Gloo
// mesh when N is over: that set-up must be abandoned at once, never waited out.
//
// Asserted: no survivor stalls (the gap between two of its steps, from the workers' --unix_ms
// timestamps) longer than the heartbeat timeout plus 1 s; no survivor fails; every averaging is
// the mean of its members (trace_check.h). Printed: the longest stall and the cycles' pace.
// MODELAVG_CHURN_CYCLES overrides the number of cycles (default 100).
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/elastic_workers_fixture.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

constexpr int kWorld = 4;
const std::vector<int32_t> kGroupSizes = {2, 4};
constexpr int64_t kHeartbeatMs = 2000;
// The bound on a survivor's stall.
constexpr int64_t kMaxStallMs = kHeartbeatMs + 1000;
// One cycle's longest wait (a death is declared within the heartbeat timeout, a replacement is
// admitted within a few steps).
constexpr absl::Duration kCycleDeadline = absl::Seconds(30);

int Cycles() {
  int n = 100;
  if (const char* env = std::getenv("MODELAVG_CHURN_CYCLES")) (void)absl::SimpleAtoi(env, &n);
  return std::max(1, n);
}

class ElasticChurnTest : public ElasticWorkersTest {
 protected:
  ElasticChurnTest() : ElasticWorkersTest("churn", kWorld) {}

  void Start(const std::string& job, int rank) {
    StartWorker(job, rank, {"--steps=1000000", "--numel=64", "--step_delay_ms=50", "--unix_ms"});
    killed_.push_back(false);
  }

  // What worker i printed so far (it may be killed in the middle of a line).
  Trace TraceOf(size_t i) { return TraceSoFar(i); }

  // The rank a worker holds (from its trace; -1 before its first line).
  int RankOf(size_t i) {
    Trace t = TraceOf(i);
    return t.lines.empty() ? -1 : t.lines.front().rank;
  }

  int64_t Generation(const std::string& job) {
    absl::StatusOr<v1::Job> j = cluster_.admin()->GetJob(job);
    return j.ok() ? j->generation() : -1;
  }

  // Waits until the job, past generation `after`, counts `live` live ranks.
  bool WaitForLive(const std::string& job, int live, int64_t after = 0) {
    const absl::Time deadline = absl::Now() + kCycleDeadline;
    while (absl::Now() < deadline) {
      absl::StatusOr<v1::Job> j = cluster_.admin()->GetJob(job);
      if (j.ok() && j->generation() > after && j->live_world_size() == live) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // Waits until worker i has printed a step (false: the deadline passed).
  bool WaitForFirstStep(size_t i) {
    const absl::Time deadline = absl::Now() + kCycleDeadline;
    while (RankOf(i) < 0) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  // Fails the test if a worker that was not killed has exited.
  bool NoSurvivorExited() {
    bool ok = true;
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (killed_[i]) continue;
      if (std::optional<int> code = workers_[i]->Wait(absl::ZeroDuration()); code.has_value()) {
        ADD_FAILURE() << who_[i] << " exited with " << *code << ": "
                      << TailOf(workers_[i]->err(), 3000);
        ok = false;
      }
    }
    return ok;
  }

  std::string Diagnostics() { return ElasticWorkersTest::Diagnostics(1500); }

  std::vector<bool> killed_;  // by worker index: killed by the test
};

TEST_F(ElasticChurnTest, KillAndReplaceOneRankPerCycle_NoSurvivorStallsPastHeartbeatPlus1s) {
  ASSERT_TRUE(cluster_.ok());
  const std::string job = "churn";
  v1::JobSpec spec = MakeSpec(job, kWorld, v1::HIERARCHICAL, {{2, 2}, {5, 4}}, 0, kHeartbeatMs);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  for (int r = 0; r < kWorld; ++r) Start(job, r);
  ASSERT_TRUE(WaitForLive(job, kWorld)) << Diagnostics();
  for (size_t i = 0; i < workers_.size(); ++i) ASSERT_TRUE(WaitForFirstStep(i)) << Diagnostics();

  std::mt19937 random(2025);
  const int cycles = Cycles();
  const absl::Time started = absl::Now();
  for (int cycle = 0; cycle < cycles; ++cycle) {
    SCOPED_TRACE(absl::StrCat("cycle ", cycle));
    // The loop: kill a rank, wait for 3 live ranks, start a replacement (admitted a
    // moment after the death, while the survivors set up the meshes of the dead rank's
    // generation).
    // A victim holds a rank and has stepped (a replacement once it has been admitted).
    std::vector<size_t> live;
    const absl::Time deadline = absl::Now() + kCycleDeadline;
    while (live.empty() && absl::Now() < deadline) {
      for (size_t i = 0; i < workers_.size(); ++i) {
        if (!killed_[i] && RankOf(i) >= 0) live.push_back(i);
      }
      if (live.empty()) absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_FALSE(live.empty()) << "no worker holds a rank" << Diagnostics();
    const size_t victim = live[random() % live.size()];
    const int64_t before = Generation(job);
    workers_[victim]->Signal(SIGKILL);
    workers_[victim]->Wait(absl::Seconds(10));
    killed_[victim] = true;
    // 3 live ranks once the death is declared (a generation later, at least).
    ASSERT_TRUE(WaitForLive(job, kWorld - 1, before)) << "no 3 live ranks" << Diagnostics();
    Start(job, -1);
    // The replacement is admitted right after the death (its subgroup's survivors give it the
    // parameters); before the next kill, so that no subgroup loses every live member.
    ASSERT_TRUE(WaitForFirstStep(workers_.size() - 1))
        << "the replacement was not admitted" << Diagnostics();
    ASSERT_TRUE(NoSurvivorExited()) << Diagnostics();
  }
  const absl::Duration took = absl::Now() - started;
  // A last stretch without faults: every survivor goes on stepping.
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE(NoSurvivorExited()) << Diagnostics();
  const absl::Time ended = absl::Now();
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!killed_[i]) workers_[i]->Signal(SIGKILL);
  }

  // Stalls: the gaps between two consecutive steps of a worker while it was alive (a killed
  // worker's last gap may be cut by its death and does not count).
  int64_t longest = 0;
  std::string longest_at;
  std::vector<Trace> traces;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Trace t = TraceOf(i);
    for (size_t k = 1; k < t.lines.size(); ++k) {
      const int64_t gap = t.lines[k].unix_ms - t.lines[k - 1].unix_ms;
      if (gap > longest) {
        longest = gap;
        longest_at = absl::StrCat(who_[i], " between steps ", t.lines[k - 1].step,
                                  " and ", t.lines[k].step);
      }
      EXPECT_LE(gap, kMaxStallMs) << who_[i] << " stalled " << gap
                                  << " ms between steps " << t.lines[k - 1].step << " and "
                                  << t.lines[k].step;
    }
    // A survivor kept stepping up to the end (no silent hang).
    if (!killed_[i] && !t.lines.empty()) {
      EXPECT_GE(t.lines.back().unix_ms, absl::ToUnixMillis(ended) - kMaxStallMs)
          << who_[i] << " stopped stepping";
    }
    traces.push_back(std::move(t));
  }
  TraceCheckResult check = CheckTraces(traces, kGroupSizes);
  EXPECT_TRUE(check.ok()) << check.Report();
  EXPECT_GT(check.admissions, 0);
  if (HasFailure()) ADD_FAILURE() << Diagnostics();
  std::printf("[figures] churn: %d cycles in %s (%.1f s per cycle); longest stall of a survivor "
              "%lld ms (%s), bound %lld ms; %lld averaging lines, %lld admissions\n",
              cycles, absl::FormatDuration(absl::Trunc(took, absl::Seconds(1))).c_str(),
              absl::ToDoubleSeconds(took) / cycles, static_cast<long long>(longest),
              longest_at.c_str(), static_cast<long long>(kMaxStallMs),
              static_cast<long long>(check.averages), static_cast<long long>(check.admissions));
}

}  // namespace
}  // namespace modelavg::testing
