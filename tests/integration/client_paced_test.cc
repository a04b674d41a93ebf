// Paced rounds (docs/paced.md) with real processes: modelavg-trace-worker ranks of unequal speed
// (an injected delay per step) over Gloo on loopback against a coordinator started here. Every
// rank's value at every step, and every round's weights, are compared with the rule restated
// naively (paced_trace_check.h) from the decisions each member printed; the ranks of one group
// must sync at the same steps; and once the paces are measured the pacing itself is checked:
// the fast members take more inner steps and wait at a round for less than one step of the
// slowest member plus kWaitMargin.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/paced_trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

// What a fast member may wait at a round beyond one step of the slowest member, once the paces
// are measured: the round's own all-reduce and the scheduling noise of a loaded machine. A
// step-locked round would make it wait (period x the difference of their step times): 300 ms
// and more in the tests below.
constexpr double kWaitMargin = 120;
// Rounds before the pacing is checked: round 0 and round 1 are step-locked (no pace known when
// they are planned), round 2 is planned when the first member leaves round 1, with the paces
// reported by then.
constexpr int64_t kFirstPacedRound = 2;

class ClientPacedTest : public TraceJobTest {
 protected:
  ClientPacedTest() : TraceJobTest("paced") {}

  // Runs `spec` for `rounds` rounds, rank r with step delay delay_ms[r] and tokens[r] tokens per
  // step; checks every line against the rule and returns what it saw.
  PacedRounds RunAndCheck(const v1::JobSpec& spec, int64_t rounds,
                          const std::vector<double>& delay_ms, const std::vector<double>& tokens,
                          PacedCheck check,
                          const std::vector<std::vector<std::string>>& more_flags = {}) {
    std::vector<std::vector<std::string>> rank_flags(spec.world_size());
    for (int r = 0; r < spec.world_size(); ++r) {
      rank_flags[r] = {absl::StrCat("--step_delay_ms=", delay_ms[r]),
                       absl::StrCat("--tokens_per_step=", tokens[r])};
      if (r < static_cast<int>(more_flags.size())) {
        rank_flags[r].insert(rank_flags[r].end(), more_flags[r].begin(), more_flags[r].end());
      }
    }
    const std::vector<Trace> traces =
        RunJob(spec, /*steps=*/0, /*numel=*/16,
               {absl::StrCat("--rounds=", rounds), "--unix_ms"}, rank_flags);
    check.tokens = tokens;
    check.rounds = rounds;
    PacedRounds seen;
    const TraceCheckResult result = CheckPacedTraces(traces, check, delay_ms, &seen);
    EXPECT_TRUE(result.ok()) << result.Report();
    EXPECT_GE(result.averages, rounds * spec.world_size());
    return seen;
  }

  // From round kFirstPacedRound on: rank `fast` takes at least `min_ratio` times the inner steps
  // of rank `slow`, and no rank waits at a round longer than one step of the slowest rank plus
  // kWaitMargin (the median over the rounds, against scheduling noise).
  static void ExpectPaced(const PacedRounds& seen, const std::vector<double>& delay_ms,
                          int32_t fast, int32_t slow, double min_ratio) {
    const size_t rounds = seen.sync[0].size();
    ASSERT_GT(rounds, static_cast<size_t>(kFirstPacedRound + 1));
    for (size_t r = kFirstPacedRound; r < rounds; ++r) {
      const double n_fast = seen.sync[fast][r] - seen.sync[fast][r - 1];
      const double n_slow = seen.sync[slow][r] - seen.sync[slow][r - 1];
      EXPECT_GE(n_fast, min_ratio * n_slow)
          << "round " << r << ": rank " << fast << " took " << n_fast << " steps, rank " << slow
          << " " << n_slow;
    }
    const double slowest_step = *std::max_element(delay_ms.begin(), delay_ms.end());
    for (size_t i = 0; i < seen.sync.size(); ++i) {
      std::vector<double> waits;
      for (size_t r = kFirstPacedRound; r < rounds; ++r) {
        if (seen.arrive_ms[i][r] < 0 || seen.leave_ms[i][r] < 0) continue;
        waits.push_back(seen.leave_ms[i][r] - seen.arrive_ms[i][r]);
      }
      ASSERT_FALSE(waits.empty()) << "rank " << i;
      std::nth_element(waits.begin(), waits.begin() + waits.size() / 2, waits.end());
      EXPECT_LT(waits[waits.size() / 2], slowest_step + kWaitMargin)
          << "rank " << i << "'s median wait at a paced round";
    }
  }
};

// Four ranks of a PERIODIC job at 1x, 1x, 1.5x and 3x the step time, one declaring 2 tokens per
// step: each rank is a group of its own.
TEST_F(ClientPacedTest, Periodic_UnequalRanks_WeightedMeanEveryRoundEveryRank) {
  v1::JobSpec spec = MakeSpec("periodic", 4, v1::PERIODIC, {{8, 4}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  const std::vector<double> delay = {10, 10, 15, 30};
  const PacedRounds seen = RunAndCheck(spec, 7, delay, {1, 2, 1, 1}, PacedCheck{});
  ExpectPaced(seen, delay, /*fast=*/0, /*slow=*/3, /*min_ratio=*/2.0);
  // GetJob shows the pacing: every group's measured pace, the last rounds as the members got
  // them, and the time saved.
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("periodic");
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(job->has_pacing());
  const v1::PacingStatus& pacing = job->pacing();
  ASSERT_EQ(pacing.group_paces_size(), 4);
  for (double v : pacing.group_paces()) EXPECT_GT(v, 0);
  EXPECT_GT(pacing.group_paces(0), 2 * pacing.group_paces(3));
  EXPECT_GE(pacing.rounds_planned(), 7);
  ASSERT_FALSE(pacing.last_rounds().empty());
  const v1::PacedRound& r6 = *std::find_if(
      pacing.last_rounds().begin(), pacing.last_rounds().end(),
      [](const v1::PacedRound& r) { return r.round() == 6; });
  for (int32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r6.sync_steps(i), seen.sync[i][6]) << "rank " << i;
  }
  EXPECT_EQ(r6.tokens_per_step(1), 2);
  EXPECT_GT(pacing.idle_saved(), 0.2);
}

// Pairs under a paced level: the pairs are the groups; both ranks of a pair sync at the same
// steps; the pair level averages in each pair's own steps.
TEST_F(ClientPacedTest, PairsUnderPaced_GroupsSyncTogether_LowerLevelInOwnSteps) {
  v1::JobSpec spec = MakeSpec("pairs", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0);
  spec.mutable_levels(1)->set_paced(true);
  // The slower member of a pair sets its pace.
  const std::vector<double> delay = {10, 12, 30, 30};
  PacedCheck check;
  check.group_size = 2;
  const PacedRounds seen = RunAndCheck(spec, 6, delay, {1, 1, 1, 1}, check);
  ExpectPaced(seen, delay, /*fast=*/0, /*slow=*/2, /*min_ratio=*/2.0);
}

// A DiLoCo level (outer SGD with Nesterov momentum) paced: the weighted mean of the
// pseudo-gradients steps the anchor.
TEST_F(ClientPacedTest, OuterLevel_WeightedPseudoGradientsStepTheAnchor) {
  v1::JobSpec spec = MakeSpec("outer", 3, v1::PERIODIC, {{6, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  SetOuter(&spec, 0, 0.7, 0.9, true);
  PacedCheck check;
  check.outer = true;
  check.lr = 0.7;
  check.momentum = 0.9;
  check.nesterov = true;
  const std::vector<double> delay = {10, 20, 30};
  const PacedRounds seen = RunAndCheck(spec, 6, delay, {1, 1, 3}, check);
  ExpectPaced(seen, delay, /*fast=*/0, /*slow=*/2, /*min_ratio=*/2.0);
}

// A streaming outer level paced: each round syncs the next fragment (the members agree on the
// round, not on their steps, every round: a fragmented round's layout is checked each time).
TEST_F(ClientPacedTest, StreamingFragments_EachRoundTheNextFragment) {
  v1::JobSpec spec = MakeSpec("streaming", 3, v1::PERIODIC, {{8, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  spec.mutable_levels(0)->set_fragments(2);
  SetOuter(&spec, 0, 0.7, 0.0, false);
  PacedCheck check;
  check.check_values = false;
  const std::vector<double> delay = {10, 10, 30};
  std::vector<std::vector<std::string>> rank_flags(3);
  for (int r = 0; r < 3; ++r) {
    rank_flags[r] = {absl::StrCat("--step_delay_ms=", delay[r]), "--tensors=4"};
  }
  const std::vector<Trace> traces =
      RunJob(spec, 0, 16, {"--rounds=8", "--unix_ms"}, rank_flags);
  check.rounds = 8;
  PacedRounds seen;
  const TraceCheckResult result = CheckPacedTraces(traces, check, delay, &seen);
  EXPECT_TRUE(result.ok()) << result.Report();
  for (const Trace& t : traces) {
    for (const TraceLine& l : t.lines) {
      if (l.round >= 0) EXPECT_EQ(l.fragment, l.round % 2) << l.text;
    }
  }
  ExpectPaced(seen, delay, /*fast=*/0, /*slow=*/2, /*min_ratio=*/2.0);
}

// A member whose pace changes mid-run (4x slower from its round 2 on) is re-paced within
// kRepaceRounds rounds (docs/paced.md): its pace is over its previous round and the current
// one, so round 3 (planned as round 2 ends) still has its old pace, round 4 a mixed one, and
// from round 5 on the others take about 4x its inner steps; before the change they took about
// as many.
TEST_F(ClientPacedTest, PaceChangesMidRun_RepacedWithinThreeRounds) {
  constexpr int64_t kChange = 2;
  constexpr int64_t kRepaceRounds = 3;
  v1::JobSpec spec = MakeSpec("repace", 3, v1::PERIODIC, {{5, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  const std::vector<double> delay = {20, 20, 20};
  const PacedRounds seen =
      RunAndCheck(spec, kChange + kRepaceRounds + 3, delay, {1, 1, 1}, PacedCheck{},
                  {{}, {}, {absl::StrCat("--testing_step_delay_after_round=", kChange, ":80")}});
  ASSERT_EQ(seen.sync[0].size(), static_cast<size_t>(kChange + kRepaceRounds + 3));
  auto steps = [&](int32_t rank, size_t r) {
    return seen.sync[rank][r] - seen.sync[rank][r - 1];
  };
  for (size_t r = 1; r < seen.sync[0].size(); ++r) {
    std::printf("round %zu: inner steps %s\n", r,
                absl::StrCat(steps(0, r), " ", steps(1, r), " ", steps(2, r)).c_str());
  }
  for (size_t r = 1; r <= static_cast<size_t>(kChange); ++r) {
    EXPECT_LE(steps(0, r), 1.5 * steps(2, r))
        << "round " << r << ", before the change: rank 0 took " << steps(0, r)
        << " steps, rank 2 " << steps(2, r);
  }
  for (size_t r = kChange + kRepaceRounds; r < seen.sync[0].size(); ++r) {
    EXPECT_GE(steps(0, r), 2.5 * steps(2, r))
        << "round " << r << ", re-paced: rank 0 took " << steps(0, r) << " steps, rank 2 "
        << steps(2, r);
    EXPECT_GE(steps(1, r), 2.5 * steps(2, r)) << "round " << r;
  }
}

// Level.rounds: the job's budget ends every member after the same round, whatever its steps.
TEST_F(ClientPacedTest, Budget_EveryMemberEndsAfterTheSameRound) {
  v1::JobSpec spec = MakeSpec("budget", 3, v1::PERIODIC, {{5, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  spec.mutable_levels(0)->set_rounds(4);
  RunAndCheck(spec, 4, {5, 10, 20}, {1, 1, 1}, PacedCheck{});
}

}  // namespace
}  // namespace modelavg::testing
