// The planned rounds of a paced job (server/pacing/paced_plan.h): when rounds are planned,
// where a member's decisions end, the weights, the lower levels between rounds, the members of
// an elastic job at their own steps, and the budget's end. The expected steps and weights are
// restated here by hand (docs/paced.md's rule), not read from the class.
#include "server/pacing/paced_plan.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/common/schedule.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// World 4 in pairs (level 0: period 2, group 2) under a paced level of period 8: two groups,
// {0, 1} and {2, 3}.
Schedule PairsUnderPaced(int64_t rounds = 0) {
  ScheduleSpec spec{4, 0, AveragingMode::kHierarchical, {{2, 2}, {8, 4}}};
  spec.levels[1].paced = true;
  spec.levels[1].rounds = rounds;
  absl::StatusOr<Schedule> s = Schedule::Create(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

MemberSteps AllMembers() { return MemberSteps{}; }

TEST(PacedPlanTest, RoundZeroStepLocked_NextPlannedOnlyWhenAMemberPassesIt) {
  const Schedule schedule = PairsUnderPaced();
  absl::StatusOr<PacedPlan> plan = PacedPlan::Create(schedule);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->DecidedThrough(0), -1);  // nothing planned before a member asks
  ASSERT_TRUE(plan->PlanFor(0, 0).ok());
  EXPECT_EQ(plan->DecidedThrough(0), 0);  // round 0 at step 0
  EXPECT_EQ(plan->rounds().size(), 1u);
  // Pair {2, 3} is 3x as fast as pair {0, 1} (the slower member of a pair sets its pace).
  plan->NotePace(0, 10);
  plan->NotePace(1, 12);
  plan->NotePace(2, 30);
  plan->NotePace(3, 31);
  absl::StatusOr<bool> planned = plan->PlanFor(2, 1);
  ASSERT_TRUE(planned.ok());
  EXPECT_TRUE(*planned);
  ASSERT_EQ(plan->rounds().size(), 2u);
  // n = floor(8 * 30 / 10) = 24 for the fast pair, 8 for the slow one, from round 0's step 0.
  EXPECT_THAT(plan->rounds()[1].round.sync_step, ElementsAre(8, 24));
  EXPECT_THAT(plan->rounds()[1].round.inner_steps, ElementsAre(8, 24));
  EXPECT_EQ(plan->DecidedThrough(0), 8);
  EXPECT_EQ(plan->DecidedThrough(3), 24);
  // Asking again inside the planned round plans nothing.
  EXPECT_FALSE(*plan->PlanFor(3, 20));
  EXPECT_FALSE(*plan->PlanFor(0, 8));
}

TEST(PacedPlanTest, Decisions_PacedAtOwnSyncStep_LowerLevelsBetween_WeightsFromTokens) {
  const Schedule schedule = PairsUnderPaced();
  PacedPlan plan = *PacedPlan::Create(schedule);
  plan.NoteTokens(0, 2.0);
  plan.NoteTokens(2, 0.5);
  plan.NotePace(0, 10);
  plan.NotePace(1, 10);
  plan.NotePace(2, 20);
  plan.NotePace(3, 20);
  ASSERT_TRUE(plan.PlanFor(0, 1).ok());
  // Round 1: pair {0,1} at 8 (+8), pair {2,3} at 16 (+16).
  absl::StatusOr<Decision> d = plan.DecisionFor(schedule, AllMembers(), 16, 2);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->average);
  EXPECT_EQ(d->level, 1);
  EXPECT_EQ(d->round, 1);
  EXPECT_THAT(d->members, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(d->weights, ElementsAre(8 * 2.0, 8 * 1.0, 16 * 0.5, 16 * 1.0));
  // Rank 0 gets the same round at its own step, 8, with the same weights.
  absl::StatusOr<Decision> d0 = plan.DecisionFor(schedule, AllMembers(), 8, 0);
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ(d0->round, 1);
  EXPECT_EQ(d0->weights, d->weights);
  // Step 8 of the fast pair is no sync step: its lower level (period 2) averages the pair.
  absl::StatusOr<Decision> lower = plan.DecisionFor(schedule, AllMembers(), 8, 2);
  ASSERT_TRUE(lower.ok());
  EXPECT_TRUE(lower->average);
  EXPECT_EQ(lower->level, 0);
  EXPECT_EQ(lower->round, -1);
  EXPECT_TRUE(lower->weights.empty());
  // An odd step: nothing.
  EXPECT_FALSE(plan.DecisionFor(schedule, AllMembers(), 9, 2)->average);
  // Round 0: n = 1 (steps 0..0) for every group.
  EXPECT_THAT(plan.DecisionFor(schedule, AllMembers(), 0, 1)->weights,
              ElementsAre(2.0, 1.0, 0.5, 1.0));
}

TEST(PacedPlanTest, TokensChangeAfterPlanning_RoundsPlannedKeepTheirWeights) {
  const Schedule schedule = PairsUnderPaced();
  PacedPlan plan = *PacedPlan::Create(schedule);
  ASSERT_TRUE(plan.PlanFor(0, 1).ok());  // round 1, all at +8 (no pace known)
  const std::vector<double> before = plan.DecisionFor(schedule, AllMembers(), 8, 0)->weights;
  plan.NoteTokens(1, 4.0);
  EXPECT_EQ(plan.DecisionFor(schedule, AllMembers(), 8, 0)->weights, before);
  ASSERT_TRUE(plan.PlanFor(0, 9).ok());
  EXPECT_THAT(plan.DecisionFor(schedule, AllMembers(), 16, 0)->weights,
              ElementsAre(8.0, 32.0, 8.0, 8.0));
}

TEST(PacedPlanTest, Tokens_CheckedWithAClearMessage) {
  EXPECT_TRUE(PacedPlan::CheckTokens(0).ok());
  EXPECT_TRUE(PacedPlan::CheckTokens(4096).ok());
  for (double bad : {-1.0, 2e12, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    absl::Status s = PacedPlan::CheckTokens(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_THAT(s.message(), HasSubstr("tokens_per_step")) << bad;
  }
}

TEST(PacedPlanTest, Budget_LastRoundEndsThePlan_LowerLevelsAfter) {
  const Schedule schedule = PairsUnderPaced(/*rounds=*/3);
  PacedPlan plan = *PacedPlan::Create(schedule);
  ASSERT_TRUE(plan.PlanFor(0, 1000).ok());
  ASSERT_EQ(plan.rounds().size(), 3u);  // rounds 0, 1, 2 and no more
  EXPECT_EQ(plan.rounds().back().round.round, 2);
  EXPECT_EQ(plan.DecidedThrough(0), std::numeric_limits<int64_t>::max());
  // Step 24 would be round 3 step-locked: past the budget, the lower level takes it.
  absl::StatusOr<Decision> d = plan.DecisionFor(schedule, AllMembers(), 24, 0);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->level, 0);
  EXPECT_EQ(d->round, -1);
}

TEST(PacedPlanTest, Elastic_MembersAndJoiningAtTheirOwnSyncSteps) {
  const Schedule schedule = PairsUnderPaced();
  PacedPlan plan = *PacedPlan::Create(schedule);
  plan.NotePace(0, 10);
  plan.NotePace(1, 10);
  plan.NotePace(2, 20);
  plan.NotePace(3, 20);
  ASSERT_TRUE(plan.PlanFor(0, 1).ok());  // round 1: {0,1} at 8, {2,3} at 16
  MemberSteps view;
  view.all_from_start = false;
  view.from_step = {0, 8, 0, kNotMember};  // rank 1 admitted at its step 8; rank 3 vacant
  view.until_step = {kNotMember, kNotMember, kNotMember, kNotMember};
  absl::StatusOr<Decision> d = plan.DecisionFor(schedule, view, 16, 2);
  ASSERT_TRUE(d.ok());
  EXPECT_THAT(d->members, ElementsAre(0, 1, 2));
  EXPECT_THAT(d->joining, ElementsAre(1));
  EXPECT_THAT(d->weights, ElementsAre(8.0, 0.0, 16.0));
}

TEST(PacedPlanTest, PeriodicJob_SkipBetweenRounds) {
  ScheduleSpec spec{3, 5, AveragingMode::kPeriodic, {{10, 3}}};
  spec.levels[0].paced = true;
  const Schedule schedule = *Schedule::Create(spec);
  PacedPlan plan = *PacedPlan::Create(schedule);
  ASSERT_TRUE(plan.PlanFor(0, 0).ok());
  EXPECT_EQ(plan.DecidedThrough(0), 5);  // round 0 at warm-up
  absl::StatusOr<Decision> first = plan.DecisionFor(schedule, AllMembers(), 5, 0);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->round, 0);
  EXPECT_THAT(first->weights, ElementsAre(6.0, 6.0, 6.0));  // steps 0..5
  EXPECT_FALSE(plan.DecisionFor(schedule, AllMembers(), 4, 0)->average);
  ASSERT_TRUE(plan.PlanFor(1, 6).ok());
  EXPECT_FALSE(plan.DecisionFor(schedule, AllMembers(), 14, 0)->average);
  EXPECT_EQ(plan.DecisionFor(schedule, AllMembers(), 15, 0)->round, 1);
}

// Nothing is planned until the caller commits (it stores the rounds first); the stored rounds
// give a plan that decides every step as the first did, and plans on from them.
TEST(PacedPlanTest, StoredRoundsRestored_SameDecisions_PlanningGoesOn) {
  const Schedule schedule = PairsUnderPaced();
  PacedPlan plan = *PacedPlan::Create(schedule);
  plan.NoteTokens(3, 3.0);
  plan.NotePace(0, 10);
  plan.NotePace(1, 10);
  plan.NotePace(2, 25);
  plan.NotePace(3, 25);
  absl::StatusOr<std::vector<PlannedRound>> needed = plan.RoundsNeeded(0, 9);
  ASSERT_TRUE(needed.ok());
  ASSERT_EQ(needed->size(), 3u);  // rounds 0, 1, 2
  EXPECT_TRUE(plan.rounds().empty());
  EXPECT_EQ(plan.FirstKeptAfter(needed->size()), 0);
  plan.Commit(*std::move(needed));
  std::vector<v1::PacedRound> stored;
  for (const PlannedRound& p : plan.rounds()) stored.push_back(plan.ToProto(p));
  EXPECT_EQ(stored[2].sync_steps(1), 40);  // 0 + 20 + 20
  EXPECT_EQ(stored[2].group_paces(1), 25);
  PacedPlan again = *PacedPlan::Create(schedule);
  ASSERT_TRUE(again.Restore(stored).ok());
  for (int32_t rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(again.DecidedThrough(rank), plan.DecidedThrough(rank));
    for (int64_t step = 0; step <= plan.DecidedThrough(rank); ++step) {
      absl::StatusOr<Decision> a = plan.DecisionFor(schedule, AllMembers(), step, rank);
      absl::StatusOr<Decision> b = again.DecisionFor(schedule, AllMembers(), step, rank);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_TRUE(*a == *b && a->round == b->round && a->weights == b->weights)
          << "rank " << rank << " step " << step;
    }
  }
  // Tokens come back from the last round: round 3 weighs rank 3 by 3 again.
  ASSERT_TRUE(again.PlanFor(0, 17).ok());
  EXPECT_EQ(again.rounds().back().round.round, 3);
  EXPECT_EQ((*again.rounds().back().tokens)[3], 3.0);
  // A record of another job's shape is refused.
  stored[1].mutable_sync_steps()->RemoveLast();
  EXPECT_TRUE(absl::IsInvalidArgument(PacedPlan::Create(schedule)->Restore(stored)));
}

}  // namespace
}  // namespace modelavg::server
