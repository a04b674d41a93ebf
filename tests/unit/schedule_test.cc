// The schedule must reproduce PyTorch's PeriodicModelAverager and HierarchicalModelAverager step
// for step. Scenarios come from PyTorch's own tests; the reference loops below transcribe the
// averagers' `average_parameters` bodies (decide, then increment the step counter).
#include "modelavg/common/schedule.h"

#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

ScheduleSpec Periodic(int32_t world, int64_t period, int64_t warmup) {
  return ScheduleSpec{world, warmup, AveragingMode::kPeriodic, {{period, world}}};
}

ScheduleSpec Hierarchical(int32_t world, std::vector<ScheduleLevel> levels, int64_t warmup) {
  return ScheduleSpec{world, warmup, AveragingMode::kHierarchical, std::move(levels)};
}

Schedule Make(const ScheduleSpec& spec) {
  absl::StatusOr<Schedule> s = Schedule::Create(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

// Steps in [0, n) at which `rank` averages.
std::vector<int64_t> AveragingSteps(const Schedule& s, int64_t n, int32_t rank = 0) {
  std::vector<int64_t> out;
  for (const Decision& d : s.Window(0, n, rank)) {
    if (d.average) out.push_back(d.step);
  }
  return out;
}

// PyTorch's PeriodicModelAverager.average_parameters, as a loop over calls.
std::vector<int64_t> TorchPeriodic(int64_t period, int64_t warmup, int64_t calls) {
  std::vector<int64_t> out;
  int64_t step = 0;
  for (int64_t c = 0; c < calls; ++c) {
    if (step >= warmup && (step - warmup) % period == 0) out.push_back(step);
    step += 1;
  }
  return out;
}

// PyTorch's HierarchicalModelAverager: which period's group averages at each call (0: none).
std::vector<int64_t> TorchHierarchical(const std::vector<int64_t>& periods, int64_t warmup,
                                       int64_t calls) {
  std::vector<int64_t> out;
  int64_t step = 0;
  for (int64_t c = 0; c < calls; ++c) {
    int64_t chosen = 0;
    if (step >= warmup) {
      for (auto it = periods.rbegin(); it != periods.rend(); ++it) {
        if (step % *it == 0) {
          chosen = *it;
          break;
        }
      }
    }
    out.push_back(chosen);
    step += 1;
  }
  return out;
}

// --- PyTorch's own scenarios -------------------------------------------------------------

TEST(PeriodicScheduleTest, PeriodFourWarmupTwelveToFifteen_MatchesPyTorchTest) {
  EXPECT_THAT(AveragingSteps(Make(Periodic(4, 4, 12)), 20), ElementsAre(12, 16));
  EXPECT_THAT(AveragingSteps(Make(Periodic(4, 4, 13)), 20), ElementsAre(13, 17));
  EXPECT_THAT(AveragingSteps(Make(Periodic(4, 4, 14)), 20), ElementsAre(14, 18));
  EXPECT_THAT(AveragingSteps(Make(Periodic(4, 4, 15)), 20), ElementsAre(15, 19));
}

TEST(PeriodicScheduleTest, NoWarmup_AveragesAtStepZero) {
  EXPECT_THAT(AveragingSteps(Make(Periodic(2, 3, 0)), 10), ElementsAre(0, 3, 6, 9));
}

TEST(PeriodicScheduleTest, EveryAveragingStep_UsesWholeWorld) {
  const Schedule s = Make(Periodic(8, 2, 1));
  for (int32_t rank = 0; rank < 8; ++rank) {
    const Decision d = s.DecisionFor(5, rank);
    ASSERT_TRUE(d.average);
    EXPECT_EQ(d.level, 0);
    EXPECT_EQ(d.period, 2);
    EXPECT_EQ(d.subgroup.index, 0);
    EXPECT_THAT(d.subgroup.Ranks(), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  }
}

TEST(HierarchicalScheduleTest, ThreeLevelsWarmupTen_MatchesPyTorchTest) {
  const Schedule s = Make(Hierarchical(4, {{2, 2}, {4, 4}, {8, 4}}, 10));
  std::vector<int64_t> pairs, world;
  for (const Decision& d : s.Window(0, 26, /*rank=*/1)) {
    if (!d.average) continue;
    if (d.subgroup.size == 2) {
      pairs.push_back(d.step);
    } else {
      world.push_back(d.step);
    }
  }
  EXPECT_THAT(pairs, ElementsAre(10, 14, 18, 22));
  EXPECT_THAT(world, ElementsAre(12, 16, 20, 24));
  // The last level whose period divides the step wins: 16 is level 2 (period 8), not level 1.
  EXPECT_EQ(s.LevelAt(16), 2);
  EXPECT_EQ(s.LevelAt(12), 1);
  EXPECT_EQ(s.LevelAt(10), 0);
  EXPECT_EQ(s.LevelAt(11), -1);
  EXPECT_EQ(s.LevelAt(8), -1);  // masked by warm-up
}

TEST(HierarchicalScheduleTest, PairsAreConsecutiveBlocks) {
  const Schedule s = Make(Hierarchical(4, {{2, 2}, {4, 4}, {8, 4}}, 10));
  EXPECT_THAT(s.DecisionFor(10, 0).subgroup.Ranks(), ElementsAre(0, 1));
  EXPECT_THAT(s.DecisionFor(10, 1).subgroup.Ranks(), ElementsAre(0, 1));
  EXPECT_THAT(s.DecisionFor(10, 2).subgroup.Ranks(), ElementsAre(2, 3));
  EXPECT_THAT(s.DecisionFor(10, 3).subgroup.Ranks(), ElementsAre(2, 3));
  EXPECT_EQ(s.DecisionFor(10, 3).subgroup.index, 1);
}

// --- The warm-up phase difference --------------------------------------------------------

TEST(ScheduleTest, OneHierarchicalLevelVersusPeriodicUnderWarmup_PhasesDiffer) {
  // Periodic: phase relative to warm-up. Hierarchical: absolute phase, warm-up only masks.
  EXPECT_THAT(AveragingSteps(Make(Periodic(4, 4, 13)), 25), ElementsAre(13, 17, 21));
  EXPECT_THAT(AveragingSteps(Make(Hierarchical(4, {{4, 4}}, 13)), 25), ElementsAre(16, 20, 24));
}

TEST(ScheduleTest, WarmupOnPeriodBoundary_PhasesAgree) {
  EXPECT_EQ(AveragingSteps(Make(Periodic(2, 4, 8)), 50),
            AveragingSteps(Make(Hierarchical(2, {{4, 2}}, 8)), 50));
}

// --- Orders, warnings --------------------------------------------------------------------

TEST(HierarchicalScheduleTest, LevelsNotAscending_LaterLevelWins) {
  // {8: 2, 4: 4}: at step 8 both divide; the later level (period 4, the world) wins, exactly as
  // PyTorch's reversed() walk over the dict would.
  const ScheduleSpec spec = Hierarchical(4, {{8, 2}, {4, 4}}, 0);
  const Schedule s = Make(spec);
  EXPECT_EQ(s.LevelAt(8), 1);
  EXPECT_EQ(s.LevelAt(4), 1);
  EXPECT_EQ(s.LevelAt(2), -1);
  // Level 0 can never win: every multiple of 8 is a multiple of 4.
  for (int64_t step = 0; step < 100; ++step) EXPECT_NE(s.LevelAt(step), 0) << step;
  std::vector<std::string> warnings = ScheduleWarnings(spec);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("not ascending"));
}

TEST(ScheduleTest, LargestPeriodOne_IsValidWithWarning) {
  const ScheduleSpec spec = Periodic(2, 1, 0);
  EXPECT_THAT(AveragingSteps(Make(spec), 5), ElementsAre(0, 1, 2, 3, 4));
  std::vector<std::string> warnings = ScheduleWarnings(spec);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("period is 1"));
  EXPECT_TRUE(ScheduleWarnings(Hierarchical(4, {{2, 2}, {4, 4}}, 0)).empty());
}

TEST(ScheduleTest, WorldOfOne_AveragesAlone) {
  const Schedule s = Make(Periodic(1, 2, 0));
  EXPECT_THAT(s.DecisionFor(2, 0).subgroup.Ranks(), ElementsAre(0));
}

// --- Invalid specs -----------------------------------------------------------------------

struct InvalidCase {
  const char* name;
  ScheduleSpec spec;
  const char* message;
};

// `n` levels of a world of 1 (periods 1..n).
ScheduleSpec ManyLevels(size_t n) {
  ScheduleSpec spec{1, 0, AveragingMode::kHierarchical, {}};
  for (size_t i = 0; i < n; ++i) spec.levels.push_back({static_cast<int64_t>(i + 1), 1});
  return spec;
}

class InvalidSpecTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidSpecTest, Create_ReturnsInvalidArgumentNamingField) {
  absl::StatusOr<Schedule> s = Schedule::Create(GetParam().spec);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    AllRules, InvalidSpecTest,
    ::testing::Values(
        InvalidCase{"ZeroWorld", Hierarchical(0, {{2, 1}}, 0), "world_size must be in [1"},
        InvalidCase{"NegativeWorld", Hierarchical(-3, {{2, 1}}, 0), "got -3"},
        InvalidCase{"HugeWorld", Periodic(kMaxWorldSize + 1, 2, 0), "world_size"},
        InvalidCase{"NegativeWarmup", Periodic(4, 2, -1), "warmup_steps must be in [0, 1000000000000], got -1"},
        InvalidCase{"HugeWarmup", Periodic(4, 2, kMaxWarmupSteps + 1),
                    "warmup_steps must be in [0, 1000000000000], got 1000000000001"},
        InvalidCase{"NoLevels", Hierarchical(4, {}, 0), "levels must not be empty"},
        InvalidCase{"ZeroPeriod", Hierarchical(4, {{0, 2}, {4, 4}}, 0),
                    "levels[0].period must be in [1, 1000000000000], got 0"},
        InvalidCase{"NegativePeriod", Hierarchical(4, {{2, 2}, {-4, 4}}, 0),
                    "levels[1].period must be in [1, 1000000000000], got -4"},
        InvalidCase{"HugePeriod", Hierarchical(4, {{2, 2}, {kMaxPeriod + 1, 4}}, 0),
                    "levels[1].period must be in [1, 1000000000000], got 1000000000001"},
        InvalidCase{"TooManyLevels", ManyLevels(kMaxLevels + 1), "at most 16 levels, got 17"},
        InvalidCase{"ZeroGroup", Hierarchical(4, {{2, 0}, {4, 4}}, 0),
                    "levels[0].group_size must be >= 1, got 0"},
        InvalidCase{"NegativeGroup", Hierarchical(4, {{2, -2}, {4, 4}}, 0),
                    "levels[0].group_size must be >= 1, got -2"},
        InvalidCase{"GroupTooBig", Hierarchical(4, {{2, 8}, {4, 4}}, 0),
                    "levels[0].group_size 8 exceeds world_size 4"},
        InvalidCase{"GroupNotDividing", Hierarchical(6, {{2, 4}, {4, 6}}, 0),
                    "levels[0].group_size 4 does not divide world_size 6"},
        InvalidCase{"LastNotWorld", Hierarchical(4, {{2, 4}, {4, 2}}, 0),
                    "last level's group_size must equal world_size 4, got 2"},
        InvalidCase{"PeriodicGroupNotWorld",
                    ScheduleSpec{4, 0, AveragingMode::kPeriodic, {{4, 2}}},
                    "last level's group_size must equal world_size"},
        InvalidCase{"PeriodicTwoLevels",
                    ScheduleSpec{4, 0, AveragingMode::kPeriodic, {{2, 2}, {4, 4}}},
                    "mode PERIODIC takes exactly one level"},
        InvalidCase{"DuplicatePeriod", Hierarchical(4, {{4, 2}, {4, 4}}, 0),
                    "levels[1].period 4 appears twice"}),
    [](const ::testing::TestParamInfo<InvalidCase>& info) { return info.param.name; });

TEST(ScheduleTest, Bounds_LargestAllowedSpecIsValid) {
  EXPECT_TRUE(Schedule::Create(ManyLevels(kMaxLevels)).ok());
  EXPECT_TRUE(Schedule::Create(Periodic(4, kMaxPeriod, kMaxWarmupSteps)).ok());
}

// --- Properties over random valid specs --------------------------------------------------

ScheduleSpec RandomSpec(std::mt19937_64& rng) {
  static const int32_t kWorlds[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
  const int32_t world = kWorlds[rng() % std::size(kWorlds)];
  std::vector<int32_t> divisors;
  for (int32_t g = 1; g <= world; ++g) {
    if (world % g == 0) divisors.push_back(g);
  }
  ScheduleSpec spec;
  spec.world_size = world;
  spec.warmup_steps = static_cast<int64_t>(rng() % 20);
  const bool periodic = rng() % 3 == 0;
  spec.mode = periodic ? AveragingMode::kPeriodic : AveragingMode::kHierarchical;
  const int n = periodic ? 1 : 1 + static_cast<int>(rng() % 4);
  std::set<int64_t> used;
  for (int i = 0; i < n; ++i) {
    int64_t period;
    do {
      period = 1 + static_cast<int64_t>(rng() % 12);
    } while (!used.insert(period).second);
    const int32_t group = i == n - 1 ? world : divisors[rng() % divisors.size()];
    spec.levels.push_back({period, group});
  }
  return spec;
}

TEST(SchedulePropertyTest, RandomSpecs_SubgroupsPartitionWorldAndMembersAgree) {
  std::mt19937_64 rng(20261129);
  for (int trial = 0; trial < 300; ++trial) {
    const ScheduleSpec spec = RandomSpec(rng);
    ASSERT_TRUE(ValidateScheduleSpec(spec).ok()) << ValidateScheduleSpec(spec);
    const Schedule s = Make(spec);
    const int64_t from = static_cast<int64_t>(rng() % 50);
    for (int64_t step = from; step < from + 40; ++step) {
      std::vector<int> seen(spec.world_size, 0);
      for (int32_t rank = 0; rank < spec.world_size; ++rank) {
        const Decision d = s.DecisionFor(step, rank);
        ASSERT_EQ(d.step, step);
        ASSERT_EQ(d.average, s.LevelAt(step) >= 0);
        if (!d.average) continue;
        ASSERT_TRUE(d.subgroup.Contains(rank));
        // Every member of my subgroup sees exactly the same decision.
        for (int32_t member : d.subgroup.Ranks()) {
          ASSERT_EQ(s.DecisionFor(step, member), d) << "trial " << trial << " step " << step;
        }
        if (d.subgroup.first_rank == rank) {
          for (int32_t member : d.subgroup.Ranks()) seen[member] += 1;
        }
      }
      if (s.LevelAt(step) >= 0) {
        // The subgroups of the chosen level partition the world: each rank in exactly one.
        for (int32_t rank = 0; rank < spec.world_size; ++rank) ASSERT_EQ(seen[rank], 1);
      }
    }
  }
}

TEST(SchedulePropertyTest, RandomSpecs_MatchPyTorchReferenceLoops) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const ScheduleSpec spec = RandomSpec(rng);
    const Schedule s = Make(spec);
    const int64_t calls = 120;
    if (spec.mode == AveragingMode::kPeriodic) {
      EXPECT_EQ(AveragingSteps(s, calls),
                TorchPeriodic(spec.levels[0].period, spec.warmup_steps, calls));
      continue;
    }
    std::vector<int64_t> periods;
    for (const ScheduleLevel& l : spec.levels) periods.push_back(l.period);
    const std::vector<int64_t> torch = TorchHierarchical(periods, spec.warmup_steps, calls);
    for (int64_t step = 0; step < calls; ++step) {
      const Decision d = s.DecisionFor(step, 0);
      EXPECT_EQ(d.average ? d.period : 0, torch[step]) << "trial " << trial << " step " << step;
    }
  }
}

TEST(ScheduleWindowTest, WindowAllSubgroups_OneEntryPerSubgroupOfAveragingSteps) {
  const Schedule s = Make(Hierarchical(8, {{2, 2}, {4, 8}}, 0));
  const std::vector<Decision> w = s.WindowAllSubgroups(1, 3);  // steps 1, 2, 3
  ASSERT_EQ(w.size(), 1u + 4u + 1u);
  EXPECT_FALSE(w[0].average);
  for (int i = 1; i <= 4; ++i) {
    EXPECT_EQ(w[i].step, 2);
    EXPECT_EQ(w[i].subgroup.index, i - 1);
    EXPECT_EQ(w[i].subgroup.first_rank, 2 * (i - 1));
  }
  EXPECT_FALSE(w[5].average);
}

TEST(ScheduleWindowTest, Window_EqualsPointDecisions) {
  const Schedule s = Make(Hierarchical(4, {{3, 2}, {5, 4}}, 7));
  const std::vector<Decision> w = s.Window(100, 50, 3);
  ASSERT_EQ(w.size(), 50u);
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(w[i], s.DecisionFor(100 + i, 3));
}

// Steps near 2^62 and INT64_MAX: every decision equals the rule computed directly (no
// overflow, no wrap), and both outcomes occur, so a schedule that never averages there fails.
TEST(ScheduleWindowTest, HugeSteps_DecisionsMatchDirectComputation_NoOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // Periodic, warm-up 5, period 1000: averages at 5 + 1000k, the whole world.
  const Schedule p = Make(Periodic(2, 1000, 5));
  for (const int64_t base : {int64_t{1} << 62, kMax - 2500}) {
    const int64_t avg = base + (1000 - (base - 5) % 1000) % 1000;  // first averaging step >= base
    ASSERT_EQ((avg - 5) % 1000, 0);
    for (const int64_t step : {avg - 1, avg, avg + 1, avg + 999, avg + 1000}) {
      const Decision d = p.DecisionFor(step, 1);
      EXPECT_EQ(d.step, step);
      EXPECT_EQ(d.average, (step - 5) % 1000 == 0) << "step " << step;
      if (d.average) {
        EXPECT_EQ(d.level, 0);
        EXPECT_EQ(d.period, 1000);
        EXPECT_EQ(d.subgroup.first_rank, 0);
        EXPECT_EQ(d.subgroup.size, 2);
      }
    }
    EXPECT_TRUE(p.DecisionFor(avg, 0).average) << "step " << avg;
    EXPECT_FALSE(p.DecisionFor(avg + 1, 0).average) << "step " << avg + 1;
  }
  // Hierarchical (3, 2), (7, 4), no warm-up: at multiples of 7 all four ranks, else at
  // multiples of 3 the pairs. INT64_MAX = 2^63 - 1 is a multiple of 7 (2^3 = 1 mod 7).
  const Schedule h = Make(Hierarchical(4, {{3, 2}, {7, 4}}, 0));
  int all = 0, pairs = 0, skips = 0;
  for (int64_t step = kMax - 60;; ++step) {
    for (int32_t rank = 0; rank < 4; ++rank) {
      const Decision d = h.DecisionFor(step, rank);
      EXPECT_EQ(d.step, step);
      if (step % 7 == 0) {
        ++all;
        EXPECT_TRUE(d.average && d.level == 1 && d.period == 7 && d.subgroup.first_rank == 0 &&
                    d.subgroup.size == 4)
            << "step " << step << " rank " << rank;
      } else if (step % 3 == 0) {
        ++pairs;
        EXPECT_TRUE(d.average && d.level == 0 && d.period == 3 &&
                    d.subgroup.first_rank == rank / 2 * 2 && d.subgroup.size == 2)
            << "step " << step << " rank " << rank;
      } else {
        ++skips;
        EXPECT_FALSE(d.average) << "step " << step << " rank " << rank;
      }
    }
    if (step == kMax) break;
  }
  EXPECT_GT(all, 0);
  EXPECT_GT(pairs, 0);
  EXPECT_GT(skips, 0);
  // A window that would pass INT64_MAX stops there; its decisions are the point decisions.
  const std::vector<Decision> w = h.Window(kMax - 1, 10, 3);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].step, kMax - 1);
  EXPECT_TRUE(w[0].average && w[0].level == 0 && w[0].subgroup.first_rank == 2);  // 3 | kMax-1
  EXPECT_EQ(w[1].step, kMax);
  EXPECT_TRUE(w[1].average && w[1].level == 1 && w[1].subgroup.size == 4);  // 7 | kMax
}

TEST(ScheduleWindowTest, EmptyOrNegativeCount_ReturnsNothing) {
  const Schedule s = Make(Periodic(2, 2, 0));
  EXPECT_TRUE(s.Window(0, 0, 0).empty());
  EXPECT_TRUE(s.Window(0, -5, 0).empty());
  EXPECT_TRUE(s.WindowAllSubgroups(0, 0).empty());
}

}  // namespace
}  // namespace modelavg
