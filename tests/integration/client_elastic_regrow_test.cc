// Elastic jobs with real processes: 8 modelavg-trace-worker ranks over Gloo on loopback, three
// levels (pairs every 2 steps, quads every 4, all eight every 8), min_world_size 5, against a
// coordinator started here. Workers are killed (SIGKILL between calls and inside collectives,
// one, a whole pair, two of one quad), stopped (SIGSTOP), replaced by a worker started without a
// rank, and killed below min_world_size. Every survivor's trace is checked by the averaging rule
// alone (trace_check.h): each averaging result is the mean of that step's members' values before
// the call, whoever the members were.
//
// Figures (printed as "[figures]", never asserted): from the workers' --unix_ms timestamps, the
// time from a fault to the first averaging without the lost rank in a block that held it (the
// first survivor, and the last), and the longest pause between two steps of any survivor; for a
// replacement, the time from its start to its admission line.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/elastic_workers_fixture.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 8;
const std::vector<int32_t> kGroupSizes = {2, 4, 8};
// 2 s: a loaded CI machine must not make a healthy worker miss its heartbeats.
constexpr int64_t kHeartbeatMs = 2000;
// Every wait in these tests: far above a run's few seconds, far below the ctest timeout.
constexpr absl::Duration kRunDeadline = absl::Seconds(60);

v1::JobSpec ElasticSpec(const std::string& id, int32_t min_world_size = 5) {
  v1::JobSpec spec =
      MakeSpec(id, kWorld, v1::HIERARCHICAL, {{2, 2}, {4, 4}, {8, 8}}, 0, kHeartbeatMs);
  spec.set_min_world_size(min_world_size);
  return spec;
}

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

struct WorkerOptions {
  int rank = -1;  // -1: no --rank (the coordinator picks)
  int64_t steps = 40;
  int64_t step_delay_ms = 100;
  int64_t numel = 1000;
};
WorkerOptions Steps(int64_t steps, int64_t step_delay_ms, int64_t numel = 1000) {
  WorkerOptions o;
  o.steps = steps;
  o.step_delay_ms = step_delay_ms;
  o.numel = numel;
  return o;
}

class ElasticRegrowTest : public ElasticWorkersTest {
 protected:
  ElasticRegrowTest() : ElasticWorkersTest("regrow", kWorld) {}

  // Starts a trace worker; returns its index in workers_.
  size_t Start(const std::string& job, const WorkerOptions& o) {
    return StartWorker(job, o.rank,
                       {absl::StrCat("--steps=", o.steps), absl::StrCat("--numel=", o.numel),
                        absl::StrCat("--step_delay_ms=", o.step_delay_ms), "--unix_ms"});
  }

  // Starts ranks 0..7.
  void StartWorld(const std::string& job, WorkerOptions o) {
    for (int r = 0; r < kWorld; ++r) {
      o.rank = r;
      Start(job, o);
    }
  }

  // Waits until some worker of `among` has printed an AVERAGE line at `level` whose members
  // lack `rank` (the survivors have averaged without it).
  bool WaitForAverageWithout(const std::vector<size_t>& among, int32_t rank, int level,
                             absl::Duration timeout = kRunDeadline) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      bool running = false;
      for (size_t i : among) {
        running = running || !workers_[i]->Wait(absl::ZeroDuration()).has_value();
        for (const TraceLine& l : TraceOf(i).lines) {
          if (l.action == "AVERAGE" && l.level == level &&
              std::find(l.members.begin(), l.members.end(), rank) == l.members.end()) {
            return true;
          }
        }
      }
      if (!running) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // Waits for each worker of `which` (each within the same deadline); their exit codes,
  // nullopt for one still running at the deadline.
  std::vector<std::optional<int>> WaitFor(const std::vector<size_t>& which,
                                          absl::Duration timeout = kRunDeadline) {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<std::optional<int>> codes;
    for (size_t i : which) {
      codes.push_back(workers_[i]->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now())));
    }
    return codes;
  }

  // Every worker of `which` exits 0 having printed steps first..steps-1.
  void ExpectFinished(const std::vector<size_t>& which, int64_t steps) {
    std::vector<std::optional<int>> codes = WaitFor(which);
    bool diagnose = false;
    for (size_t k = 0; k < which.size(); ++k) {
      const size_t i = which[k];
      if (!codes[k].has_value()) {
        ADD_FAILURE() << who_[i] << " still running after "
                      << absl::FormatDuration(kRunDeadline);
        diagnose = true;
        continue;
      }
      if (*codes[k] != 0) {
        ADD_FAILURE() << who_[i] << " exited with " << *codes[k] << ": "
                      << LastLine(workers_[i]->err());
        diagnose = true;
        continue;
      }
      Trace t = TraceOf(i);
      if (t.lines.empty()) {
        ADD_FAILURE() << who_[i] << " printed nothing";
        continue;
      }
      EXPECT_EQ(t.lines.back().step, steps - 1) << who_[i];
      EXPECT_EQ(static_cast<int64_t>(t.lines.size()), steps - t.lines.front().step)
          << who_[i] << ": a step is missing";
    }
    if (diagnose) ADD_FAILURE() << Diagnostics();
  }

  // The checker over every worker's trace (the dead ones' too: their values feed the averages
  // they took part in).
  void ExpectTracesFollowTheRule() {
    std::vector<Trace> traces;
    for (size_t i = 0; i < workers_.size(); ++i) traces.push_back(TraceOf(i));
    TraceCheckResult r = CheckTraces(traces, kGroupSizes);
    EXPECT_TRUE(r.ok()) << r.Report() << Diagnostics();
    EXPECT_GT(r.averages, 0);
    std::printf("trace check: %lld averaging and %lld skipping lines, %lld admission(s)\n",
                static_cast<long long>(r.averages), static_cast<long long>(r.skips),
                static_cast<long long>(r.admissions));
  }

  // The sorted members of the last AVERAGE line at `level` of worker i (empty: none).
  std::vector<int32_t> LastMembersAt(size_t i, int level) {
    std::vector<int32_t> members;
    for (const TraceLine& l : TraceOf(i).lines) {
      if (l.action == "AVERAGE" && l.level == level) members = l.members;
    }
    return members;
  }

  // Prints the figures of a fault at `fault_ms` that took `lost` out, seen by `survivors`: when
  // the first and the last survivor first averaged without the lost ranks in a block that held
  // one, and the longest pause between two steps of a survivor.
  void PrintRecovery(const std::string& what, int64_t fault_ms, const std::set<int32_t>& lost,
                     const std::vector<size_t>& survivors) {
    int64_t first = -1, last = -1, pause = 0;
    for (size_t i : survivors) {
      const Trace t = TraceOf(i);
      int64_t mine = -1;
      for (size_t k = 0; k < t.lines.size(); ++k) {
        const TraceLine& l = t.lines[k];
        if (k > 0) pause = std::max(pause, l.unix_ms - t.lines[k - 1].unix_ms);
        if (mine >= 0 || l.unix_ms < fault_ms || l.action != "AVERAGE") continue;
        const int32_t g = kGroupSizes[l.level];
        bool held_lost = false;
        for (int32_t r : lost) {
          held_lost = held_lost || (r / g == l.rank / g && std::find(l.members.begin(),
                                                                     l.members.end(), r) ==
                                                               l.members.end());
        }
        if (held_lost) mine = l.unix_ms - fault_ms;
      }
      if (mine < 0) continue;
      first = first < 0 ? mine : std::min(first, mine);
      last = std::max(last, mine);
    }
    std::printf(
        "[figures] %s (heartbeat timeout %lld ms): first averaging without it after %lld ms "
        "(first survivor), %lld ms (last survivor); longest pause between two steps of a "
        "survivor %lld ms\n",
        what.c_str(), static_cast<long long>(kHeartbeatMs), static_cast<long long>(first),
        static_cast<long long>(last), static_cast<long long>(pause));
  }

  std::string Diagnostics() {
    std::string s = absl::StrCat("\ncoordinator log (tail):\n",
                                 Tail(cluster_.coordinator().process().err()));
    for (size_t i = 0; i < workers_.size(); ++i) {
      absl::StrAppend(&s, "\n", who_[i], " stderr (tail):\n", Tail(workers_[i]->err()));
    }
    return s;
  }
  static std::string Tail(const std::string& s, size_t n = 3000) {
    return s.size() <= n ? s : s.substr(s.size() - n);
  }
  // The last line of a worker's stderr: its error, when it failed.
  static std::string LastLine(const std::string& s) {
    std::vector<std::string> lines = absl::StrSplit(s, '\n', absl::SkipEmpty());
    return lines.empty() ? "(nothing on stderr)" : lines.back();
  }

  static std::vector<size_t> Except(std::set<size_t> gone, size_t n = kWorld) {
    std::vector<size_t> out;
    for (size_t i = 0; i < n; ++i) {
      if (gone.count(i) == 0) out.push_back(i);
    }
    return out;
  }

};

// Passes whatever the client's elastic support: 8 ranks, no fault. Every value follows the
// rule, every averaging lists its whole block; and the checker rejects the same traces with
// one value doctored.
TEST_F(ElasticRegrowTest, NoFault_EveryRankFinishes_TracesFollowTheRule) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("calm")).ok());
  StartWorld("calm", Steps(24, 0));
  ExpectFinished(Except({}), 24);
  ExpectTracesFollowTheRule();
  for (size_t i = 0; i < kWorld; ++i) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(LastMembersAt(i, 0).size(), 2u);
  }
  // The checker is not blind: rank 6's averaging at step 8 (all eight) with a wrong value.
  std::vector<Trace> traces;
  for (size_t i = 0; i < kWorld; ++i) traces.push_back(TraceOf(i));
  TraceLine& line = traces[6].lines[8];
  ASSERT_EQ(line.action, "AVERAGE");
  line.value += 0.01 * std::max(1.0, std::fabs(line.value));
  TraceCheckResult r = CheckTraces(traces, kGroupSizes);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.Report(), HasSubstr("rank 6 step 8: value"));
}

// kill -9 of rank 5 mid-job: the 7 survivors run every step and exit 0 (no call fails); the
// averages from then on are over the survivors, and every value follows the rule.
TEST_F(ElasticRegrowTest, OneKilled_SurvivorsFinishEveryStep) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("kill1")).ok());
  constexpr int64_t kSteps = 50;
  StartWorld("kill1", Steps(kSteps, 100));
  ASSERT_TRUE(WaitForStep(0, 10)) << Diagnostics();
  workers_[5]->Signal(SIGKILL);
  const int64_t killed_ms = NowMs();
  ASSERT_TRUE(workers_[5]->Wait(absl::Seconds(10)).has_value());
  ExpectFinished(Except({5}), kSteps);
  ExpectTracesFollowTheRule();
  EXPECT_LT(TraceOf(5).lines.back().step, kSteps - 1);
  for (size_t i : Except({5})) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 3, 4, 6, 7})) << who_[i];
  }
  EXPECT_EQ(LastMembersAt(4, 0), (std::vector<int32_t>{4}));
  EXPECT_EQ(LastMembersAt(6, 1), (std::vector<int32_t>{4, 6, 7}));
  PrintRecovery("kill -9 of rank 5", killed_ms, {5}, Except({5}));
}

// kill -9 of rank 5, then a worker started without --rank: it takes the vacant rank 5, is
// admitted at a step no member has reached, its first line is that step with the average it
// received, and from then on it averages as a member like everyone else.
TEST_F(ElasticRegrowTest, OneKilled_ReplacementTakesTheVacancyAndCatchesUp) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("regrow")).ok());
  constexpr int64_t kSteps = 80;
  StartWorld("regrow", Steps(kSteps, 100));
  ASSERT_TRUE(WaitForStep(0, 10)) << Diagnostics();
  workers_[5]->Signal(SIGKILL);
  const int64_t killed_ms = NowMs();
  ASSERT_TRUE(workers_[5]->Wait(absl::Seconds(10)).has_value());
  // The survivors have moved on: rank 4 averaged alone in its pair.
  ASSERT_TRUE(WaitForAverageWithout({4}, 5, 0)) << Diagnostics();
  const int64_t survivor_step = TraceOf(0).lines.back().step;
  const int64_t started_ms = NowMs();
  const size_t replacement = Start("regrow", Steps(kSteps, 100));
  std::vector<size_t> finishers = Except({5}, kWorld + 1);
  ExpectFinished(finishers, kSteps);
  ExpectTracesFollowTheRule();
  const Trace t = TraceOf(replacement);
  ASSERT_FALSE(t.lines.empty()) << Diagnostics();
  const TraceLine& first = t.lines.front();
  EXPECT_EQ(first.rank, 5) << "the replacement must take the lowest (only) vacant rank";
  EXPECT_TRUE(first.admitted) << first.text;
  EXPECT_EQ(first.action, "AVERAGE") << first.text;
  EXPECT_EQ(first.joining, (std::vector<int32_t>{5})) << first.text;
  EXPECT_GT(first.step, survivor_step) << "admitted at a step a member had passed";
  // From its admission on it is a member again: the last world averaging has all eight.
  for (size_t i : finishers) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7})) << who_[i];
  }
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("regrow");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->deaths(), 1) << job->DebugString();
  EXPECT_EQ(job->admissions(), 1) << job->DebugString();
  PrintRecovery("kill -9 of rank 5", killed_ms, {5}, Except({5}));
  std::printf("[figures] replacement: started at survivors' step %lld, admitted at step %lld, "
              "%lld ms from its start to its admission line\n",
              static_cast<long long>(survivor_step), static_cast<long long>(first.step),
              static_cast<long long>(first.unix_ms - started_ms));
}

// A whole pair (ranks 4 and 5: one level-0 block, two deaths in it) killed between calls
// (a 250 ms sleep before each call; the kill lands right after both printed a step): the pair
// stops averaging, the quad {4..7} averages over 6 and 7, the world over the 6 survivors.
TEST_F(ElasticRegrowTest, WholePairKilledBetweenCalls_SurvivorsFinish) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("pair")).ok());
  constexpr int64_t kSteps = 36;
  StartWorld("pair", Steps(kSteps, 250));
  ASSERT_TRUE(WaitForStep(4, 8) && WaitForStep(5, 8)) << Diagnostics();
  workers_[4]->Signal(SIGKILL);
  workers_[5]->Signal(SIGKILL);
  const int64_t killed_ms = NowMs();
  ExpectFinished(Except({4, 5}), kSteps);
  ExpectTracesFollowTheRule();
  for (size_t i : Except({4, 5})) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 3, 6, 7})) << who_[i];
  }
  EXPECT_EQ(LastMembersAt(6, 1), (std::vector<int32_t>{6, 7}));
  PrintRecovery("kill -9 of ranks 4 and 5 between calls", killed_ms, {4, 5}, Except({4, 5}));
}

// One rank (3) killed while the ranks are inside collectives (no sleep between calls, 4 MiB of
// parameters: averaging takes most of the time): the interrupted round is retried without it.
TEST_F(ElasticRegrowTest, OneKilledDuringCalls_SurvivorsFinish) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("incall")).ok());
  constexpr int64_t kSteps = 40;
  StartWorld("incall", Steps(kSteps, 0, 1 << 20));
  ASSERT_TRUE(WaitForStep(3, 9)) << Diagnostics();
  workers_[3]->Signal(SIGKILL);
  const int64_t killed_ms = NowMs();
  ExpectFinished(Except({3}), kSteps);
  ExpectTracesFollowTheRule();
  for (size_t i : Except({3})) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 4, 5, 6, 7})) << who_[i];
  }
  EXPECT_EQ(LastMembersAt(2, 0), (std::vector<int32_t>{2}));
  PrintRecovery("kill -9 of rank 3 during calls", killed_ms, {3}, Except({3}));
}

// Two ranks of one quad in different pairs (1 and 2) killed while the ranks are inside
// collectives (no sleep between calls, 4 MiB of parameters: averaging takes most of the time).
TEST_F(ElasticRegrowTest, TwoOfAQuadKilledDuringCalls_SurvivorsFinish) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("quad")).ok());
  constexpr int64_t kSteps = 40;
  StartWorld("quad", Steps(kSteps, 0, 1 << 20));
  ASSERT_TRUE(WaitForStep(1, 9)) << Diagnostics();
  workers_[1]->Signal(SIGKILL);
  workers_[2]->Signal(SIGKILL);
  const int64_t killed_ms = NowMs();
  ExpectFinished(Except({1, 2}), kSteps);
  ExpectTracesFollowTheRule();
  for (size_t i : Except({1, 2})) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 3, 4, 5, 6, 7})) << who_[i];
  }
  EXPECT_EQ(LastMembersAt(0, 1), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(LastMembersAt(0, 0), (std::vector<int32_t>{0}));
  EXPECT_EQ(LastMembersAt(3, 0), (std::vector<int32_t>{3}));
  PrintRecovery("kill -9 of ranks 1 and 2 during calls", killed_ms, {1, 2}, Except({1, 2}));
}

// Rank 6 stopped with SIGSTOP (its sockets stay open; it just goes silent): the coordinator
// declares it dead after the heartbeat timeout, the survivors' collectives with it are aborted
// and retried without it, and they finish every step. Killed at the end.
TEST_F(ElasticRegrowTest, OneStopped_SurvivorsMoveOnAndFinish) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("stop")).ok());
  constexpr int64_t kSteps = 50;
  StartWorld("stop", Steps(kSteps, 100));
  ASSERT_TRUE(WaitForStep(0, 10)) << Diagnostics();
  workers_[6]->Signal(SIGSTOP);
  const int64_t stopped_ms = NowMs();
  ExpectFinished(Except({6}), kSteps);
  ExpectTracesFollowTheRule();
  for (size_t i : Except({6})) {
    EXPECT_EQ(LastMembersAt(i, 2), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 7})) << who_[i];
  }
  EXPECT_EQ(LastMembersAt(7, 0), (std::vector<int32_t>{7}));
  PrintRecovery("SIGSTOP of rank 6", stopped_ms, {6}, Except({6}));
  workers_[6]->Signal(SIGKILL);
  EXPECT_TRUE(workers_[6]->Wait(absl::Seconds(10)).has_value());
}

// Four of eight killed with min_world_size 5: the job cannot go on, and every survivor exits
// non-zero within the deadline with an error that names the cause.
TEST_F(ElasticRegrowTest, BelowMinWorldSize_EverySurvivorFailsClearly) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  ASSERT_TRUE(cluster_.admin()->CreateJob(ElasticSpec("below")).ok());
  StartWorld("below", Steps(1000000, 50));
  ASSERT_TRUE(WaitForStep(0, 8)) << Diagnostics();
  for (size_t r : {1, 4, 6, 7}) workers_[r]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  const std::vector<size_t> survivors = Except({1, 4, 6, 7});
  std::vector<std::optional<int>> codes = WaitFor(survivors, absl::Seconds(30));
  const absl::Duration took = absl::Now() - killed;
  for (size_t k = 0; k < survivors.size(); ++k) {
    const size_t i = survivors[k];
    ASSERT_TRUE(codes[k].has_value()) << who_[i] << " still running 30 s after the job fell "
                                      << "below min_world_size" << Diagnostics();
    EXPECT_NE(*codes[k], 0) << who_[i];
    const std::string err = workers_[i]->err();
    EXPECT_THAT(err, HasSubstr("FAILED_PRECONDITION")) << who_[i] << ": " << err;
    EXPECT_THAT(err, HasSubstr("min_world_size")) << who_[i] << ": " << err;
  }
  std::printf("[figures] 4 of 8 killed (min_world_size 5): every survivor failed within %s\n",
              absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1))).c_str());
}

}  // namespace
}  // namespace modelavg::testing
