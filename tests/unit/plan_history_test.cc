// PlanHistory (common/plan_history.h): the decisions of a job whose plan changed, against a
// naive restatement of the rule (the old plan's averager before the switch step E, the new
// plan's from E on, each as PyTorch decides: tests/reference/naive_schedule.h), for random
// specs and switch steps, every rank, every step; and what a level carries across E.
#include "modelavg/common/plan_history.h"

#include <random>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/reference/naive_schedule.h"

namespace modelavg {
namespace {

using testing::NaiveDecide;
using testing::NaiveDecision;

Schedule ScheduleOf(const v1::JobSpec& spec) {
  absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  absl::StatusOr<Schedule> schedule = Schedule::Create(*s);
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  return *schedule;
}

// A random valid spec of `world` ranks: periodic (one level) or hierarchical (1-3 levels,
// distinct periods, group sizes dividing the world, the last one the world).
v1::JobSpec RandomSpec(std::mt19937& rng, int world, v1::Mode mode, int64_t warmup) {
  v1::JobSpec spec;
  spec.set_job_id("j");
  spec.set_world_size(world);
  spec.set_mode(mode);
  spec.set_warmup_steps(warmup);
  const int levels = mode == v1::PERIODIC ? 1 : 1 + static_cast<int>(rng() % 3);
  std::vector<int> groups;
  for (int g = 1; g <= world; ++g) {
    if (world % g == 0) groups.push_back(g);
  }
  std::vector<int64_t> used;
  for (int i = 0; i < levels; ++i) {
    int64_t period;
    do {
      period = 1 + static_cast<int64_t>(rng() % 12);
    } while (std::find(used.begin(), used.end(), period) != used.end());
    used.push_back(period);
    v1::Level* l = spec.add_levels();
    l->set_period(period);
    l->set_group_size(i + 1 == levels ? world : groups[rng() % groups.size()]);
    if (rng() % 3 == 0) {
      l->mutable_outer()->set_lr(0.5 + 0.1 * static_cast<double>(rng() % 5));
      l->mutable_outer()->set_momentum(rng() % 2 == 0 ? 0.0 : 0.9);
    }
  }
  return spec;
}

void ExpectMatchesNaive(const Decision& got, const NaiveDecision& want, int plan,
                        const std::string& where) {
  ASSERT_EQ(got.average, want.average) << where;
  EXPECT_EQ(got.plan, plan) << where;
  if (!want.average) return;
  EXPECT_EQ(got.level, want.level) << where;
  std::vector<int32_t> ranks = got.subgroup.Ranks();
  EXPECT_EQ(std::vector<int>(ranks.begin(), ranks.end()), want.group) << where;
}

TEST(PlanHistoryTest, DecisionFor_RandomSpecsAndSwitchSteps_OldPlanBeforeNewPlanFrom) {
  std::mt19937 rng(20261202);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = trial % 2 == 0 ? 8 : 12;
    const v1::Mode mode = trial % 5 == 0 ? v1::PERIODIC : v1::HIERARCHICAL;
    const v1::JobSpec a = RandomSpec(rng, world, mode, static_cast<int64_t>(rng() % 6));
    v1::JobSpec b = RandomSpec(rng, world, mode, a.warmup_steps());
    v1::JobSpec c = RandomSpec(rng, world, mode, a.warmup_steps());
    const int64_t e1 = 1 + static_cast<int64_t>(rng() % 60);
    const int64_t e2 = e1 + 1 + static_cast<int64_t>(rng() % 60);
    PlanHistory plans(ScheduleOf(a));
    ASSERT_TRUE(plans.Add(ScheduleOf(b), e1).ok());
    ASSERT_TRUE(plans.Add(ScheduleOf(c), e2).ok());
    for (int64_t step = 0; step < e2 + 80; ++step) {
      const v1::JobSpec& in_force = step < e1 ? a : step < e2 ? b : c;
      const int version = step < e1 ? 0 : step < e2 ? 1 : 2;
      EXPECT_EQ(plans.VersionAt(step), version);
      for (int rank = 0; rank < world; ++rank) {
        ExpectMatchesNaive(plans.DecisionFor(step, rank), NaiveDecide(in_force, step, rank),
                           version,
                           "trial " + std::to_string(trial) + " step " + std::to_string(step) +
                               " rank " + std::to_string(rank));
      }
    }
    // Windows across the switches: the same decisions, every rank.
    for (int rank = 0; rank < world; rank += 3) {
      const std::vector<Decision> w = plans.Window(e1 - 5 > 0 ? e1 - 5 : 0, 100, rank);
      for (const Decision& d : w) EXPECT_TRUE(d == plans.DecisionFor(d.step, rank));
    }
    // Every subgroup at once: one decision per subgroup of each averaging step, of its plan.
    const int64_t from = e1 > 3 ? e1 - 3 : 0;
    for (const Decision& d : plans.WindowAllSubgroups(from, 40)) {
      EXPECT_EQ(d.plan, plans.VersionAt(d.step));
      if (d.average) EXPECT_TRUE(d == plans.DecisionFor(d.step, d.subgroup.first_rank));
    }
  }
}

v1::JobSpec Hierarchical(std::vector<std::pair<int64_t, int>> levels, int world = 8) {
  v1::JobSpec spec;
  spec.set_job_id("j");
  spec.set_world_size(world);
  spec.set_mode(v1::HIERARCHICAL);
  for (auto [period, group] : levels) {
    v1::Level* l = spec.add_levels();
    l->set_period(period);
    l->set_group_size(group);
  }
  return spec;
}

TEST(PlanHistoryTest, CarryAt_KeepsSameGroupAndFragmentsOuter_OtherwiseFresh) {
  v1::JobSpec a = Hierarchical({{2, 2}, {8, 8}});
  a.mutable_levels(1)->mutable_outer()->set_lr(0.7);
  a.mutable_levels(1)->mutable_outer()->set_momentum(0.9);
  a.mutable_levels(1)->mutable_outer()->set_nesterov(true);
  // The outer lr decays, the period doubles (the same level), a level is added.
  v1::JobSpec b = Hierarchical({{2, 2}, {16, 8}, {32, 8}});
  *b.mutable_levels(1)->mutable_outer() = a.levels(1).outer();
  b.mutable_levels(1)->mutable_outer()->set_lr(0.35);
  b.mutable_levels(2)->mutable_outer()->set_lr(1.0);
  PlanHistory plans(ScheduleOf(a));
  ASSERT_TRUE(plans.Add(ScheduleOf(b), 100).ok());
  EXPECT_EQ(plans.CarryAt(1, 0), LevelCarry::kPlain);
  EXPECT_EQ(plans.CarryAt(1, 1), LevelCarry::kKeepOuter);
  EXPECT_EQ(plans.CarryAt(1, 2), LevelCarry::kFresh);
  // The kept level's anchors were set at its first averaging step of the job (step 0: no
  // warm-up); the new level's at its first averaging step from the switch on: 128 (32 * 4;
  // 32 * 3 = 96 < 100).
  EXPECT_EQ(plans.FirstStepOf(1, 1), 0);
  EXPECT_EQ(plans.FirstStepOf(1, 2), 128);
  // A group size that changes starts afresh too.
  v1::JobSpec c = b;
  c.mutable_levels(1)->set_group_size(4);
  ASSERT_TRUE(plans.Add(ScheduleOf(c), 200).ok());
  EXPECT_EQ(plans.CarryAt(2, 1), LevelCarry::kFresh);
  EXPECT_EQ(plans.FirstStepOf(2, 1), 208);  // 16 * 13 = 208 >= 200, not taken by level 2 (32)
  EXPECT_EQ(plans.FirstStepOf(2, 2), 128);  // kept from version 1
}

TEST(PlanHistoryTest, SwitchStepFrom_NoDelayedRoundInFlightAcrossTheSwitch) {
  v1::JobSpec a = Hierarchical({{8, 8}});
  v1::Level* l = a.mutable_levels(0);
  l->mutable_outer()->set_lr(0.7);
  l->set_fragments(2);   // step period 4: syncs at 0, 4, 8, ...
  l->set_sync_delay(3);  // applied at 3, 7, 11, ...
  PlanHistory plans(ScheduleOf(a));
  for (int64_t earliest = 1; earliest < 40; ++earliest) {
    const int64_t e = plans.SwitchStepFrom(earliest);
    EXPECT_GE(e, earliest);
    EXPECT_LT(e, earliest + 4);
    for (int64_t s = 0; s < e; ++s) {
      if (s % 4 == 0) EXPECT_LT(s + 3, e) << "a sync started at " << s << " is applied at or past " << e;
    }
  }
  // No delay: every step will do.
  PlanHistory plain(ScheduleOf(Hierarchical({{4, 8}})));
  EXPECT_EQ(plain.SwitchStepFrom(13), 13);
}

TEST(PlanHistoryTest, Add_RefusesWhatMayNotChange) {
  PlanHistory plans(ScheduleOf(Hierarchical({{2, 2}, {8, 8}})));
  absl::Status world = plans.Add(ScheduleOf(Hierarchical({{2, 2}, {8, 4}}, 4)), 10);
  EXPECT_TRUE(absl::IsInvalidArgument(world));
  EXPECT_NE(world.message().find("world_size"), std::string::npos) << world;
  v1::JobSpec periodic = Hierarchical({{8, 8}});
  periodic.set_mode(v1::PERIODIC);
  absl::Status mode = plans.Add(ScheduleOf(periodic), 10);
  EXPECT_NE(mode.message().find("mode"), std::string::npos) << mode;
  v1::JobSpec sharded = Hierarchical({{2, 2}, {8, 8}});
  sharded.set_replica_size(2);
  absl::Status replica = plans.Add(ScheduleOf(sharded), 10);
  EXPECT_NE(replica.message().find("replica_size"), std::string::npos) << replica;
  ASSERT_TRUE(plans.Add(ScheduleOf(Hierarchical({{4, 2}, {8, 8}})), 10).ok());
  absl::Status back = plans.Add(ScheduleOf(Hierarchical({{4, 2}, {16, 8}})), 10);
  EXPECT_NE(back.message().find("switch step 10"), std::string::npos) << back;
  EXPECT_EQ(plans.size(), 2);
}

}  // namespace
}  // namespace modelavg
