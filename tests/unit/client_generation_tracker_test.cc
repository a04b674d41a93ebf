// GenerationTracker on its own: what the heartbeat and the coordinator say, handed in as values,
// and the times as arguments. No coordinator, no threads, no sleeps.
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/base/error_kind.h"
#include "client/session/generation_tracker.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int32_t kWorld = 4;
const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

GenerationTracker::Options Opts(bool elastic, int32_t rank = 0) {
  GenerationTracker::Options o;
  o.job_id = "job";
  o.coordinator = "coord:1";
  o.reader = ViewReader{rank, absl::StrCat("w", rank), kWorld, absl::Seconds(3)};
  o.elastic = elastic;
  return o;
}

// A RUNNING job at `generation` whose member r is in `states[r]` (-1 leaves the rank out of the
// list). Its ALIVE members are members of `generation` (an elastic job carries its live members
// into each new generation), or, with `alive_in` > 0, of that one (a strict job's stay in the
// one they joined).
v1::Job JobAt(int64_t generation, const std::vector<int>& states,
              const std::vector<int64_t>& admitted = {}, int64_t alive_in = 0) {
  v1::Job job;
  job.set_generation(generation);
  job.set_state(v1::RUNNING);
  job.mutable_spec()->set_min_world_size(2);
  for (int32_t r = 0; r < static_cast<int32_t>(states.size()); ++r) {
    if (states[r] < 0) continue;
    v1::Member* m = job.add_members();
    m->set_rank(r);
    m->set_worker_id(absl::StrCat("w", r));
    m->set_state(static_cast<v1::MemberState>(states[r]));
    m->set_generation(states[r] == v1::ALIVE ? (alive_in > 0 ? alive_in : generation) : 1);
    if (r < static_cast<int32_t>(admitted.size()) && admitted[r] > 0) {
      m->set_admitted_step(admitted[r]);
    }
  }
  return job;
}

// A heartbeat reply at `generation` in `state` from a coordinator of `incarnation`.
v1::HeartbeatResponse Reply(int64_t generation, v1::JobState state, std::string incarnation,
                            int64_t recovery_grace_ms = 0) {
  v1::HeartbeatResponse reply;
  reply.set_generation(generation);
  reply.set_state(state);
  reply.set_coordinator_incarnation(std::move(incarnation));
  reply.set_recovery_grace_ms(recovery_grace_ms);
  return reply;
}

Decision AverageAt(int64_t step, SubgroupRange group) {
  Decision d;
  d.step = step;
  d.average = true;
  d.subgroup = group;
  return d;
}

TEST(GenerationTrackerTest, New_AtTheJoinedGeneration_Usable) {
  GenerationTracker t(Opts(false), 1, "inc-a");
  EXPECT_EQ(t.generation(), 1);
  EXPECT_EQ(t.latest_generation(), 1);
  EXPECT_TRUE(t.CheckUsable().ok());
  EXPECT_TRUE(t.CheckCanAverage(SubgroupRange{0, 0, kWorld}).ok());
  EXPECT_FALSE(t.left());
  EXPECT_EQ(t.Decide(AverageAt(5, {0, 0, kWorld}), 5).generation, 1);
}

TEST(GenerationTrackerTest, IsNews_OnlyAGenerationNeitherAveragedInNorSeen) {
  GenerationTracker t(Opts(false), 1, "");
  EXPECT_FALSE(t.IsNews(1, 1));
  EXPECT_FALSE(t.IsNews(2, 2));
  EXPECT_TRUE(t.IsNews(2, 1));
}

TEST(GenerationTrackerTest, ChangeReason_NamesTheRankOnce) {
  v1::HeartbeatResponse reply;
  EXPECT_EQ(GenerationTracker::ChangeReason(reply), "membership changed");
  reply.mutable_last_change()->set_reason("died");
  reply.mutable_last_change()->set_rank(2);
  EXPECT_EQ(GenerationTracker::ChangeReason(reply), "died (rank 2)");
  reply.mutable_last_change()->set_reason("rank 2 left");
  EXPECT_EQ(GenerationTracker::ChangeReason(reply), "rank 2 left");
}

TEST(GenerationTrackerTest, OnGenerationChange_StrictOrderlyDeparture_OnlyItsGroupsStop) {
  GenerationTracker t(Opts(false), 1, "");
  const GenerationTracker::Abort abort = t.OnGenerationChange(
      2, "rank 3 left", /*blamed_rank=*/3,
      JobAt(2, {v1::ALIVE, v1::ALIVE, v1::ALIVE, v1::LEFT}, {}, /*alive_in=*/1));
  EXPECT_FALSE(abort.needed());
  EXPECT_EQ(t.generation(), 1);
  EXPECT_EQ(t.latest_generation(), 2);
  EXPECT_TRUE(t.broken().ok());
  EXPECT_TRUE(t.CheckCanAverage(SubgroupRange{0, 0, 2}).ok());
  const absl::Status all = t.CheckCanAverage(SubgroupRange{0, 0, kWorld});
  EXPECT_EQ(all.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(all.message()), HasSubstr("rank 3 left job job"));
  const absl::Status usable = t.CheckUsable();
  EXPECT_EQ(usable.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(usable.message()), HasSubstr("moved from generation 1 to 2"));
}

TEST(GenerationTrackerTest, OnGenerationChange_StrictDeath_BreaksAndAbortsTheOlderCollectives) {
  GenerationTracker t(Opts(false), 1, "");
  const GenerationTracker::Abort abort = t.OnGenerationChange(
      2, "rank 1 died", /*blamed_rank=*/1,
      JobAt(2, {v1::ALIVE, v1::DEAD, v1::ALIVE, v1::ALIVE}, {}, /*alive_in=*/1));
  ASSERT_TRUE(abort.needed());
  EXPECT_EQ(abort.before, 2);
  EXPECT_EQ(ErrorKindOf(abort.why), ErrorKind::kGenerationMoved);
  EXPECT_EQ(ErrorRankOf(abort.why), 1);
  EXPECT_EQ(t.broken(), abort.why);
  EXPECT_THAT(std::string(t.broken().message()), HasSubstr("because rank 1 died"));
  EXPECT_EQ(t.CheckCanAverage(SubgroupRange{0, 0, 1}), abort.why);
}

TEST(GenerationTrackerTest, OnGenerationChange_StrictReJoin_Breaks) {
  GenerationTracker t(Opts(false), 1, "");
  // Rank 2 is a member of generation 2: it re-joined, its communicators are new.
  v1::Job job = JobAt(2, {v1::ALIVE, v1::ALIVE, v1::ALIVE, v1::ALIVE}, {}, /*alive_in=*/1);
  job.mutable_members(2)->set_generation(2);
  EXPECT_TRUE(t.OnGenerationChange(2, "rank 2 re-joined", /*blamed_rank=*/2, job).needed());
  EXPECT_FALSE(t.broken().ok());
}

TEST(GenerationTrackerTest, OnGenerationChange_StrictJobUnreadable_Breaks) {
  GenerationTracker t(Opts(false), 1, "");
  const GenerationTracker::Abort abort = t.OnGenerationChange(2, "rank 3 left", /*blamed_rank=*/3,
                                                              absl::UnavailableError("no answer"));
  EXPECT_TRUE(abort.needed());
  EXPECT_EQ(t.broken().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(GenerationTrackerTest, OnGenerationChange_Broken_FirstReasonStandsNoSecondAbort) {
  GenerationTracker t(Opts(false), 1, "");
  t.OnGenerationChange(2, "rank 1 died", /*blamed_rank=*/1,
                       JobAt(2, {v1::ALIVE, v1::DEAD, v1::ALIVE, v1::ALIVE}));
  const absl::Status first = t.broken();
  const GenerationTracker::Abort again = t.OnGenerationChange(
      2, "rank 2 died", /*blamed_rank=*/2, JobAt(2, {v1::ALIVE, v1::DEAD, v1::DEAD, v1::ALIVE}));
  EXPECT_FALSE(again.needed());
  EXPECT_EQ(t.broken(), first);
}

TEST(GenerationTrackerTest, OnGenerationChange_ElasticLiveMember_FollowsUntilAdvance) {
  GenerationTracker t(Opts(true), 1, "");
  const GenerationTracker::Abort abort = t.OnGenerationChange(
      2, "rank 2 died", /*blamed_rank=*/2, JobAt(2, {v1::ALIVE, v1::ALIVE, v1::DEAD, v1::ALIVE}));
  ASSERT_TRUE(abort.needed());
  EXPECT_EQ(abort.before, 2);
  EXPECT_EQ(abort.why.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ErrorKindOf(abort.why), ErrorKind::kGenerationMoved);
  EXPECT_EQ(ErrorRankOf(abort.why), 2);
  // Followed, not moved to yet: the rank still averages in generation 1.
  EXPECT_EQ(t.generation(), 1);
  EXPECT_EQ(t.latest_generation(), 2);
  EXPECT_TRUE(t.broken().ok());
  EXPECT_TRUE(t.CheckCanAverage(SubgroupRange{0, 0, kWorld}).ok());
  EXPECT_TRUE(t.NewerThan(1));
  EXPECT_TRUE(t.WaitOver(1));
  EXPECT_FALSE(t.WaitOver(2));
  // The same change seen again aborts nothing more.
  EXPECT_FALSE(t.OnGenerationChange(2, "rank 2 died", /*blamed_rank=*/2,
                                    JobAt(2, {v1::ALIVE, v1::ALIVE, v1::DEAD, v1::ALIVE}))
                   .needed());
  absl::StatusOr<GenerationTracker::Move> move = t.Advance();
  ASSERT_TRUE(move.ok()) << move.status();
  EXPECT_EQ(move->from, 1);
  EXPECT_EQ(move->to, 2);
  EXPECT_EQ(t.generation(), 2);
  EXPECT_TRUE(t.CheckUsable().ok());
  // Generation 2's members average without the dead rank.
  const Decision d = t.Decide(AverageAt(7, {0, 0, kWorld}), 7);
  EXPECT_EQ(d.generation, 2);
  EXPECT_THAT(d.members, ElementsAre(0, 1, 3));
  EXPECT_TRUE(d.joining.empty());
  // Nothing more to move to.
  move = t.Advance();
  ASSERT_TRUE(move.ok());
  EXPECT_FALSE(move->moved());
}

TEST(GenerationTrackerTest, OnGenerationChange_ElasticRecordUnavailable_ConcludesNothingAsksAgain) {
  GenerationTracker t(Opts(true, /*rank=*/1), 1, "");
  // The coordinator answered the beat with generation 2 but cannot give the record now.
  const GenerationTracker::Abort abort =
      t.OnGenerationChange(2, "rank 2 died", /*blamed_rank=*/2,
                           absl::UnavailableError("the leader lost etcd"));
  EXPECT_FALSE(abort.needed());
  EXPECT_TRUE(t.broken().ok());
  EXPECT_TRUE(t.CheckCanAverage(SubgroupRange{0, 0, kWorld}).ok());
  // Nothing noted: the next reply of generation 2 is still news, and asks again.
  EXPECT_EQ(t.latest_generation(), 1);
  EXPECT_TRUE(t.IsNews(2, t.latest_generation()));
  const GenerationTracker::Abort later = t.OnGenerationChange(
      2, "rank 2 died", /*blamed_rank=*/2, JobAt(2, {v1::ALIVE, v1::ALIVE, v1::DEAD, v1::ALIVE}));
  ASSERT_TRUE(later.needed());
  EXPECT_EQ(later.before, 2);
  EXPECT_EQ(ErrorKindOf(later.why), ErrorKind::kGenerationMoved);
  EXPECT_TRUE(t.broken().ok());
  absl::StatusOr<GenerationTracker::Move> move = t.Advance();
  ASSERT_TRUE(move.ok()) << move.status();
  EXPECT_EQ(move->to, 2);
}

// Any other error reading the record of an elastic job breaks the client, as in a strict job.
TEST(GenerationTrackerTest, OnGenerationChange_ElasticRecordRefused_Breaks) {
  GenerationTracker t(Opts(true, /*rank=*/1), 1, "");
  EXPECT_TRUE(t.OnGenerationChange(2, "rank 2 died", /*blamed_rank=*/2,
                                   absl::NotFoundError("no job"))
                  .needed());
  EXPECT_FALSE(t.broken().ok());
}

TEST(GenerationTrackerTest, OnGenerationChange_ElasticRankDeclaredDead_Breaks) {
  GenerationTracker t(Opts(true, /*rank=*/1), 1, "");
  const GenerationTracker::Abort abort = t.OnGenerationChange(
      2, "rank 1 died", /*blamed_rank=*/1, JobAt(2, {v1::ALIVE, v1::DEAD, v1::ALIVE, v1::ALIVE}));
  ASSERT_TRUE(abort.needed());
  EXPECT_EQ(abort.why.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(t.broken().message()),
              HasSubstr("the coordinator declared this rank dead (no heartbeat within 3s)"));
  EXPECT_EQ(t.Advance().status(), t.broken());
  EXPECT_TRUE(t.WaitOver(5));
}

TEST(GenerationTrackerTest, Decide_ElasticReplacement_JoinsAtItsAdmissionStep) {
  GenerationTracker t(Opts(true, /*rank=*/3), 1, "");
  std::string why;
  std::optional<MembershipView> view = ViewOf(
      JobAt(3, {v1::ALIVE, v1::ALIVE, v1::ALIVE, v1::ALIVE}, {0, 0, 0, 10}), t.reader(), &why);
  ASSERT_TRUE(view.has_value()) << why;
  t.Admit(*std::move(view));
  EXPECT_EQ(t.generation(), 3);
  EXPECT_EQ(t.latest_generation(), 3);
  Decision before = t.Decide(AverageAt(8, {0, 0, kWorld}), 8);
  EXPECT_THAT(before.members, ElementsAre(0, 1, 2));
  Decision at = t.Decide(AverageAt(10, {0, 0, kWorld}), 10);
  EXPECT_THAT(at.members, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(at.joining, ElementsAre(3));
  Decision skip = AverageAt(10, {0, 0, kWorld});
  skip.average = false;
  EXPECT_TRUE(t.Decide(skip, 10).members.empty());
}

// Sharded replicas of 2 (ranks 0-1 and 2-3): the reader's view knows the replica size.
GenerationTracker::Options ShardedOpts(int32_t rank) {
  GenerationTracker::Options o = Opts(true, rank);
  o.reader.replica_size = 2;
  return o;
}

TEST(GenerationTrackerTest, OnGenerationChange_ReplicaRetiredByADeath_BreaksAsReplicaLost) {
  GenerationTracker t(ShardedOpts(/*rank=*/2), 1, "");
  // Rank 3 died: its replica mate, rank 2, was retired with it.
  v1::Job job = JobAt(2, {v1::ALIVE, v1::ALIVE, v1::RETIRED, v1::DEAD});
  job.mutable_spec()->set_job_id("job");
  job.mutable_members(2)->set_retired_by(3);
  const GenerationTracker::Abort abort =
      t.OnGenerationChange(2, "rank 3 died", /*blamed_rank=*/3, job);
  ASSERT_TRUE(abort.needed());
  EXPECT_EQ(abort.before, 2);
  EXPECT_EQ(abort.why.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrorKindOf(abort.why), ErrorKind::kReplicaLost);
  EXPECT_EQ(ErrorRankOf(abort.why), 3);
  EXPECT_THAT(std::string(abort.why.message()),
              HasSubstr("replica 1 (ranks 2..3) of job job was retired because its rank 3"));
  EXPECT_EQ(t.broken(), abort.why);
  EXPECT_EQ(t.Advance().status(), abort.why);
  // The other replica follows the job as any survivor does.
  GenerationTracker other(ShardedOpts(/*rank=*/0), 1, "");
  const GenerationTracker::Abort followed =
      other.OnGenerationChange(2, "rank 3 died", /*blamed_rank=*/3, job);
  ASSERT_TRUE(followed.needed());
  EXPECT_EQ(ErrorKindOf(followed.why), ErrorKind::kGenerationMoved);
  EXPECT_TRUE(other.broken().ok());
}

TEST(GenerationTrackerTest, CheckRetiredAt_MateOfAnOrderlyLeaver_AveragesUntilItsNextStep) {
  // Rank 1 left in order before its step 40: rank 0 (its mate) finishes steps up to 39.
  v1::Job job = JobAt(2, {v1::RETIRED, v1::LEFT, v1::ALIVE, v1::ALIVE});
  job.mutable_spec()->set_job_id("job");
  job.mutable_members(0)->set_retired_by(1);
  job.mutable_members(0)->set_retired_at_step(40);
  job.mutable_members(0)->set_generation(2);
  GenerationTracker t(ShardedOpts(/*rank=*/0), 1, "");
  ASSERT_TRUE(t.OnGenerationChange(2, "rank 1 left", /*blamed_rank=*/1, job).needed());
  ASSERT_TRUE(t.Advance().ok());
  EXPECT_TRUE(t.CheckRetiredAt(39).ok());
  // Rank 0's shard group at the last level: ranks 0 and 2, both members until step 40.
  const SubgroupRange shard0{0, 0, 2, 2};
  EXPECT_THAT(t.Decide(AverageAt(39, shard0), 39).members, ElementsAre(0, 2));
  const absl::Status at = t.CheckRetiredAt(40);
  EXPECT_EQ(at.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrorKindOf(at), ErrorKind::kReplicaLost);
  EXPECT_EQ(ErrorRankOf(at), 1);
  EXPECT_THAT(std::string(at.message()), HasSubstr("averaging at step 40: replica 0"));
  EXPECT_EQ(t.broken(), at);
  // Rank 2 (the other replica) leaves rank 0 out from step 40 on.
  GenerationTracker other(ShardedOpts(/*rank=*/2), 1, "");
  ASSERT_TRUE(other.OnGenerationChange(2, "rank 1 left", /*blamed_rank=*/1, job).needed());
  ASSERT_TRUE(other.Advance().ok());
  EXPECT_TRUE(other.CheckRetiredAt(40).ok());
  EXPECT_THAT(other.Decide(AverageAt(39, shard0), 39).members, ElementsAre(0, 2));
  EXPECT_THAT(other.Decide(AverageAt(40, shard0), 40).members, ElementsAre(2));
}

TEST(GenerationTrackerTest, OnReply_SameGenerationPending_BrokenAsAJobHadAfresh) {
  GenerationTracker t(Opts(false), 1, "inc-a");
  t.OnReply(Reply(1, v1::PENDING, "inc-b"), kT0);
  EXPECT_EQ(t.broken().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(t.broken().message()),
              HasSubstr("(incarnation inc-b, this rank joined under inc-a) has job job afresh"));
}

TEST(GenerationTrackerTest, OnReply_Restart_NotBrokenAndTheNewIncarnationNamedLater) {
  GenerationTracker t(Opts(false), 1, "inc-a");
  t.OnReply(Reply(1, v1::RUNNING, "inc-b"), kT0);
  EXPECT_TRUE(t.broken().ok());
  ASSERT_TRUE(t.OnRefusal(absl::NotFoundError("no job")));
  EXPECT_THAT(std::string(t.broken().message()), HasSubstr("joined under incarnation inc-b"));
}

TEST(GenerationTrackerTest, OnRefusal_PermissionDenied_BrokenReplaced) {
  GenerationTracker t(Opts(false, /*rank=*/2), 1, "");
  EXPECT_TRUE(t.OnRefusal(absl::PermissionDeniedError("wrong credential")));
  EXPECT_THAT(std::string(t.broken().message()),
              HasSubstr("no longer counts this worker as rank 2 of job job"));
}

TEST(GenerationTrackerTest, OnRefusal_Unreachable_LeftToTheOutageBound) {
  GenerationTracker t(Opts(false), 1, "");
  EXPECT_FALSE(t.OnRefusal(absl::UnavailableError("connection refused")));
  EXPECT_FALSE(t.OnRefusal(absl::DeadlineExceededError("slow")));
  EXPECT_TRUE(t.broken().ok());
  EXPECT_TRUE(t.Break(absl::UnavailableError("gone for 5m")));
  EXPECT_FALSE(t.Break(absl::UnavailableError("later")));
  EXPECT_EQ(t.broken().message(), "gone for 5m");
}

TEST(GenerationTrackerTest, MarkLeft_OnceThenBrokenSayingSo) {
  GenerationTracker t(Opts(false, /*rank=*/1), 1, "");
  t.RecordFailure(absl::OkStatus());
  t.RecordFailure(absl::UnavailableError("first"));
  t.RecordFailure(absl::InternalError("second"));
  EXPECT_EQ(t.failure().message(), "first");
  EXPECT_TRUE(t.MarkLeft());
  EXPECT_FALSE(t.MarkLeft());
  EXPECT_TRUE(t.left());
  EXPECT_THAT(std::string(t.broken().message()), HasSubstr("rank 1 left job job"));
  EXPECT_TRUE(t.WaitOver(1));
}

TEST(GenerationTrackerTest, MarkLeft_AlreadyBroken_KeepsTheReason) {
  GenerationTracker t(Opts(false), 1, "");
  t.Break(absl::FailedPreconditionError("layout changed"));
  EXPECT_TRUE(t.MarkLeft());
  EXPECT_EQ(t.broken().message(), "layout changed");
}

TEST(GenerationTrackerTest, ExtendWait_NothingPending_WaitIsOver) {
  GenerationTracker t(Opts(true), 1, "");
  GenerationTracker::AwaitWindow wait{absl::Seconds(10)};
  EXPECT_FALSE(
      t.ExtendWait(wait, kT0 + absl::Seconds(10), kT0 + absl::Seconds(10), absl::ZeroDuration())
          .has_value());
}

TEST(GenerationTrackerTest, ExtendWait_Outage_LooksAgainThenWaitsAsLongAgain) {
  GenerationTracker t(Opts(true), 1, "");
  GenerationTracker::AwaitWindow wait{absl::Seconds(10)};
  absl::Time deadline = kT0 + absl::Seconds(10);
  // The coordinator is out of reach: nobody can declare the death; look again shortly.
  std::optional<absl::Time> next = t.ExtendWait(wait, deadline, deadline, absl::Seconds(4));
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(*next, deadline + GenerationTracker::kLookAgain);
  // Back: the full window again from now.
  const absl::Time back = *next + absl::Seconds(30);
  next = t.ExtendWait(wait, back, *next, absl::ZeroDuration());
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(*next, back + absl::Seconds(10));
  // Then over.
  EXPECT_FALSE(t.ExtendWait(wait, *next, *next, absl::ZeroDuration()).has_value());
}

TEST(GenerationTrackerTest, ExtendWait_RecoveryGrace_WaitsItOutAndTheWindowAgain) {
  GenerationTracker t(Opts(true), 1, "");
  t.OnReply(Reply(1, v1::RUNNING, "", /*recovery_grace_ms=*/8000), kT0);
  GenerationTracker::AwaitWindow wait{absl::Seconds(2)};
  const absl::Time deadline = kT0 + absl::Seconds(2);
  std::optional<absl::Time> next = t.ExtendWait(wait, deadline, deadline, absl::ZeroDuration());
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(*next, kT0 + absl::Seconds(8) + absl::Seconds(2));
  EXPECT_FALSE(t.ExtendWait(wait, *next, *next, absl::ZeroDuration()).has_value());
}

}  // namespace
}  // namespace modelavg::client
