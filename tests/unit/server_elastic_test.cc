// Elastic jobs (JobSpec.min_world_size) in the coordinator core: a death or a departure while
// RUNNING moves the job to a new generation of the survivors, vacant ranks keep their numbers,
// decisions list the live members, and below min_world_size the job falls back to PENDING.
#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/membership/admission.h"
#include "server/membership/member_credential.h"
#include "server/membership/membership.h"
#include "server/store/state_store.h"
#include "tests/unit/running_job_fixture.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

void JoinAll(Membership& m) {
  for (int32_t r = 0; r < m.world_size(); ++r) {
    ASSERT_TRUE(m.Join("w" + std::to_string(r), "h", r, kT0, "j").ok());
  }
  ASSERT_EQ(m.state(), v1::RUNNING);
}

TEST(ElasticMembershipTest, StrictByDefault_DeathFallsBackToPending) {
  Membership m(4);
  EXPECT_FALSE(m.elastic());
  JoinAll(m);
  const MembershipChange c = m.Die({2}, "rank 2 heartbeat timeout", kT0).value();
  EXPECT_TRUE(c.generation_changed);
  EXPECT_FALSE(c.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);
}

TEST(ElasticMembershipTest, Death_ShrinksIntoNewGenerationOfSurvivors_RankVacant) {
  Membership m(4, /*min_world_size=*/2);
  EXPECT_TRUE(m.elastic());
  JoinAll(m);
  const MembershipChange c = m.Die({2}, "rank 2 heartbeat timeout", kT0).value();
  EXPECT_TRUE(c.generation_changed);
  EXPECT_TRUE(c.shrunk);
  EXPECT_EQ(c.old_generation, 1);
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 3);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(2));
  for (int32_t r : {0, 1, 3}) {
    EXPECT_TRUE(m.InRound(r)) << r;
    EXPECT_EQ(m.member(r).generation, 2) << r;
  }
  EXPECT_EQ(m.member(2).state, v1::DEAD);
  // The transition is hard state: the header, the dead rank and the survivors' generation.
  ASSERT_TRUE(c.header.has_value());
  EXPECT_EQ(c.header->generation, 2);
  EXPECT_EQ(c.header->state, v1::RUNNING);
  EXPECT_EQ(c.members.size(), 4u);
}

TEST(ElasticMembershipTest, SurvivorsHeartbeatsWithTheirJoinGenerationStillCount) {
  Membership m(3, 2);
  JoinAll(m);
  ASSERT_TRUE(m.Die({1}, "rank 1 heartbeat timeout", kT0).ok());
  ASSERT_EQ(m.generation(), 2);
  // Rank 0 still reports generation 1 (it learns of the change later); that keeps it alive.
  m.Heartbeat(0, 1, 7, kT0 + absl::Seconds(2));
  m.Heartbeat(2, 2, 8, kT0 + absl::Seconds(2));
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(3), absl::Milliseconds(1500)), IsEmpty());
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(4), absl::Milliseconds(1500)), ElementsAre(0, 2));
}

TEST(ElasticMembershipTest, LeaveShrinks_TwoDeathsAtOnce_ThenBelowMinFallsBackToPending) {
  Membership m(6, 3);
  JoinAll(m);
  absl::StatusOr<Membership::LeaveResult> left = m.Leave(5, "finished early", kT0, "j");
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->change.shrunk);
  EXPECT_EQ(m.generation(), 2);
  const MembershipChange two = m.Die({0, 1}, "ranks 0, 1 heartbeat timeout", kT0).value();
  EXPECT_TRUE(two.shrunk);
  EXPECT_EQ(m.generation(), 3);
  EXPECT_EQ(m.round_size(), 3);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(0, 1, 5));
  // 2 of 6 alive, min 3: fails loudly, as a strict job does.
  const MembershipChange below = m.Die({3}, "rank 3 heartbeat timeout", kT0).value();
  EXPECT_TRUE(below.generation_changed);
  EXPECT_FALSE(below.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(m.round_size(), 0);
}

// The end of a run: workers that finish Leave one by one; an orderly departure never drops the
// job below min_world_size into PENDING (that would fail the workers still finishing), only a
// death does.
TEST(ElasticMembershipTest, LeavesBelowMin_StayRunningUntilTheLast_DeathBelowMinFallsBack) {
  Membership m(4, 3);
  JoinAll(m);
  for (int32_t r : {0, 1}) {
    absl::StatusOr<Membership::LeaveResult> left = m.Leave(r, "finished", kT0, "j");
    ASSERT_TRUE(left.ok());
    EXPECT_TRUE(left->change.shrunk) << "rank " << r;
    EXPECT_EQ(m.state(), v1::RUNNING) << "after rank " << r << " left";
  }
  EXPECT_EQ(m.round_size(), 2);  // below min 3, still RUNNING
  const MembershipChange died = m.Die({2}, "rank 2 heartbeat timeout", kT0).value();
  EXPECT_FALSE(died.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);

  Membership n(3, 2);
  JoinAll(n);
  for (int32_t r : {0, 1, 2}) ASSERT_TRUE(n.Leave(r, "finished", kT0, "j").ok());
  EXPECT_EQ(n.state(), v1::FINISHED);
}

// --- Admission of replacements (Membership; its default schedule averages the world at every
// step, so the admission step is the floor).

// Joins ranks 0..world-1 as workers "w<r>" with credentials "c<r>", each reporting `step`.
void JoinAllReporting(Membership& m, int64_t step, absl::Time t = kT0) {
  for (int32_t r = 0; r < m.world_size(); ++r) {
    ASSERT_TRUE(m.Join("w" + std::to_string(r), "h", r, t, "j", "",
                       CredentialDigest("c" + std::to_string(r)))
                    .ok());
  }
  ASSERT_EQ(m.state(), v1::RUNNING);
  for (int32_t r = 0; r < m.world_size(); ++r) m.Heartbeat(r, m.generation(), step, t);
}

TEST(ElasticAdmissionTest, TakesLowestVacancy_NewGenerationRunning_AdmittedAfterFloor) {
  Membership m(4, 2);
  JoinAllReporting(m, 10);
  ASSERT_TRUE(m.Die({1, 2}, "ranks 1, 2 heartbeat timeout", kT0).ok());
  ASSERT_EQ(m.generation(), 2);
  absl::StatusOr<Membership::JoinResult> j = m.Join("new", "h2", std::nullopt, kT0, "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->rank, 1);
  const MembershipChange& c = j->change;
  EXPECT_TRUE(c.admitted);
  EXPECT_TRUE(c.generation_changed);
  EXPECT_FALSE(c.replaced_live_member);
  EXPECT_EQ(c.old_generation, 2);
  EXPECT_EQ(c.changed_by_rank, 1);
  // No rate estimate yet (every report came at one instant): margin 2 over the largest step.
  EXPECT_EQ(c.max_reported_step, 10);
  EXPECT_EQ(c.admission_margin, 2);
  EXPECT_EQ(c.admission_floor, 12);
  EXPECT_EQ(c.admission_step, 12);
  EXPECT_THAT(c.reason, HasSubstr("rank 1 was admitted at step 12"));
  EXPECT_THAT(c.reason, HasSubstr("new"));
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.generation(), 3);
  EXPECT_EQ(m.round_size(), 3);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(2));
  EXPECT_EQ(m.member(1).admitted_step, 12);
  EXPECT_EQ(m.member(1).generation, 3);
  EXPECT_EQ(m.member(1).joined_generation, 3);
  EXPECT_EQ(m.member(1).last_heartbeat, kT0);  // its heartbeat timeout counts from the Join
  for (int32_t r : {0, 3}) {
    EXPECT_TRUE(m.InRound(r)) << r;
    EXPECT_EQ(m.member(r).admitted_step, -1) << r;
  }
  // Hard state: the header and every member of the new generation (with its admitted step).
  ASSERT_TRUE(c.header.has_value());
  EXPECT_EQ(c.header->generation, 3);
  EXPECT_EQ(c.header->state, v1::RUNNING);
  ASSERT_EQ(c.members.size(), 3u);
  EXPECT_EQ(c.members[1].rank, 1);
  EXPECT_EQ(c.members[1].admitted_step, 12);
  EXPECT_EQ(c.members[0].admitted_step, -1);
}

// A coordinator that took the job over (restart, new leader) knows its members' steps from
// their first beats but not how fast they run on: it admits nobody until it has measured the pace
// (kRateSampleInterval), then at a step past what the members reach meanwhile. (A chaos soak saw a
// new leader admit at "largest step reported + 2" 120 ms after taking over while the members,
// ~100 steps past their last beat, never heard of it in time: the whole job had to start again.)
TEST(ElasticAdmissionTest, AfterATakeOver_WaitsForTheMembersPaceThenAdmitsPastIt) {
  Membership m(4, 2);
  JoinAllReporting(m, 10);
  ASSERT_TRUE(m.Die({2}, "rank 2 heartbeat timeout", kT0).ok());
  MembershipHeader header;
  header.state = m.state();
  header.generation = m.generation();
  header.last_change = m.last_change();
  std::vector<Member> members;
  for (int32_t r = 0; r < 4; ++r) {
    if (m.member(r).present()) members.push_back(m.member(r));
  }
  Membership taken(4, 2);
  taken.Restore(header, members, kT0);
  for (int32_t r : {0, 1, 3}) taken.Heartbeat(r, taken.generation(), 500, kT0);
  absl::StatusOr<Membership::JoinResult> early = taken.Join("new", "h", std::nullopt, kT0, "j");
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(early.status().message(), HasSubstr("pace"));
  // A second of beats at 200 steps a second: the margin covers a second of them.
  const absl::Time later = kT0 + kRateSampleInterval;
  for (int32_t r : {0, 1, 3}) taken.Heartbeat(r, taken.generation(), 700, later);
  absl::StatusOr<Membership::JoinResult> admitted =
      taken.Join("new", "h", std::nullopt, later, "j");
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_GE(admitted->change.admission_step, 700 + 200);
}

TEST(ElasticAdmissionTest, RequestedVacancy_HeldRankRefusedNamingHolder_FullJobRefused) {
  Membership m(4, 2);
  JoinAllReporting(m, 5);
  ASSERT_TRUE(m.Die({1, 2}, "ranks 1, 2 heartbeat timeout", kT0).ok());
  absl::StatusOr<Membership::JoinResult> held = m.Join("x", "h", 3, kT0, "j");
  ASSERT_FALSE(held.ok());
  EXPECT_EQ(held.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(held.status().message(), HasSubstr("\"w3\""));
  absl::StatusOr<Membership::JoinResult> two = m.Join("x", "h", 2, kT0, "j");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->rank, 2);
  EXPECT_EQ(two->change.admission_step, 7);
  // The newcomer's admission step counts as its position until it reports: the next one is
  // admitted after it.
  absl::StatusOr<Membership::JoinResult> one = m.Join("y", "h", std::nullopt, kT0, "j");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->rank, 1);
  EXPECT_EQ(one->change.admission_step, 9);
  EXPECT_EQ(m.round_size(), 4);
  EXPECT_EQ(m.generation(), 4);
  absl::StatusOr<Membership::JoinResult> full = m.Join("z", "h", std::nullopt, kT0, "j");
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(full.status().message(), HasSubstr("full"));
  EXPECT_EQ(m.generation(), 4);
}

TEST(ElasticAdmissionTest, HolderRejoiningWithCredential_ReplacesItselfInSameRank) {
  Membership m(4, 2);
  JoinAllReporting(m, 20);
  // Nothing is vacant: the holder of rank 2 restarted and re-joins with its credential.
  absl::StatusOr<Membership::JoinResult> j =
      m.Join("w2-restarted", "h", std::nullopt, kT0, "j", "c2", CredentialDigest("c2b"));
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->rank, 2);
  EXPECT_TRUE(j->change.admitted);
  EXPECT_TRUE(j->change.replaced_live_member);
  EXPECT_EQ(j->change.admission_step, 22);
  EXPECT_THAT(j->change.reason, HasSubstr("re-joined"));
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 4);
  EXPECT_EQ(m.member(2).worker_id, "w2-restarted");
  EXPECT_EQ(m.member(2).admitted_step, 22);
  // The old credential is gone with the old membership.
  EXPECT_FALSE(m.CheckCredential(2, "c2", "Heartbeat", "j").ok());
  EXPECT_TRUE(m.CheckCredential(2, "c2b", "Heartbeat", "j").ok());
  // Naming the rank works the same way; a wrong credential does not.
  EXPECT_EQ(m.Join("z", "h", 1, kT0, "j", "c0").status().code(),
            absl::StatusCode::kAlreadyExists);
  absl::StatusOr<Membership::JoinResult> named = m.Join("w1", "h", 1, kT0, "j", "c1");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->rank, 1);
}

TEST(ElasticAdmissionTest, RetriedJoinOfSameWorker_KeepsItsRankUntilHeardFrom) {
  Membership m(4, 2);
  JoinAllReporting(m, 3);
  ASSERT_TRUE(m.Die({1, 2}, "ranks 1, 2 heartbeat timeout", kT0).ok());
  ASSERT_EQ(m.Join("new", "h", std::nullopt, kT0, "j", "", "", "nonce-1")->rank, 1);
  // Its reply was lost: the same worker asks again, without a credential, with the same Join's
  // nonce.
  absl::StatusOr<Membership::JoinResult> again =
      m.Join("new", "h", std::nullopt, kT0, "j", "", "", "nonce-1");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rank, 1);
  EXPECT_TRUE(again->change.replaced_live_member);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(2));
  // Once it has been heard from, its worker id alone no longer takes its rank.
  m.Heartbeat(1, m.generation(), 4, kT0);
  absl::StatusOr<Membership::JoinResult> third =
      m.Join("new", "h", std::nullopt, kT0, "j", "", "", "nonce-1");
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->rank, 2);
}

// The same worker id without the Join's nonce (or with another) is not the same Join: it does
// not take the replacement's rank, which is not heard from yet.
TEST(ElasticAdmissionTest, SameWorkerIdWithoutTheJoinsNonce_DoesNotTakeTheRank) {
  Membership m(4, 2);
  JoinAllReporting(m, 3);
  ASSERT_TRUE(m.Die({1}, "rank 1 heartbeat timeout", kT0).ok());
  ASSERT_EQ(m.Join("new", "h", std::nullopt, kT0, "j", "", "", "nonce-1")->rank, 1);
  for (const std::string& nonce : {std::string(), std::string("nonce-2")}) {
    absl::StatusOr<Membership::JoinResult> other =
        m.Join("new", "h", 1, kT0, "j", "", "", nonce);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << other.status();
    absl::StatusOr<Membership::JoinResult> any =
        m.Join("new", "h", std::nullopt, kT0, "j", "", "", nonce);
    EXPECT_FALSE(any.ok() && any->rank == 1) << "rank 1 taken with nonce \"" << nonce << "\"";
  }
}

TEST(ElasticAdmissionTest, MemberNotReportedYet_UnavailableUntilItReports) {
  Membership m(3, 1);
  for (int32_t r = 0; r < 3; ++r) ASSERT_TRUE(m.Join("w" + std::to_string(r), "h", r, kT0, "j").ok());
  m.Heartbeat(0, 1, 50, kT0);
  ASSERT_TRUE(m.Die({2}, "rank 2 heartbeat timeout", kT0).ok());
  absl::StatusOr<Membership::JoinResult> j = m.Join("new", "h", std::nullopt, kT0, "j");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(j.status().message(), HasSubstr("rank 1 has not reported its step"));
  EXPECT_EQ(m.generation(), 2);
  m.Heartbeat(1, 1, 48, kT0);
  j = m.Join("new", "h", std::nullopt, kT0, "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->change.admission_step, 52);
}

TEST(ElasticAdmissionTest, MarginAddsOneSecondOfProgress_Capped) {
  Membership m(4, 2);
  JoinAllReporting(m, 0);
  // 300 steps in 1.5 s: 200 steps/s, measured on reports at least a second apart.
  for (int32_t r = 0; r < 4; ++r) m.Heartbeat(r, 1, 100, kT0 + absl::Milliseconds(500));
  for (int32_t r = 0; r < 4; ++r) m.Heartbeat(r, 1, 300, kT0 + absl::Milliseconds(1500));
  EXPECT_DOUBLE_EQ(m.steps_per_second(), 200);
  ASSERT_TRUE(m.Die({3}, "rank 3 heartbeat timeout", kT0 + absl::Seconds(2)).ok());
  absl::StatusOr<Membership::JoinResult> j =
      m.Join("new", "h", std::nullopt, kT0 + absl::Seconds(2), "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->change.admission_margin, 202);
  EXPECT_EQ(j->change.admission_step, 502);

  // A job advancing 10 million steps a second gets the largest margin.
  Membership fast(2, 1);
  JoinAllReporting(fast, 0);
  fast.Heartbeat(0, 1, 10'000'000, kT0 + absl::Seconds(1));
  ASSERT_TRUE(fast.Die({1}, "rank 1 heartbeat timeout", kT0 + absl::Seconds(1)).ok());
  j = fast.Join("new", "h", std::nullopt, kT0 + absl::Seconds(1), "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->change.admission_margin, kMaxAdmissionMargin);
  EXPECT_EQ(j->change.admission_step, 10'000'000 + kMaxAdmissionMargin);
}

TEST(ElasticAdmissionTest, ReportedStepNearInt64Max_FailedPreconditionNoOverflow) {
  Membership m(2, 1);
  JoinAllReporting(m, std::numeric_limits<int64_t>::max() - 1);
  ASSERT_TRUE(m.Die({1}, "rank 1 heartbeat timeout", kT0).ok());
  absl::StatusOr<Membership::JoinResult> j = m.Join("new", "h", std::nullopt, kT0, "j");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(j.status().message(), HasSubstr("too large"));
  EXPECT_EQ(m.generation(), 2);
}

TEST(ElasticAdmissionTest, NewcomerDyingBeforeItsStep_ShrunkOutLikeAnyone) {
  Membership m(4, 2);
  JoinAllReporting(m, 3);
  ASSERT_TRUE(m.Die({3}, "rank 3 heartbeat timeout", kT0).ok());
  const absl::Time joined = kT0 + absl::Seconds(10);
  for (int32_t r = 0; r < 3; ++r) m.Heartbeat(r, 2, 4, joined);
  ASSERT_TRUE(m.Join("new", "h", std::nullopt, joined, "j").ok());
  ASSERT_EQ(m.generation(), 3);
  // Its timeout counts from its Join; the others keep beating.
  for (int32_t r = 0; r < 3; ++r) m.Heartbeat(r, 3, 5, joined + absl::Seconds(2));
  EXPECT_THAT(m.Stale(joined + absl::Seconds(2), absl::Seconds(3)), IsEmpty());
  EXPECT_THAT(m.Stale(joined + absl::Seconds(4), absl::Seconds(3)), ElementsAre(3));
  const MembershipChange c =
      m.Die({3}, "rank 3 heartbeat timeout", joined + absl::Seconds(4)).value();
  EXPECT_TRUE(c.shrunk);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(3));
  EXPECT_TRUE(m.DecisionMembers()->from_step[3] == kNotMember);
}

TEST(ElasticAdmissionTest, FallBackToPending_RejoinedWorldStartsOverFromTheStart) {
  Membership m(3, 2);
  JoinAllReporting(m, 3);
  ASSERT_TRUE(m.Die({2}, "rank 2 heartbeat timeout", kT0).ok());
  ASSERT_TRUE(m.Join("new", "h", std::nullopt, kT0, "j").ok());
  ASSERT_EQ(m.member(2).admitted_step, 5);
  // Two die: below min_world_size, PENDING; the world re-forms and nobody is a replacement.
  ASSERT_TRUE(m.Die({0, 1}, "ranks 0, 1 heartbeat timeout", kT0).ok());
  ASSERT_EQ(m.state(), v1::PENDING);
  for (int32_t r = 0; r < 3; ++r) ASSERT_TRUE(m.Join("v" + std::to_string(r), "h", r, kT0, "j").ok());
  ASSERT_EQ(m.state(), v1::RUNNING);
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(m.member(r).admitted_step, -1) << r;
  EXPECT_TRUE(m.DecisionMembers()->all_from_start);
}

TEST(ElasticAdmissionTest, DecisionMembers_FromStepPerRank_CachedUntilAChange) {
  Membership m(4, 2);
  JoinAllReporting(m, 3);
  std::shared_ptr<const MemberSteps> start = m.DecisionMembers();
  EXPECT_TRUE(start->all_from_start);
  EXPECT_EQ(m.DecisionMembers(), start);  // the same view while nothing changes
  m.Heartbeat(0, 1, 4, kT0);
  EXPECT_EQ(m.DecisionMembers(), start);
  ASSERT_TRUE(m.Die({2}, "rank 2 heartbeat timeout", kT0).ok());
  std::shared_ptr<const MemberSteps> shrunk = m.DecisionMembers();
  EXPECT_FALSE(shrunk->all_from_start);
  EXPECT_THAT(shrunk->from_step, ElementsAre(-1, -1, kNotMember, -1));
  ASSERT_TRUE(m.Join("new", "h", std::nullopt, kT0, "j").ok());
  EXPECT_THAT(m.DecisionMembers()->from_step, ElementsAre(-1, -1, 6, -1));
}

// --- The admission step against a hierarchical schedule.

Schedule Hierarchical(int32_t world, std::vector<ScheduleLevel> levels, int64_t warmup = 0,
                      AveragingMode mode = AveragingMode::kHierarchical) {
  ScheduleSpec spec;
  spec.world_size = world;
  spec.warmup_steps = warmup;
  spec.mode = mode;
  spec.levels = std::move(levels);
  absl::StatusOr<Schedule> s = Schedule::Create(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(FindAdmissionStepTest, SkipsStepsWhoseBlockHasNoAdmittedLiveMember) {
  // Pairs every 2 steps, the world every 8.
  const Schedule s = Hierarchical(4, {{2, 2}, {8, 4}});
  // Rank 3's partner (rank 2) is alive: the next pair step after the floor.
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, -1, kNotMember}, 3, "j"), 4);
  // Its partner is vacant: steps 4 and 6 average pairs, rank 3's pair has nobody; step 8
  // averages the world.
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, kNotMember, kNotMember}, 3, "j"), 8);
  // Its partner is itself a replacement admitted at 4: at 4 it receives too, so not yet; at 6
  // it is a full member.
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, 4, kNotMember}, 3, "j"), 6);
  // Floor on an averaging step: that step.
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, -1, kNotMember}, 8, "j"), 8);
  // An admission step is never 0.
  EXPECT_EQ(*FindAdmissionStep(s, 1, {-1, kNotMember, -1, -1}, -5, "j"), 2);
  // Rank 3's own entry (its previous holder) is ignored.
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, kNotMember, -1}, 3, "j"), 8);
}

TEST(FindAdmissionStepTest, DelayedSyncPending_StepsInsideItsWindowSkipped) {
  // Pairs every 2 steps; the world's outer level in 2 fragments (a sync every 4 steps) whose
  // all-reduce started at s is applied at s + 3: steps s + 1 and s + 2 are inside it.
  ScheduleLevel world{8, 4};
  world.outer = OuterSgd{0.7, 0.9, false};
  world.fragments = 2;
  world.sync_delay = 3;
  const Schedule s = Hierarchical(4, {{2, 2}, world});
  for (int64_t step : {1, 2, 5, 6, 9, 10}) EXPECT_TRUE(InsideDelayedSync(s, step)) << step;
  for (int64_t step : {0, 3, 4, 7, 8, 11}) EXPECT_FALSE(InsideDelayedSync(s, step)) << step;
  const std::vector<int64_t> partner_alive = {-1, -1, -1, kNotMember};
  // Pair step 2 is inside the sync of step 0: the world's sync step 4 (the admission round
  // runs blocking there), or, from floor 5, step 8 (6 is inside the sync of 4).
  EXPECT_EQ(*FindAdmissionStep(s, 3, partner_alive, 1, "j"), 4);
  EXPECT_EQ(*FindAdmissionStep(s, 3, partner_alive, 5, "j"), 8);
  // The apply step itself (s + 3 = 7) is not inside: the sync is applied first.
  ScheduleLevel late = world;
  late.sync_delay = 1;
  const Schedule t = Hierarchical(4, {{2, 2}, late});
  EXPECT_EQ(*FindAdmissionStep(t, 3, partner_alive, 5, "j"), 6);
}

TEST(FindAdmissionStepTest, WarmupAndPeriodicPhase) {
  const Schedule s = Hierarchical(2, {{10, 2}}, /*warmup=*/95, AveragingMode::kPeriodic);
  EXPECT_EQ(*FindAdmissionStep(s, 1, {-1, kNotMember}, 3, "j"), 95);
  EXPECT_EQ(*FindAdmissionStep(s, 1, {-1, kNotMember}, 96, "j"), 105);
}

TEST(FindAdmissionStepTest, NoPeerOrTooFar_FailedPrecondition) {
  const Schedule s = Hierarchical(4, {{1, 2}, {2'000'000, 4}});
  absl::StatusOr<int64_t> none = FindAdmissionStep(s, 3, {kNotMember, kNotMember, kNotMember,
                                                          kNotMember}, 1, "j");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("no live member"));
  // Only the world level (every 2,000,000 steps) has a peer: beyond the scan.
  absl::StatusOr<int64_t> far = FindAdmissionStep(s, 3, {-1, -1, kNotMember, kNotMember}, 1, "j");
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(far.status().message(), HasSubstr("no averaging step"));
  EXPECT_EQ(*FindAdmissionStep(s, 3, {-1, -1, kNotMember, kNotMember}, 1'500'000, "j"),
            2'000'000);
}

TEST(ElasticSpecTest, MinWorldSizeOutOfRange_InvalidArgument) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(job_id: "e" world_size: 4 mode: PERIODIC levels { period: 1 group_size: 4 })pb",
      &spec));
  for (int v : {0, 1, 4}) {
    spec.set_min_world_size(v);
    EXPECT_TRUE(ScheduleSpecFromProto(spec).ok()) << v;
  }
  for (int v : {-1, 5}) {
    spec.set_min_world_size(v);
    absl::StatusOr<ScheduleSpec> s = ScheduleSpecFromProto(spec);
    ASSERT_FALSE(s.ok()) << v;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("min_world_size"));
  }
}

// Through the Job: the decisions and GetJob of a shrunk job.
class ElasticJobTest : public ::testing::Test {
 protected:
  ElasticJobTest() { registry_ = NewRegistry(); }

  // A coordinator core on store_ (a second one continues from what the first stored).
  std::unique_ptr<JobRegistry> NewRegistry() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    options.store = &store_;
    return std::make_unique<JobRegistry>(options);
  }

  absl::StatusOr<v1::JoinResponse> JoinAs(Job& job, const std::string& worker,
                                          std::optional<int> rank = std::nullopt,
                                          const std::string& nonce = "") {
    v1::JoinRequest request;
    request.set_job_id("e");
    request.set_worker_id(worker);
    request.set_join_nonce(nonce);
    if (rank.has_value()) request.set_rank(*rank);
    std::optional<absl::StatusOr<v1::JoinResponse>> result;
    job.Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
             [&](absl::StatusOr<v1::JoinResponse> r) { result = std::move(r); });
    if (!result.has_value()) return absl::InternalError("the Join was not answered at once");
    if (result->ok()) credentials_[(*result)->rank()] = (*result)->credential();
    return *std::move(result);
  }

  absl::Status Beat(Job& job, int rank, int64_t generation, int64_t step) {
    v1::HeartbeatRequest hb;
    hb.set_job_id("e");
    hb.set_rank(rank);
    hb.set_generation(generation);
    hb.set_step(step);
    hb.set_credential(credentials_[rank]);
    v1::HeartbeatResponse reply;
    return job.Heartbeat(hb, &reply);
  }

  // Decisions for steps [from, from + count): of `rank`, or of every subgroup.
  std::vector<v1::StepDecision> Window(Job& job, int64_t from, int64_t count,
                                       std::optional<int> rank) {
    v1::GetScheduleRequest req;
    req.set_job_id("e");
    req.set_from_step(from);
    req.set_count(count);
    if (rank.has_value()) req.set_rank(*rank);
    v1::GetScheduleResponse resp;
    EXPECT_TRUE(job.GetSchedule(req, &resp).ok());
    return {resp.decisions().begin(), resp.decisions().end()};
  }

  v1::StepDecision StepOf(Job& job, int rank, int64_t generation, int64_t step) {
    v1::StepRequest req;
    req.set_job_id("e");
    req.set_rank(rank);
    req.set_generation(generation);
    req.set_step(step);
    v1::StepDecision d;
    EXPECT_TRUE(job.Step(req, &d).ok());
    return d;
  }

  // Job "e" of `spec_text`, every rank joined (running). By default world 4: levels (period 1,
  // groups of 2), (period 2, the world); min_world_size 1.
  std::shared_ptr<Job> MakeRunningJob(
      const std::string& spec_text =
          R"pb(job_id: "e" world_size: 4 mode: HIERARCHICAL min_world_size: 1
               levels { period: 1 group_size: 2 } levels { period: 2 group_size: 4 })pb") {
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(spec_text, &spec));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry_->Find("e");
    for (int r = 0; r < spec.world_size(); ++r) {
      v1::JoinRequest request;
      request.set_job_id("e");
      request.set_worker_id(absl::StrCat("w", r));
      request.set_rank(r);
      job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                [this](absl::StatusOr<v1::JoinResponse> r) {
                  if (r.ok()) credentials_[r->rank()] = r->credential();
                });
    }
    return job;
  }

  // Every rank but `dead` heartbeats; then the clock passes the heartbeat timeout.
  void Kill(Job& job, std::vector<int> dead, int64_t generation) {
    clock_.Advance(absl::Seconds(2));
    for (int r = 0; r < 4; ++r) {
      if (std::find(dead.begin(), dead.end(), r) != dead.end()) continue;
      v1::HeartbeatRequest hb;
      hb.set_job_id("e");
      hb.set_rank(r);
      hb.set_generation(generation);
      hb.set_step(3);
      hb.set_credential(credentials_[r]);
      v1::HeartbeatResponse reply;
      if (job.Heartbeat(hb, &reply).ok() && reply.generation() == generation) continue;
    }
    clock_.Advance(absl::Seconds(2));
    job.CheckStaleness();
  }

  FakeClock clock_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
  // rank -> its member's credential (JoinResponse.credential).
  std::map<int, std::string> credentials_;
};

TEST_F(ElasticJobTest, DeadRank_DecisionsListLiveMembers_EmptyBlockDoesNotAverage) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Kill(*job, {3}, 1);
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.state(), v1::RUNNING);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.live_world_size(), 3);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(3));
  EXPECT_THAT(state.last_change().reason(), HasSubstr("rank 3"));

  v1::GetScheduleRequest req;
  req.set_job_id("e");
  req.set_from_step(1);
  req.set_count(2);  // step 1: level 0 (pairs); step 2: level 1 (the world)
  req.set_rank(2);
  v1::GetScheduleResponse resp;
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  ASSERT_EQ(resp.decisions_size(), 2);
  EXPECT_THAT(resp.decisions(0).ranks(), ElementsAre(2, 3));
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(2));
  EXPECT_THAT(resp.decisions(1).members(), ElementsAre(0, 1, 2));
  EXPECT_EQ(resp.decisions(1).generation(), 2);

  // Both ranks of block 1 gone: listed for every subgroup, block 1 no longer averages.
  Kill(*job, {2, 3}, 2);
  state.Clear();
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 3);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(2, 3));
  req.clear_rank();
  req.set_count(1);
  resp.Clear();
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  ASSERT_EQ(resp.decisions_size(), 1);
  EXPECT_EQ(resp.decisions(0).subgroup(), 0);
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(0, 1));
}


// A member that reported step 2^62 made every later replacement's Join fail "too large" (and at
// 10^15 the admission landed at 10^15 + 8). A step the job's pace cannot have reached is now
// refused, saying why, and recorded nowhere: the admission lands after the real steps.
TEST_F(ElasticJobTest, ImplausibleStep_RefusedAndAdmissionsUnaffected) {
  std::shared_ptr<Job> job = MakeRunningJob();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(Beat(*job, r, 1, 3).ok());
  for (int64_t step : {int64_t{1} << 62, int64_t{1'000'000'000'000'000}}) {
    const absl::Status s = Beat(*job, 1, 1, step);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << step;
    EXPECT_THAT(std::string(s.message()), HasSubstr("which the job's pace cannot have reached"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("at most step 3"));
  }
  // A leap within the bound is a step like any other.
  EXPECT_TRUE(Beat(*job, 2, 1, 3 + 1000).ok());
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.max_step(), 1003);
  Kill(*job, {3}, 1);
  absl::StatusOr<v1::JoinResponse> joined = JoinAs(*job, "new");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_LT(joined->admission_step(), 2000);
}

// A replacement's rank was taken by a Join carrying its worker id, read from WatchJob's
// MEMBER_ADMITTED 2 ms after the admission and sent before the replacement's first beat: the
// thief got the rank and a fresh credential (enough for GetCommId), and the real replacement
// was told "the coordinator no longer counts this worker as rank 3". Now the rank is bound to
// the Join that won it: the thief is refused naming the holder, and the replacement keeps its
// rank and its credential.
TEST_F(ElasticJobTest, Replacement_WorkerIdReadFromWatchJob_RankNotTakenByASecondJoin) {
  std::shared_ptr<Job> job = MakeRunningJob();
  auto watcher = std::make_shared<RecordedEvents>();
  job->Watch(watcher);
  Kill(*job, {3}, 1);
  absl::StatusOr<v1::JoinResponse> joined =
      JoinAs(*job, "replacement-host:4242", std::nullopt, "5f1d0c2a9b7e4c3d8a6f0e1b2c3d4e5f");
  ASSERT_TRUE(joined.ok()) << joined.status();
  ASSERT_EQ(joined->rank(), 3);
  const std::string credential = joined->credential();
  // What any token holder sees: the admission's event names the worker.
  std::string worker;
  for (const v1::JobEvent& e : watcher->events()) {
    if (e.kind() != v1::JobEvent::MEMBER_ADMITTED) continue;
    const size_t open = e.message().find('"');
    const size_t close = e.message().find('"', open + 1);
    if (open != std::string::npos && close != std::string::npos) {
      worker = e.message().substr(open + 1, close - open - 1);
    }
  }
  ASSERT_EQ(worker, "replacement-host:4242");
  for (std::optional<int> rank : {std::optional<int>(3), std::optional<int>()}) {
    absl::StatusOr<v1::JoinResponse> thief = JoinAs(*job, worker, rank, "guessed");
    EXPECT_FALSE(thief.ok() && thief->rank() == 3)
        << "the thief took rank 3 (rank " << (rank ? "asked" : "not asked") << ")";
    if (rank.has_value()) {
      EXPECT_EQ(thief.status().code(), absl::StatusCode::kAlreadyExists) << thief.status();
      EXPECT_THAT(std::string(thief.status().message()), HasSubstr("replacement-host:4242"));
    }
  }
  // The replacement is still rank 3, with its credential.
  credentials_[3] = credential;
  EXPECT_TRUE(Beat(*job, 3, joined->generation(), 5).ok());
  v1::Job state;
  job->ToProto(&state);
  EXPECT_THAT(state.vacant_ranks(), ::testing::IsEmpty());
}

// World 4: pairs every step, the world every 2 steps. Rank 3 dies at step 3 and a replacement
// takes its rank: admitted at step 5 (largest step reported 3 + margin 2), a pair step whose
// block has rank 2.
TEST_F(ElasticJobTest, Replacement_AnsweredAtOnce_DecisionsBeforeAtAndAfterItsStep) {
  std::shared_ptr<Job> job = MakeRunningJob();
  auto watcher = std::make_shared<RecordedEvents>();
  job->Watch(watcher);
  Kill(*job, {3}, 1);
  absl::StatusOr<v1::JoinResponse> joined = JoinAs(*job, "new");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 3);
  EXPECT_EQ(joined->generation(), 3);
  EXPECT_EQ(joined->admission_step(), 5);
  EXPECT_FALSE(joined->credential().empty());
  ASSERT_EQ(joined->subgroups_size(), 2);
  EXPECT_THAT(joined->subgroups(0).ranks(), ElementsAre(2, 3));

  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.state(), v1::RUNNING);
  EXPECT_EQ(state.generation(), 3);
  EXPECT_EQ(state.live_world_size(), 4);
  EXPECT_THAT(state.vacant_ranks(), IsEmpty());
  EXPECT_EQ(state.deaths(), 1);
  EXPECT_EQ(state.admissions(), 1);
  ASSERT_EQ(state.members_size(), 4);
  EXPECT_EQ(state.members(3).admitted_step(), 5);
  EXPECT_EQ(state.members(3).worker_id(), "new");
  for (int r = 0; r < 3; ++r) EXPECT_EQ(state.members(r).admitted_step(), -1) << r;
  EXPECT_THAT(state.last_change().reason(), HasSubstr("rank 3 was admitted at step 5"));
  EXPECT_EQ(state.last_change().rank(), 3);

  // Step: rank 2's pair at 3 (before): alone; at 5: both, rank 3 joining; at 7: both.
  for (int rank : {2, 3}) {
    v1::StepDecision d = StepOf(*job, rank, 3, 3);
    EXPECT_THAT(d.members(), ElementsAre(2)) << rank;
    EXPECT_THAT(d.joining(), IsEmpty());
    d = StepOf(*job, rank, 3, 5);
    EXPECT_THAT(d.members(), ElementsAre(2, 3)) << rank;
    EXPECT_THAT(d.joining(), ElementsAre(3)) << rank;
    d = StepOf(*job, rank, 3, 7);
    EXPECT_THAT(d.members(), ElementsAre(2, 3)) << rank;
    EXPECT_THAT(d.joining(), IsEmpty());
  }
  // GetSchedule of rank 3, steps 4..6: the world without it, its pair with it joining, the
  // whole world.
  std::vector<v1::StepDecision> w = Window(*job, 4, 3, 3);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_THAT(w[0].ranks(), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(w[0].members(), ElementsAre(0, 1, 2));
  EXPECT_THAT(w[1].members(), ElementsAre(2, 3));
  EXPECT_THAT(w[1].joining(), ElementsAre(3));
  EXPECT_THAT(w[2].members(), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(w[2].joining(), IsEmpty());
  // Every subgroup: the same, block 0 never has anyone joining.
  w = Window(*job, 4, 3, std::nullopt);
  ASSERT_EQ(w.size(), 4u);
  EXPECT_THAT(w[0].members(), ElementsAre(0, 1, 2));
  EXPECT_EQ(w[1].step(), 5);
  EXPECT_THAT(w[1].members(), ElementsAre(0, 1));
  EXPECT_THAT(w[1].joining(), IsEmpty());
  EXPECT_EQ(w[2].step(), 5);
  EXPECT_THAT(w[2].members(), ElementsAre(2, 3));
  EXPECT_THAT(w[2].joining(), ElementsAre(3));
  EXPECT_THAT(w[3].members(), ElementsAre(0, 1, 2, 3));
  for (const v1::StepDecision& d : w) EXPECT_EQ(d.generation(), 3);

  // Watchers see MEMBER_ADMITTED (the rank, the step, the worker), then GENERATION_CHANGED.
  std::vector<v1::JobEvent> events = watcher->events();
  std::vector<std::pair<v1::JobEvent::Kind, int>> kinds;
  for (const v1::JobEvent& e : events) kinds.emplace_back(e.kind(), e.rank());
  EXPECT_THAT(kinds, ElementsAre(Pair(v1::JobEvent::SNAPSHOT, -1),
                                 Pair(v1::JobEvent::GENERATION_CHANGED, 3),
                                 Pair(v1::JobEvent::MEMBER_ADMITTED, 3),
                                 Pair(v1::JobEvent::GENERATION_CHANGED, 3)));
  ASSERT_EQ(events.size(), 4u);
  EXPECT_THAT(events[2].message(), HasSubstr("at step 5"));
  EXPECT_THAT(events[2].message(), HasSubstr("\"new\""));
  EXPECT_EQ(events[2].job().members(3).admitted_step(), 5);
  EXPECT_EQ(events[3].job().generation(), 3);

  // Its heartbeats count from its own generation on.
  EXPECT_TRUE(Beat(*job, 3, 3, 5).ok());
  // The stale generation is refused for Step as for anyone.
  v1::StepRequest stale;
  stale.set_job_id("e");
  stale.set_rank(0);
  stale.set_generation(2);
  stale.set_step(4);
  v1::StepDecision d;
  EXPECT_EQ(job->Step(stale, &d).code(), absl::StatusCode::kFailedPrecondition);
}

// Ranks 2 and 3 (a whole pair) die: a replacement for 2 has no partner, so it is admitted at
// the next world step; its decisions before that leave block 1 out entirely.
TEST_F(ElasticJobTest, Replacement_WholeBlockDead_AdmittedAtAWorldStep) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Kill(*job, {2, 3}, 1);
  absl::StatusOr<v1::JoinResponse> joined = JoinAs(*job, "new", 2);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 2);
  EXPECT_EQ(joined->admission_step(), 6);  // floor 5 is a pair step without a partner
  std::vector<v1::StepDecision> w = Window(*job, 5, 3, std::nullopt);
  // Step 5: only block 0 averages; 6: the world, rank 2 joining; 7: pairs, block 1 is rank 2.
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].step(), 5);
  EXPECT_THAT(w[0].members(), ElementsAre(0, 1));
  EXPECT_EQ(w[1].step(), 6);
  EXPECT_THAT(w[1].members(), ElementsAre(0, 1, 2));
  EXPECT_THAT(w[1].joining(), ElementsAre(2));
  EXPECT_EQ(w[2].step(), 7);
  EXPECT_THAT(w[2].members(), ElementsAre(0, 1));
  EXPECT_EQ(w[3].step(), 7);
  EXPECT_THAT(w[3].members(), ElementsAre(2));
  // The last vacancy: rank 3, partnered by rank 2 only from step 7 on (6 is its own admission),
  // and floor = 6 (rank 2 has not reported: its admission step) + 2 = 8, a world step.
  joined = JoinAs(*job, "newer");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 3);
  EXPECT_EQ(joined->admission_step(), 8);
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.admissions(), 2);
  EXPECT_EQ(state.deaths(), 2);
  EXPECT_EQ(state.live_world_size(), 4);
  // A job with every rank alive is full.
  absl::StatusOr<v1::JoinResponse> full = JoinAs(*job, "one-more");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kFailedPrecondition);
}

// A worker killed and restarted at once reaches the coordinator before its old self is declared
// dead: while the old member's stream is broken the Join is UNAVAILABLE (retried by the client),
// not "full"; once it is dead the rank admits the replacement.
TEST(ElasticAdmissionTest, FullWhileAMembersStreamIsBroken_UnavailableThenAdmitted) {
  Membership m(4, 2);
  JoinAllReporting(m, 10);
  const int64_t generation = m.generation();
  absl::StatusOr<Membership::JoinResult> j = m.Join("new", "h", std::nullopt, kT0, "j");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(j.status().message(), HasSubstr("is full"));
  m.StreamLost(2, kT0 + absl::Milliseconds(100));
  j = m.Join("new", "h", std::nullopt, kT0 + absl::Milliseconds(200), "j");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(j.status().message(), HasSubstr("rank 2's heartbeat stream broke"));
  EXPECT_EQ(m.generation(), generation);
  // It beats again: full once more.
  m.Heartbeat(2, generation, 11, kT0 + absl::Milliseconds(300));
  j = m.Join("new", "h", std::nullopt, kT0 + absl::Milliseconds(400), "j");
  EXPECT_EQ(j.status().code(), absl::StatusCode::kFailedPrecondition);
  // Broken again and declared dead: the replacement takes rank 2.
  m.StreamLost(2, kT0 + absl::Milliseconds(500));
  ASSERT_TRUE(m.Die({2}, "rank 2 connection lost", kT0 + absl::Seconds(2)).ok());
  j = m.Join("new", "h", std::nullopt, kT0 + absl::Seconds(2), "j");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->rank, 2);
}

TEST_F(ElasticJobTest, Restart_KeepsAdmissionsAndDecisions) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Kill(*job, {3}, 1);
  ASSERT_TRUE(JoinAs(*job, "new").ok());
  const std::vector<v1::StepDecision> before = Window(*job, 0, 12, std::nullopt);
  job.reset();
  registry_->Stop();
  registry_ = NewRegistry();
  ASSERT_EQ(*registry_->LoadFromStore(absl::Seconds(5)), 1);
  job = *registry_->Find("e");
  const std::vector<v1::StepDecision> after = Window(*job, 0, 12, std::nullopt);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].SerializeAsString(), before[i].SerializeAsString()) << i;
  }
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 3);
  EXPECT_EQ(state.members(3).admitted_step(), 5);
  EXPECT_EQ(state.members(0).admitted_step(), -1);
  // After the restart no step is known yet: an admission waits for the members' reports, and
  // for their pace (a second of them, kRateSampleInterval).
  clock_.Advance(absl::Seconds(1));
  Kill(*job, {1}, 3);  // ranks 0, 2, 3 report step 3 (rank 3 re-attaches with its credential)
  absl::StatusOr<v1::JoinResponse> early = JoinAs(*job, "third");
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable) << early.status();
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("pace"));
  job->ToProto(&state);
  for (int r : {0, 2, 3}) ASSERT_TRUE(Beat(*job, r, state.generation(), 3).ok()) << r;
  absl::StatusOr<v1::JoinResponse> joined = JoinAs(*job, "third");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 1);
  EXPECT_EQ(joined->admission_step(), 5);
}

// A HeartbeatStream that breaks without a clean end (the worker's process died): the member of
// an elastic job is declared dead once half the heartbeat timeout (3 s here) has passed without
// a beat, with the reason "connection lost"; a beat within that half clears it; a broken
// stream of another credential, or of a strict job's member, changes nothing.
TEST_F(ElasticJobTest, HeartbeatStreamLost_DeadAfterHalfTheTimeoutUnlessItBeats) {
  std::shared_ptr<Job> job = MakeRunningJob();
  // Every rank but `silent` beats, then the clock moves on by `ms`.
  const auto beat_then_wait = [&](int silent, int64_t ms) {
    for (int r = 0; r < 4; ++r) {
      if (r != silent) ASSERT_TRUE(Beat(*job, r, 1, 5).ok()) << r;
    }
    clock_.Advance(absl::Milliseconds(ms));
    job->CheckStaleness();
  };
  beat_then_wait(-1, 0);
  job->HeartbeatStreamLost(1, credentials_[1]);
  job->HeartbeatStreamLost(2, "not its credential");
  beat_then_wait(2, 1000);  // rank 1 re-opened its stream and beats: alive
  beat_then_wait(-1, 1000);
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 1) << state.DebugString();

  job->HeartbeatStreamLost(3, credentials_[3]);
  beat_then_wait(3, 1400);
  state.Clear();
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 1) << "dead before half the timeout";
  beat_then_wait(3, 200);
  state.Clear();
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(3));
  EXPECT_THAT(state.last_change().reason(), HasSubstr("rank 3 connection lost"));
}

TEST_F(ElasticJobTest, HeartbeatStreamLost_StrictJobWaitsTheWholeTimeout) {
  std::shared_ptr<Job> job = MakeRunningJob(
      R"pb(job_id: "e" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 })pb");
  job->HeartbeatStreamLost(1, credentials_[1]);
  clock_.Advance(absl::Milliseconds(2000));
  job->CheckStaleness();
  v1::Job state;
  job->ToProto(&state);
  EXPECT_EQ(state.generation(), 1);
  EXPECT_EQ(state.state(), v1::RUNNING);
}

TEST_F(ElasticJobTest, StrictJob_DecisionMembersEqualRanks) {
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(job_id: "e" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 })pb",
      &spec));
  ASSERT_TRUE(registry_->CreateJob(spec, nullptr).ok());
  std::shared_ptr<Job> job = *registry_->Find("e");
  v1::GetScheduleRequest req;
  req.set_job_id("e");
  req.set_from_step(0);
  req.set_count(1);
  v1::GetScheduleResponse resp;
  ASSERT_TRUE(job->GetSchedule(req, &resp).ok());
  EXPECT_THAT(resp.decisions(0).members(), ElementsAre(0, 1));
  v1::Job state;
  job->ToProto(&state);
  EXPECT_THAT(state.vacant_ranks(), IsEmpty());
}

}  // namespace
}  // namespace modelavg::server
