// The schedule with fragments (streaming sync) against a naive re-statement of the rule:
// fragment f of a level of period H and F fragments syncs at the steps s with
// s mod H == f * H / F (every H steps, the fragments staggered H / F apart); the hierarchy walk
// takes, from the last level to the first, the first level one of whose fragments syncs at s.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg {
namespace {

using ::modelavg::testing::SpecFromText;
using ::testing::HasSubstr;

ScheduleLevel Frag(int64_t period, int32_t group, int32_t fragments) {
  ScheduleLevel l{period, group};
  l.fragments = fragments;
  return l;
}

Schedule Make(const ScheduleSpec& spec) {
  absl::StatusOr<Schedule> s = Schedule::Create(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

struct Naive {
  int level = -1;
  int fragment = 0;
};

// The rule, stated per fragment. `from` is the step counted from the phase origin (warm-up for
// a periodic job, 0 for a hierarchical one).
Naive NaiveDecision(const ScheduleSpec& spec, int64_t step) {
  Naive out;
  if (step < spec.warmup_steps) return out;
  const int64_t from =
      spec.mode == AveragingMode::kPeriodic ? step - spec.warmup_steps : step;
  for (int i = static_cast<int>(spec.levels.size()) - 1; i >= 0; --i) {
    const ScheduleLevel& l = spec.levels[i];
    for (int f = 0; f < l.fragments; ++f) {
      if (from % l.period == f * (l.period / l.fragments)) {
        out.level = i;
        out.fragment = f;
        return out;
      }
    }
  }
  return out;
}

void ExpectMatchesNaive(const ScheduleSpec& spec, int64_t steps) {
  const Schedule s = Make(spec);
  for (int32_t rank = 0; rank < spec.world_size; ++rank) {
    const std::vector<Decision> window = s.Window(0, steps, rank);
    ASSERT_EQ(window.size(), static_cast<size_t>(steps));
    for (const Decision& d : window) {
      const Naive n = NaiveDecision(spec, d.step);
      ASSERT_EQ(d.average, n.level >= 0) << "step " << d.step;
      if (!d.average) continue;
      ASSERT_EQ(d.level, n.level) << "step " << d.step;
      ASSERT_EQ(d.fragment, n.fragment) << "step " << d.step << " level " << d.level;
      ASSERT_EQ(d.fragments, spec.levels[d.level].fragments);
      ASSERT_EQ(d.period, spec.levels[d.level].period);
      const int32_t g = spec.levels[d.level].group_size;
      ASSERT_EQ(d.subgroup.first_rank, rank / g * g);
      ASSERT_EQ(d.subgroup.size, g);
    }
  }
  // The all-subgroups window carries the same fragment.
  for (const Decision& d : s.WindowAllSubgroups(0, steps)) {
    const Naive n = NaiveDecision(spec, d.step);
    ASSERT_EQ(d.average, n.level >= 0);
    if (d.average) ASSERT_EQ(d.fragment, n.fragment) << "step " << d.step;
  }
}

TEST(FragmentScheduleTest, OneLevelFourFragments_SyncsEachFragmentOncePerPeriod) {
  const ScheduleSpec spec{4, 0, AveragingMode::kHierarchical, {Frag(8, 4, 4)}};
  const Schedule s = Make(spec);
  std::vector<int> fragments;
  for (const Decision& d : s.Window(0, 17, 0)) {
    if (d.average) fragments.push_back(d.fragment);
    EXPECT_EQ(d.average, d.step % 2 == 0) << d.step;
  }
  EXPECT_EQ(fragments, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3, 0}));
  ExpectMatchesNaive(spec, 64);
}

TEST(FragmentScheduleTest, PeriodicWithWarmup_PhaseFromWarmup) {
  const ScheduleSpec spec{2, 5, AveragingMode::kPeriodic, {Frag(6, 2, 3)}};
  const Schedule s = Make(spec);
  // Acts at 5, 7, 9, 11, ... on fragments 0, 1, 2, 0, ...
  EXPECT_FALSE(s.DecisionFor(4, 0).average);
  EXPECT_EQ(s.DecisionFor(5, 0).fragment, 0);
  EXPECT_FALSE(s.DecisionFor(6, 0).average);
  EXPECT_EQ(s.DecisionFor(7, 1).fragment, 1);
  EXPECT_EQ(s.DecisionFor(9, 1).fragment, 2);
  EXPECT_EQ(s.DecisionFor(11, 0).fragment, 0);
  ExpectMatchesNaive(spec, 80);
}

TEST(FragmentScheduleTest, OneFragment_IsTodaysSchedule) {
  // F = 1 everywhere: decisions equal those of the same spec without streaming fields, and
  // every fragment is 0.
  const ScheduleSpec spec{4, 10, AveragingMode::kHierarchical, {{2, 2}, {4, 4}, {8, 4}}};
  const Schedule s = Make(spec);
  for (const Decision& d : s.Window(0, 100, 3)) {
    EXPECT_EQ(d.fragment, 0);
    EXPECT_EQ(d.fragments, 1);
  }
  ExpectMatchesNaive(spec, 100);
}

TEST(FragmentScheduleTest, FragmentedLevelOutranksAnother_DocumentedExample) {
  // The example of Schedule::LevelAt: (4, 2) then (8, 4, fragments 4). The second level's step
  // period is 2: it takes every even step, so the first level never acts.
  const ScheduleSpec spec{4, 0, AveragingMode::kHierarchical, {{4, 2}, Frag(8, 4, 4)}};
  const Schedule s = Make(spec);
  for (const Decision& d : s.Window(0, 32, 1)) {
    EXPECT_EQ(d.average, d.step % 2 == 0);
    if (d.average) {
      EXPECT_EQ(d.level, 1);
      EXPECT_EQ(d.fragment, (d.step / 2) % 4);
    }
  }
  EXPECT_FALSE(ScheduleWarnings(spec).empty());  // step periods 4 then 2: not ascending
  ExpectMatchesNaive(spec, 64);
}

TEST(FragmentScheduleTest, FragmentedInnerLevelBelowWholeModelOuterLevel) {
  // Inner (6, 2, fragments 3) acts at multiples of 2; the outer (12, 4) takes multiples of 12.
  const ScheduleSpec spec{4, 3, AveragingMode::kHierarchical, {Frag(6, 2, 3), {12, 4}}};
  const Schedule s = Make(spec);
  EXPECT_EQ(s.DecisionFor(12, 0).level, 1);
  EXPECT_EQ(s.DecisionFor(14, 0).level, 0);
  EXPECT_EQ(s.DecisionFor(14, 0).fragment, 1);  // 14 / 2 = 7, mod 3
  EXPECT_EQ(s.DecisionFor(16, 0).fragment, 2);
  ExpectMatchesNaive(spec, 120);
}

TEST(FragmentScheduleTest, RandomSpecs_MatchNaiveReference) {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t world = std::vector<int32_t>{1, 2, 4, 6, 8}[rng() % 5];
    ScheduleSpec spec;
    spec.world_size = world;
    spec.warmup_steps = rng() % 12;
    spec.mode = rng() % 4 == 0 ? AveragingMode::kPeriodic : AveragingMode::kHierarchical;
    const int levels = spec.mode == AveragingMode::kPeriodic ? 1 : 1 + rng() % 3;
    std::vector<int32_t> groups;
    for (int32_t g = 1; g <= world; ++g) {
      if (world % g == 0) groups.push_back(g);
    }
    std::vector<int64_t> used;
    for (int i = 0; i < levels; ++i) {
      int64_t period;
      do {
        period = 1 + rng() % 24;
      } while (std::find(used.begin(), used.end(), period) != used.end());
      used.push_back(period);
      std::vector<int32_t> divisors;
      for (int32_t f = 1; f <= period; ++f) {
        if (period % f == 0) divisors.push_back(f);
      }
      ScheduleLevel l{period, i == levels - 1 ? world : groups[rng() % groups.size()]};
      l.fragments = divisors[rng() % divisors.size()];
      spec.levels.push_back(l);
    }
    SCOPED_TRACE(trial);
    ExpectMatchesNaive(spec, 150);
  }
}

TEST(FragmentScheduleTest, BadStreamingFields_InvalidArgumentNamingField) {
  const auto error = [](ScheduleLevel l) {
    ScheduleSpec spec{2, 0, AveragingMode::kHierarchical, {{2, 1}, l}};
    return std::string(Schedule::Create(spec).status().message());
  };
  EXPECT_THAT(error(Frag(8, 2, 3)), HasSubstr("levels[1].fragments 3 does not divide"));
  EXPECT_THAT(error(Frag(8, 2, 0)), HasSubstr("levels[1].fragments must be in [1"));
  EXPECT_THAT(error(Frag(8, 2, 16)), HasSubstr("levels[1].fragments 16 does not divide"));
  ScheduleLevel bf16 = Frag(8, 2, 2);
  bf16.payload = Payload::kBf16;
  EXPECT_THAT(error(bf16), HasSubstr("levels[1].payload BF16 needs an outer level"));
  EXPECT_THAT(error(bf16), HasSubstr("lr 1 and momentum 0"));
  ScheduleLevel delayed = Frag(8, 2, 2);
  delayed.sync_delay = 4;  // step period 4: at most 3
  EXPECT_THAT(error(delayed), HasSubstr("levels[1].sync_delay must be in [0, period / "
                                        "fragments = 4), got 4"));
  delayed.sync_delay = 1;
  EXPECT_THAT(error(delayed), HasSubstr("levels[1].sync_delay 1 needs an outer level"));
  ScheduleLevel mixed = Frag(8, 2, 2);
  mixed.mix = 1.5;
  EXPECT_THAT(error(mixed), HasSubstr("levels[1].mix must be in [0, 1], got 1.5"));
  mixed.mix = std::nan("");
  EXPECT_THAT(error(mixed), HasSubstr("levels[1].mix must be in [0, 1]"));
  mixed.mix = 0.5;
  EXPECT_THAT(error(mixed), HasSubstr("levels[1].mix 0.5 needs an outer level"));
}

TEST(FragmentScheduleTest, StreamingFieldsOnOuterLevel_Valid) {
  ScheduleLevel l = Frag(8, 2, 4);
  l.outer = OuterSgd{0.7, 0.9, true};
  l.sync_delay = 1;
  l.mix = 0.5;
  l.payload = Payload::kInt8;
  const ScheduleSpec spec{2, 0, AveragingMode::kHierarchical, {{3, 1}, l}};
  EXPECT_TRUE(Schedule::Create(spec).ok()) << Schedule::Create(spec).status();
  l.sync_delay = 2;  // step period 2
  EXPECT_THAT(std::string(Schedule::Create(ScheduleSpec{2, 0, AveragingMode::kHierarchical,
                                                        {{3, 1}, l}})
                              .status()
                              .message()),
              HasSubstr("levels[1].sync_delay must be in [0, period / fragments = 2)"));
}

TEST(FragmentJobSpecTest, ProtoFields_ConvertAndRoundTrip) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(SpecFromText(R"pb(
    job_id: "j" world_size: 4 mode: HIERARCHICAL
    levels { period: 2 group_size: 2 } levels { period: 8 group_size: 4 fragments: 4 }
  )pb"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->levels[0].fragments, 1);  // 0 on the wire: one fragment
  EXPECT_EQ(s->levels[1].fragments, 4);
  v1::JobSpec back;
  ScheduleSpecToProto(*s, &back);
  EXPECT_EQ(back.levels(1).fragments(), 4);
  EXPECT_EQ(back.levels(0).fragments(), 0);
  EXPECT_EQ(back.levels(1).payload(), v1::FP32);

  absl::StatusOr<ScheduleSpec> bad = ScheduleSpecFromProto(SpecFromText(R"pb(
    job_id: "j" world_size: 2 mode: PERIODIC levels { period: 4 group_size: 2 payload: INT8 }
  )pb"));
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("levels[0].payload INT8 needs an outer level"));
  absl::StatusOr<ScheduleSpec> negative = ScheduleSpecFromProto(SpecFromText(R"pb(
    job_id: "j" world_size: 2 mode: PERIODIC levels { period: 4 group_size: 2 fragments: -2 }
  )pb"));
  EXPECT_THAT(std::string(negative.status().message()),
              HasSubstr("levels[0].fragments must be >= 1"));
}

TEST(FragmentJobSpecTest, DecisionCarriesFragment) {
  const Schedule s = Make(ScheduleSpec{2, 0, AveragingMode::kPeriodic, {Frag(6, 2, 3)}});
  const Decision d = s.DecisionFor(4, 1);
  ASSERT_TRUE(d.average);
  v1::StepDecision proto;
  DecisionToProto(d, 3, &proto);
  EXPECT_EQ(proto.fragment(), 2);
  EXPECT_EQ(proto.fragments(), 3);
  const Decision back = DecisionFromProto(proto);
  EXPECT_EQ(back, d);
  EXPECT_EQ(back.fragment, 2);
}

}  // namespace
}  // namespace modelavg
