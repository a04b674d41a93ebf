// The plan of a paced level (server/pacing/pacing.h) against the naive restatement of
// tests/reference/paced_reference.h, and the properties the rule promises (docs/paced.md).
#include "server/pacing/pacing.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"
#include "tests/reference/paced_reference.h"

namespace modelavg::server {
namespace {

using ::modelavg::testing::NaivePacedFirst;
using ::modelavg::testing::NaivePacedGroups;
using ::modelavg::testing::NaivePacedLevel;
using ::modelavg::testing::NaivePacedNext;
using ::modelavg::testing::NaivePacedRound;
using ::modelavg::testing::NaiveGroupPaces;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A job whose last level is paced: `lower` are the lower levels' (period, group_size).
ScheduleSpec PacedSpec(int32_t world, std::vector<std::pair<int64_t, int32_t>> lower,
                       int64_t period, int32_t fragments = 1, int64_t warmup = 0,
                       int32_t replica_size = 1) {
  ScheduleSpec spec;
  spec.world_size = world;
  spec.warmup_steps = warmup;
  spec.mode = lower.empty() ? AveragingMode::kPeriodic : AveragingMode::kHierarchical;
  spec.replica_size = replica_size;
  for (const auto& [p, g] : lower) spec.levels.push_back(ScheduleLevel{p, g});
  ScheduleLevel top{period, world};
  top.paced = true;
  if (fragments > 1) {
    // A fragmented level needs an outer optimizer only for delay, mix and payloads.
    top.fragments = fragments;
  }
  spec.levels.push_back(top);
  return spec;
}

NaivePacedLevel NaiveOf(const ScheduleSpec& spec) {
  NaivePacedLevel l;
  l.world_size = spec.world_size;
  l.replica_size = spec.replica_size;
  for (size_t i = 0; i + 1 < spec.levels.size(); ++i) {
    l.lower_group_sizes.push_back(spec.levels[i].group_size);
  }
  l.period = spec.levels.back().period;
  l.fragments = spec.levels.back().fragments;
  l.warmup_steps = spec.warmup_steps;
  l.periodic = spec.mode == AveragingMode::kPeriodic;
  return l;
}

Pacing MakePacing(const ScheduleSpec& spec) {
  absl::StatusOr<Schedule> schedule = Schedule::Create(spec);
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  absl::StatusOr<Pacing> pacing = Pacing::Create(*schedule);
  EXPECT_TRUE(pacing.ok()) << pacing.status();
  return *pacing;
}

void ExpectSame(const PacedRound& got, const NaivePacedRound& want) {
  EXPECT_EQ(got.round, want.round);
  EXPECT_EQ(got.fragment, want.fragment) << "round " << want.round;
  EXPECT_EQ(got.sync_step, want.sync_step) << "round " << want.round;
  EXPECT_EQ(got.inner_steps, want.inner_steps) << "round " << want.round;
}

// Runs `rounds` rounds with the paces `pace_at(r)` (per rank) for round r, against the reference.
template <typename PaceAt>
std::vector<PacedRound> RunAgainstReference(const ScheduleSpec& spec, int rounds, PaceAt pace_at) {
  const Pacing pacing = MakePacing(spec);
  const NaivePacedLevel naive = NaiveOf(spec);
  std::vector<PacedRound> plan{pacing.First()};
  NaivePacedRound want = NaivePacedFirst(naive, pacing.num_groups());
  ExpectSame(plan.back(), want);
  for (int r = 1; r < rounds; ++r) {
    const std::vector<double> rank_pace = pace_at(r);
    const std::vector<double> group_pace = pacing.GroupPaces(rank_pace);
    EXPECT_EQ(group_pace, NaiveGroupPaces(naive, rank_pace)) << "round " << r;
    absl::StatusOr<PacedRound> next = pacing.Next(plan.back(), group_pace);
    EXPECT_TRUE(next.ok()) << next.status();
    if (!next.ok()) break;
    want = NaivePacedNext(naive, want, NaiveGroupPaces(naive, rank_pace));
    ExpectSame(*next, want);
    plan.push_back(*next);
  }
  return plan;
}

// The groups are the blocks the lower levels and the replicas lock together, as the reference
// finds them by linking ranks one pair at a time.
TEST(PacingTest, Groups_AreTheBlocksLowerLevelsAndReplicasLockTogether) {
  struct Case {
    ScheduleSpec spec;
    int32_t size;
  };
  const std::vector<Case> cases = {
      {PacedSpec(4, {}, 8), 1},                        // PERIODIC: each rank alone
      {PacedSpec(8, {}, 8, 1, 0, 2), 2},               // replicas of two ranks
      {PacedSpec(8, {{2, 2}}, 8), 2},                  // pairs
      {PacedSpec(12, {{2, 4}, {3, 6}}, 12), 12},       // 4 and 6 chain into 12: one group
      {PacedSpec(24, {{2, 4}, {3, 6}}, 12), 12},       // lcm(4, 6) = 12
      {PacedSpec(16, {{2, 4}}, 8, 1, 0, 2), 4},        // replicas of 2 inside groups of 4
      {PacedSpec(12, {{2, 2}}, 12, 1, 0, 3), 6},       // lcm(2, 3) = 6
  };
  for (const Case& c : cases) {
    EXPECT_EQ(PacedGroupSize(c.spec, c.spec.levels.size() - 1), c.size);
    const std::vector<int32_t> naive = NaivePacedGroups(NaiveOf(c.spec));
    for (int32_t r = 0; r < c.spec.world_size; ++r) {
      EXPECT_EQ(r / c.size, naive[r]) << "world " << c.spec.world_size << " rank " << r;
    }
  }
}

// Four members at paces 1x, 1x, 1.5x and 3x (PERIODIC, period 10): the slowest take 10 steps a
// round, the 1.5x member 15 and the 3x member 30; every expected arrival is 10 / v = 10 s.
TEST(PacingTest, UnequalPaces_FastMembersTakeMoreSteps_ArrivalsAgree) {
  const ScheduleSpec spec = PacedSpec(4, {}, 10);
  const std::vector<double> pace = {2.0, 2.0, 3.0, 6.0};
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 5, [&](int) { return pace; });
  ASSERT_EQ(plan.size(), 5u);
  EXPECT_THAT(plan[0].sync_step, ElementsAre(0, 0, 0, 0));  // step-locked round 0
  EXPECT_THAT(plan[1].inner_steps, ElementsAre(10, 10, 15, 30));
  EXPECT_THAT(plan[1].sync_step, ElementsAre(10, 10, 15, 30));
  EXPECT_THAT(plan[4].sync_step, ElementsAre(40, 40, 60, 120));
  for (int g = 0; g < 4; ++g) {
    EXPECT_DOUBLE_EQ(plan[2].inner_steps[g] / pace[g], 10 / 2.0) << g;
  }
}

// docs/paced.md's worked example: three members at 2, 2.95 and 4.5 steps per second, period 20;
// round 1 planned before any pace is known.
TEST(PacingTest, WorkedExampleOfTheDocs) {
  const ScheduleSpec spec = PacedSpec(3, {}, 20);
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 4, [&](int r) {
    if (r == 1) return std::vector<double>{-1, -1, -1};
    return std::vector<double>{2.0, 2.95, 4.5};
  });
  EXPECT_THAT(plan[0].sync_step, ElementsAre(0, 0, 0));
  EXPECT_THAT(plan[1].sync_step, ElementsAre(20, 20, 20));
  EXPECT_THAT(plan[2].sync_step, ElementsAre(40, 49, 65));
  EXPECT_THAT(plan[2].inner_steps, ElementsAre(20, 29, 45));
  EXPECT_THAT(plan[3].sync_step, ElementsAre(60, 78, 110));
}

// A pace that is not a whole multiple rounds down: the fast group arrives at most one of its own
// steps before the slowest and never after it.
TEST(PacingTest, RoundsDown_ArrivesAtMostOneOwnStepEarly) {
  const ScheduleSpec spec = PacedSpec(3, {}, 7);
  const std::vector<double> pace = {1.0, 1.37, 2.99};
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 3, [&](int) { return pace; });
  EXPECT_THAT(plan[1].inner_steps, ElementsAre(7, 9, 20));  // 9.59 -> 9, 20.93 -> 20
  const double round_time = 7 / pace[0];
  for (int g = 0; g < 3; ++g) {
    const double arrival = plan[1].inner_steps[g] / pace[g];
    EXPECT_LE(arrival, round_time + 1e-9) << g;
    EXPECT_GT(arrival + 1 / pace[g], round_time) << g;
  }
}

// A whole-number ratio computed in floating point below the number still gives it.
TEST(PacingTest, WholeRatioInFloatingPoint_NotRoundedBelow) {
  const Pacing pacing = MakePacing(PacedSpec(2, {}, 10));
  // 0.3 / 0.1 is 2.9999999999999996 in double.
  EXPECT_EQ(pacing.InnerSteps(0.3, 0.1), 30);
  EXPECT_EQ(pacing.InnerSteps(0.1, 0.1), 10);
}

// The members of a group (a lower level's pair) always get the same steps; the group goes at
// its slowest member's pace.
TEST(PacingTest, LockedMembers_SameSteps_SlowestMemberSetsTheGroupsPace) {
  const ScheduleSpec spec = PacedSpec(8, {{4, 2}}, 16);
  const std::vector<double> pace = {3, 1, 4, 4, 2, 6, 8, 8};  // groups: 1, 4, 2, 8
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 4, [&](int) { return pace; });
  const Pacing pacing = MakePacing(spec);
  EXPECT_THAT(pacing.GroupPaces(pace), ElementsAre(1, 4, 2, 8));
  // Ranks missing from the vector are unknown; entries past the world are ignored.
  EXPECT_THAT(pacing.GroupPaces({3, 1, 4}), ElementsAre(1, 4, -1, -1));
  EXPECT_THAT(pacing.GroupPaces({1, 1, 1, 1, 1, 1, 1, 1, 0.001}), ElementsAre(1, 1, 1, 1));
  EXPECT_THAT(plan[1].inner_steps, ElementsAre(16, 64, 32, 128));
  for (int32_t r = 0; r < 8; r += 2) EXPECT_EQ(pacing.GroupOf(r), pacing.GroupOf(r + 1));
}

// A group whose pace is not known yet takes the period, as the slowest; with no pace known the
// level is step-locked.
TEST(PacingTest, UnknownPaces_TakeThePeriod) {
  const ScheduleSpec spec = PacedSpec(4, {}, 10);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 4, [&](int r) {
    if (r == 1) return std::vector<double>{-1, 0, nan, inf};
    return std::vector<double>{2.0, -1, 5.0, nan};
  });
  EXPECT_THAT(plan[1].inner_steps, ElementsAre(10, 10, 10, 10));
  EXPECT_THAT(plan[2].inner_steps, ElementsAre(10, 10, 25, 10));
}

// A member that slows down (3x, then 1x from round 3 on, the others 1x and 1.5x): re-paced at
// the first round planned with its new pace, and a member that becomes the slowest sets the
// period for the others.
TEST(PacingTest, PaceChange_TakesEffectAtTheNextPlannedRound) {
  const ScheduleSpec spec = PacedSpec(4, {}, 10);
  const std::vector<PacedRound> plan = RunAgainstReference(spec, 7, [&](int r) {
    if (r < 3) return std::vector<double>{1.0, 1.0, 1.5, 3.0};
    if (r < 5) return std::vector<double>{1.0, 1.0, 1.5, 1.0};
    return std::vector<double>{1.0, 1.0, 1.5, 0.5};
  });
  EXPECT_THAT(plan[2].inner_steps, ElementsAre(10, 10, 15, 30));
  EXPECT_THAT(plan[3].inner_steps, ElementsAre(10, 10, 15, 10));
  EXPECT_THAT(plan[5].inner_steps, ElementsAre(20, 20, 30, 10));
  // Sync steps only move forward, each group's by its own inner steps.
  for (size_t r = 1; r < plan.size(); ++r) {
    for (int g = 0; g < 4; ++g) {
      EXPECT_EQ(plan[r].sync_step[g], plan[r - 1].sync_step[g] + plan[r].inner_steps[g]);
    }
  }
}

// A group far faster than the slowest (or the slowest nearly stalled) takes at most
// kMaxPaceRatio periods.
TEST(PacingTest, RatioCapped) {
  const ScheduleSpec spec = PacedSpec(2, {}, 5);
  const std::vector<PacedRound> plan =
      RunAgainstReference(spec, 3, [&](int) { return std::vector<double>{1e-9, 1.0}; });
  EXPECT_THAT(plan[1].inner_steps, ElementsAre(5, kMaxPaceRatio * 5));
}

// Warm-up and fragments: round 0 is the schedule's first step of the level; each round syncs
// the next fragment.
TEST(PacingTest, WarmupAndFragments_RoundZeroIsTheSchedulesFirstStep) {
  {
    // HIERARCHICAL: step period 12 / 3 = 4, warm-up 10: the first multiple of 4 is 12,
    // fragment (12 / 4) mod 3 = 0.
    const ScheduleSpec spec = PacedSpec(4, {{3, 2}}, 12, 3, 10);
    const std::vector<PacedRound> plan =
        RunAgainstReference(spec, 5, [&](int) { return std::vector<double>{1, 1, 2, 2}; });
    EXPECT_THAT(plan[0].sync_step, ElementsAre(12, 12));
    EXPECT_EQ(plan[0].fragment, 0);
    EXPECT_THAT(plan[1].sync_step, ElementsAre(16, 20));
    EXPECT_EQ(plan[1].fragment, 1);
    EXPECT_EQ(plan[3].fragment, 0);
  }
  {
    // PERIODIC: round 0 at warm-up itself.
    const ScheduleSpec spec = PacedSpec(2, {}, 6, 2, 7);
    const std::vector<PacedRound> plan =
        RunAgainstReference(spec, 3, [&](int) { return std::vector<double>{1, 2}; });
    EXPECT_THAT(plan[0].sync_step, ElementsAre(7, 7));
    EXPECT_THAT(plan[1].sync_step, ElementsAre(10, 13));
  }
}

// Many rounds of varying paces, sharded replicas and a lower level: the class and the reference
// agree on every round.
TEST(PacingTest, ManyRounds_AgreeWithReference) {
  const ScheduleSpec spec = PacedSpec(16, {{2, 4}}, 8, 2, 3, 2);
  RunAgainstReference(spec, 60, [&](int r) {
    std::vector<double> pace(16);
    for (int32_t k = 0; k < 16; ++k) {
      pace[k] = 0.5 + std::fmod(0.37 * (k + 1) * (r + 3), 2.5);
      if ((k + r) % 7 == 0) pace[k] = -1;  // now and then unknown
    }
    return pace;
  });
}

TEST(PacingTest, Create_NeedsAPacedLastLevel) {
  ScheduleSpec spec = PacedSpec(4, {}, 8);
  spec.levels.back().paced = false;
  absl::StatusOr<Schedule> schedule = Schedule::Create(spec);
  ASSERT_TRUE(schedule.ok());
  EXPECT_EQ(Pacing::Create(*schedule).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PacingTest, Next_WrongSizes_InvalidArgument_Overflow_OutOfRange) {
  const Pacing pacing = MakePacing(PacedSpec(2, {}, 8));
  PacedRound first = pacing.First();
  EXPECT_EQ(pacing.Next(first, {1.0}).status().code(), absl::StatusCode::kInvalidArgument);
  first.sync_step = {kMaxPacedStep - 3, 0};
  absl::StatusOr<PacedRound> next = pacing.Next(first, {1.0, 1.0});
  EXPECT_EQ(next.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("group 0"));
}

}  // namespace
}  // namespace modelavg::server
