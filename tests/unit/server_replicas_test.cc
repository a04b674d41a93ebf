// Sharded replicas (JobSpec.replica_size) in the coordinator core: in an elastic job the replica
// is the unit of failure — a death, a failure or a Leave retires the live ranks of its replica
// in the same generation change — and a replacement replica waits until all its ranks have
// joined, then is admitted whole at one step. Strict jobs fall back to PENDING as before.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/membership/admission.h"
#include "server/membership/member_credential.h"
#include "server/membership/membership.h"
#include "server/store/state_store.h"

namespace modelavg::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kT0 = absl::FromUnixSeconds(1'700'000'000);

// 8 ranks in 4 replicas of 2: groups of 4 (two replicas) every step, the world every 2 steps.
Schedule ShardedSchedule(int32_t replica_size = 2) {
  ScheduleSpec spec{8, 0, AveragingMode::kHierarchical, {{1, 4}, {2, 8}}};
  spec.replica_size = replica_size;
  return *Schedule::Create(spec);
}

// Every rank joined as "w<r>" (credential "c<r>"), each reporting `step`.
void JoinAll(Membership& m, int64_t step = 10) {
  for (int32_t r = 0; r < m.world_size(); ++r) {
    ASSERT_TRUE(m.Join("w" + std::to_string(r), "h", r, kT0, "j", "",
                       CredentialDigest("c" + std::to_string(r)))
                    .ok());
  }
  ASSERT_EQ(m.state(), v1::RUNNING);
  for (int32_t r = 0; r < m.world_size(); ++r) m.Heartbeat(r, m.generation(), step, kT0);
}

TEST(ShardedMembershipTest, Death_RetiresItsReplicaInTheSameGenerationChange) {
  std::vector<MembershipChange> written;
  Membership m(ShardedSchedule(), /*min_world_size=*/4, [&](const MembershipChange& c) {
    written.push_back(c);
    return absl::OkStatus();
  });
  JoinAll(m);
  written.clear();
  const MembershipChange c = m.Die({5}, "rank 5 connection lost", kT0).value();
  EXPECT_TRUE(c.shrunk);
  EXPECT_THAT(c.retired, ElementsAre(4));
  EXPECT_EQ(m.generation(), 2);
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 6);
  EXPECT_THAT(m.VacantRanks(), ElementsAre(4, 5));
  EXPECT_THAT(c.reason, HasSubstr("rank 5 connection lost; replica 2 (ranks 4..5) retired"));
  EXPECT_EQ(m.member(5).state, v1::DEAD);
  EXPECT_EQ(m.member(4).state, v1::RETIRED);
  EXPECT_EQ(m.member(4).retired_by, 5);
  EXPECT_EQ(m.member(4).retired_at_step, 0);
  EXPECT_EQ(m.last_change()->rank(), 5);
  // One change, written once, with both ranks' records.
  ASSERT_EQ(written.size(), 1u);
  std::vector<int32_t> ranks;
  for (const Member& r : written[0].members) {
    if (r.rank == 4 || r.rank == 5) ranks.push_back(r.rank);
  }
  EXPECT_THAT(ranks, ElementsAre(4, 5));
  // Decisions: the retired replica is no member anywhere.
  const std::shared_ptr<const MemberSteps> view = m.DecisionMembers();
  EXPECT_EQ(view->from_step[4], kNotMember);
  EXPECT_EQ(view->from_step[5], kNotMember);
  // Its heartbeats keep nobody alive, and it is never declared dead again.
  m.Heartbeat(4, 1, 11, kT0 + absl::Seconds(10));
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(10), absl::Seconds(3)),
              ElementsAre(0, 1, 2, 3, 6, 7));
}

TEST(ShardedMembershipTest, TwoDeathsInOneReplica_OneRetirementNoneLeft) {
  Membership m(ShardedSchedule(), 4);
  JoinAll(m);
  const MembershipChange c = m.Die({2, 3}, "ranks 2, 3 heartbeat timeout", kT0).value();
  EXPECT_TRUE(c.shrunk);
  EXPECT_THAT(c.retired, IsEmpty());
  EXPECT_THAT(m.VacantRanks(), ElementsAre(2, 3));
}

TEST(ShardedMembershipTest, BelowMinWorldSize_FallsBackToPendingWithoutRetiring) {
  Membership m(ShardedSchedule(), 8 - 2);
  JoinAll(m);
  ASSERT_TRUE(m.Die({0}, "rank 0 heartbeat timeout", kT0).value().shrunk);  // 6 live: ok
  const MembershipChange c = m.Die({7}, "rank 7 heartbeat timeout", kT0).value();
  EXPECT_FALSE(c.shrunk);
  EXPECT_EQ(m.state(), v1::PENDING);
  EXPECT_EQ(m.member(6).state, v1::ALIVE);  // not retired: every worker re-joins anyway
}

TEST(ShardedMembershipTest, StrictJob_DeathFallsBackToPendingAsBefore) {
  Membership m(ShardedSchedule(), 0);
  JoinAll(m);
  const MembershipChange c = m.Die({5}, "rank 5 heartbeat timeout", kT0).value();
  EXPECT_FALSE(c.shrunk);
  EXPECT_THAT(c.retired, IsEmpty());
  EXPECT_EQ(m.state(), v1::PENDING);
}

// An orderly Leave at the end of a run: the leaver's mates finish the steps it finished (they
// are members of decisions before its next step), then are out.
TEST(ShardedMembershipTest, OrderlyLeave_MatesTakePartUntilTheLeaversNextStep) {
  Membership m(ShardedSchedule(), 4);
  JoinAll(m);
  absl::StatusOr<Membership::LeaveResult> left = m.Leave(2, "rank 2 left", kT0, "j", 20);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->change.shrunk);
  EXPECT_THAT(left->change.retired, ElementsAre(3));
  EXPECT_EQ(m.member(3).state, v1::RETIRED);
  EXPECT_EQ(m.member(3).retired_by, 2);
  EXPECT_EQ(m.member(3).retired_at_step, 20);
  const std::shared_ptr<const MemberSteps> view = m.DecisionMembers();
  EXPECT_EQ(view->from_step[3], -1);
  EXPECT_EQ(view->until_step[3], 20);
  EXPECT_EQ(view->from_step[2], kNotMember);
  EXPECT_EQ(view->until_step[0], kNotMember);
  // It is still watched: a lingering mate that stops beating is declared dead.
  m.Heartbeat(3, 1, 19, kT0 + absl::Seconds(1));
  EXPECT_THAT(m.Stale(kT0 + absl::Seconds(4), absl::Seconds(3)), ElementsAre(0, 1, 4, 5, 6, 7));
  // Its own Leave moves the generation (its peers must learn it is gone).
  const int64_t generation = m.generation();
  absl::StatusOr<Membership::LeaveResult> mate = m.Leave(3, "rank 3 left", kT0, "j", 20);
  ASSERT_TRUE(mate.ok()) << mate.status();
  EXPECT_TRUE(mate->change.generation_changed);
  EXPECT_EQ(m.generation(), generation + 1);
  EXPECT_EQ(m.DecisionMembers()->from_step[3], kNotMember);
}

// The end of a run: one rank of each replica leaves first; the job stays RUNNING while their
// mates finish their last steps, and is FINISHED once the last one has left.
TEST(ShardedMembershipTest, EndOfRun_MatesFinishingTheirStepsKeepTheJobRunning) {
  Membership m(ShardedSchedule(), 4);
  JoinAll(m);
  for (int32_t r : {0, 2, 4, 6}) ASSERT_TRUE(m.Leave(r, "finished", kT0, "j", 30).ok()) << r;
  EXPECT_EQ(m.state(), v1::RUNNING);
  EXPECT_EQ(m.round_size(), 0);
  for (int32_t r : {1, 3, 5}) {
    ASSERT_TRUE(m.Leave(r, "finished", kT0, "j", 30).ok()) << r;
    EXPECT_EQ(m.state(), v1::RUNNING) << "after rank " << r << " left";
    EXPECT_EQ(m.DecisionMembers()->until_step[7], 30);
  }
  ASSERT_TRUE(m.Leave(7, "finished", kT0, "j", 30).ok());
  EXPECT_EQ(m.state(), v1::FINISHED);
}

TEST(ShardedMembershipTest, LeaveWithoutNextStep_RetiresAtOnce) {
  Membership m(ShardedSchedule(), 4);
  JoinAll(m);
  ASSERT_TRUE(m.Leave(0, "rank 0 left", kT0, "j", /*next_step=*/0).ok());
  EXPECT_EQ(m.member(1).state, v1::RETIRED);
  EXPECT_EQ(m.member(1).retired_at_step, 0);
  EXPECT_EQ(m.DecisionMembers()->from_step[1], kNotMember);
}

// A replacement replica: its ranks wait for each other (nothing written, no new generation),
// then are admitted together at one step in one new generation.
TEST(ShardedAdmissionTest, ReplicaWaitsForAllItsRanks_ThenAdmittedWholeAtOneStep) {
  std::vector<MembershipChange> written;
  Membership m(ShardedSchedule(), 4, [&](const MembershipChange& c) {
    written.push_back(c);
    return absl::OkStatus();
  });
  JoinAll(m, 10);
  ASSERT_TRUE(m.Die({5}, "rank 5 connection lost", kT0).ok());
  ASSERT_TRUE(m.Die({1}, "rank 1 connection lost", kT0).ok());
  ASSERT_EQ(m.generation(), 3);
  written.clear();
  // No rank asked: the lowest vacant rank of the lowest vacant replica (replica 0).
  absl::StatusOr<Membership::JoinResult> a =
      m.Join("new-a", "h", std::nullopt, kT0, "j", "", "", "nonce-a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->rank, 0);
  EXPECT_TRUE(a->waiting_for_replica);
  EXPECT_FALSE(a->change.generation_changed);
  EXPECT_TRUE(written.empty());
  EXPECT_TRUE(m.Waiting(0));
  EXPECT_EQ(m.generation(), 3);
  EXPECT_FALSE(m.InRound(0));
  // Another worker asking for the waiting rank is refused, naming the waiting worker.
  absl::StatusOr<Membership::JoinResult> taken = m.Join("other", "h", 0, kT0, "j");
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(taken.status().message(), HasSubstr("new-a"));
  // A rank of a live replica is refused.
  absl::StatusOr<Membership::JoinResult> live = m.Join("other", "h", 3, kT0, "j");
  EXPECT_EQ(live.status().code(), absl::StatusCode::kAlreadyExists);
  // The same worker id without the Join's nonce is not the same Join (the id is public).
  absl::StatusOr<Membership::JoinResult> thief = m.Join("new-a", "h", 0, kT0, "j");
  EXPECT_EQ(thief.status().code(), absl::StatusCode::kAlreadyExists) << thief.status();
  // The same Join retried (its nonce) keeps its rank.
  absl::StatusOr<Membership::JoinResult> again =
      m.Join("new-a", "h", std::nullopt, kT0, "j", "", "", "nonce-a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rank, 0);
  EXPECT_TRUE(again->was_in_round);
  // The second rank of the replica: both admitted at once.
  absl::StatusOr<Membership::JoinResult> b = m.Join("new-b", "h", std::nullopt, kT0, "j");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->rank, 1);
  EXPECT_FALSE(b->waiting_for_replica);
  EXPECT_THAT(b->admitted_with, ElementsAre(0));
  const MembershipChange& c = b->change;
  EXPECT_TRUE(c.admitted);
  EXPECT_THAT(c.admitted_ranks, ElementsAre(0, 1));
  EXPECT_EQ(c.admission_step, 12);  // largest step reported 10 + margin 2
  EXPECT_THAT(c.reason, HasSubstr("replica 0 (ranks 0..1) was admitted at step 12"));
  EXPECT_EQ(m.generation(), 4);
  EXPECT_EQ(m.member(0).admitted_step, 12);
  EXPECT_EQ(m.member(1).admitted_step, 12);
  EXPECT_TRUE(m.InRound(0) && m.InRound(1));
  EXPECT_FALSE(m.Waiting(0));
  EXPECT_THAT(m.VacantRanks(), ElementsAre(4, 5));
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0].header->generation, 4);
}

TEST(ShardedAdmissionTest, RequestedRanks_OfAVacantReplicaOnly_FullJobRefused) {
  Membership m(ShardedSchedule(), 4);
  JoinAll(m);
  // Nothing vacant: full.
  absl::StatusOr<Membership::JoinResult> full = m.Join("x", "h", std::nullopt, kT0, "j");
  EXPECT_EQ(full.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(full.status().message(), HasSubstr("is full"));
  ASSERT_TRUE(m.Die({6}, "rank 6 connection lost", kT0).ok());
  // The holder of a live rank restarting (its credential): not yet, its replica is live.
  absl::StatusOr<Membership::JoinResult> restart =
      m.Join("w2-again", "h", 2, kT0, "j", "c2", CredentialDigest("c2-new"));
  EXPECT_EQ(restart.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(restart.status().message(), HasSubstr("replaced whole"));
  // Each asks for its rank of replica 3, in any order.
  absl::StatusOr<Membership::JoinResult> seven = m.Join("n7", "h", 7, kT0, "j");
  ASSERT_TRUE(seven.ok()) << seven.status();
  EXPECT_TRUE(seven->waiting_for_replica);
  absl::StatusOr<Membership::JoinResult> six = m.Join("n6", "h", 6, kT0, "j");
  ASSERT_TRUE(six.ok()) << six.status();
  EXPECT_TRUE(six->change.admitted);
  EXPECT_THAT(six->change.admitted_ranks, ElementsAre(6, 7));
}

TEST(ShardedAdmissionTest, WithdrawnOrFallBack_WaitingEnds) {
  Membership m(ShardedSchedule(), 6);
  JoinAll(m);
  ASSERT_TRUE(m.Die({3}, "rank 3 connection lost", kT0).ok());
  ASSERT_TRUE(m.Join("a", "h", 2, kT0, "j").ok());
  EXPECT_TRUE(m.Waiting(2));
  m.Withdraw(2);  // its Join was cancelled
  EXPECT_FALSE(m.Waiting(2));
  EXPECT_EQ(m.member(2).state, v1::RETIRED);  // the record is untouched
  ASSERT_TRUE(m.Join("a", "h", 2, kT0, "j").ok());
  ASSERT_FALSE(m.Die({4}, "rank 4 connection lost", kT0).value().shrunk);  // 4 live < 6
  EXPECT_FALSE(m.Waiting(2));
  EXPECT_THAT(m.WaitingRanks(), IsEmpty());
}

// Each rank of a replacement replica needs a live rank of its own shard in its group.
TEST(ShardedAdmissionTest, FindAdmissionStep_EveryRankNeedsItsShardsDonor) {
  // Groups of 4 every 2 steps, the world every 8; replicas of 2.
  ScheduleSpec spec{8, 0, AveragingMode::kHierarchical, {{2, 4}, {8, 8}}};
  spec.replica_size = 2;
  const Schedule s = *Schedule::Create(spec);
  // Replica 1 (ranks 2, 3) joins; replica 0 is live: its shards 0 and 1 are donors at level 0.
  EXPECT_EQ(*FindAdmissionStep(s, std::vector<int32_t>{2, 3},
                               {-1, -1, kNotMember, kNotMember, -1, -1, -1, -1}, 3, "j"),
            4);
  // Replica 0 is vacant too: only the world level has donors.
  EXPECT_EQ(*FindAdmissionStep(s, std::vector<int32_t>{2, 3},
                               {kNotMember, kNotMember, kNotMember, kNotMember, -1, -1, -1, -1},
                               3, "j"),
            8);
  // Only shard 0 of replica 0 is a donor (a half replica): shard 1 of replica 1 has none in
  // its group, so the group step does not do.
  EXPECT_EQ(*FindAdmissionStep(s, std::vector<int32_t>{2, 3},
                               {-1, kNotMember, kNotMember, kNotMember, -1, -1, -1, -1}, 3, "j"),
            8);
}

// --- The Job: replies, GetJob, decisions, expiry and restart.

class ShardedJobTest : public ::testing::Test {
 protected:
  ShardedJobTest() { registry_ = NewRegistry(); }

  std::unique_ptr<JobRegistry> NewRegistry() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    options.store = &store_;
    return std::make_unique<JobRegistry>(options);
  }

  // Job "s": 8 ranks in replicas of 2, groups of 4 every step, the world every 2; elastic down
  // to 4 ranks. Every rank joined.
  std::shared_ptr<Job> MakeRunningJob() {
    v1::JobSpec spec;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
        R"pb(job_id: "s" world_size: 8 replica_size: 2 mode: HIERARCHICAL min_world_size: 4
             levels { period: 1 group_size: 4 } levels { period: 2 group_size: 8 })pb",
        &spec));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    std::shared_ptr<Job> job = *registry_->Find("s");
    for (int r = 0; r < 8; ++r) {
      EXPECT_TRUE(StartJoin(*job, absl::StrCat("w", r), r).has_value() == (r == 7));
    }
    return job;
  }

  // Starts a Join; its answer, when it came at once.
  std::optional<absl::StatusOr<v1::JoinResponse>> StartJoin(Job& job, const std::string& worker,
                                                            std::optional<int> rank) {
    v1::JoinRequest request;
    request.set_job_id("s");
    request.set_worker_id(worker);
    if (rank.has_value()) request.set_rank(*rank);
    auto slot = std::make_shared<std::optional<absl::StatusOr<v1::JoinResponse>>>();
    answers_.push_back(slot);
    job.Join(request, clock_.Now() + absl::Seconds(30), registry_->NewWaitId(),
             [this, slot](absl::StatusOr<v1::JoinResponse> r) {
               if (r.ok()) credentials_[r->rank()] = r->credential();
               *slot = std::move(r);
             });
    return *slot;
  }

  // Every rank not in `silent` (and alive) beats at `step`; then the clock passes the timeout.
  void Silence(Job& job, const std::vector<int>& silent, int64_t step) {
    for (int k = 0; k < 2; ++k) {
      clock_.Advance(absl::Seconds(2));
      for (int r = 0; r < 8; ++r) {
        if (std::find(silent.begin(), silent.end(), r) != silent.end()) continue;
        v1::HeartbeatRequest hb;
        hb.set_job_id("s");
        hb.set_rank(r);
        hb.set_generation(State(job).generation());
        hb.set_step(step);
        hb.set_credential(credentials_[r]);
        v1::HeartbeatResponse reply;
        (void)job.Heartbeat(hb, &reply);
      }
      job.CheckStaleness();
    }
  }

  v1::Job State(const Job& job) {
    v1::Job state;
    job.ToProto(&state);
    return state;
  }

  v1::StepDecision Decision(Job& job, int rank, int64_t step) {
    v1::GetScheduleRequest req;
    req.set_job_id("s");
    req.set_from_step(step);
    req.set_count(1);
    req.set_rank(rank);
    v1::GetScheduleResponse resp;
    EXPECT_TRUE(job.GetSchedule(req, &resp).ok());
    return resp.decisions(0);
  }

  FakeClock clock_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
  std::map<int, std::string> credentials_;
  std::vector<std::shared_ptr<std::optional<absl::StatusOr<v1::JoinResponse>>>> answers_;
};

TEST_F(ShardedJobTest, DeathRetiresReplica_GetJobGroupsByReplica_DecisionsListTheShard) {
  std::shared_ptr<Job> job = MakeRunningJob();
  v1::Job state = State(*job);
  EXPECT_EQ(state.spec().replica_size(), 2);
  ASSERT_EQ(state.members_size(), 8);
  EXPECT_EQ(state.members(5).replica(), 2);
  EXPECT_EQ(state.members(5).shard(), 1);
  // Decisions before: rank 7 at a group step averages with rank 5 (its shard, its block).
  EXPECT_THAT(Decision(*job, 7, 1).ranks(), ElementsAre(5, 7));
  EXPECT_EQ(Decision(*job, 7, 1).subgroup(), 3);
  EXPECT_THAT(Decision(*job, 7, 2).ranks(), ElementsAre(1, 3, 5, 7));

  Silence(*job, {5}, 3);
  state = State(*job);
  EXPECT_EQ(state.generation(), 2);
  EXPECT_EQ(state.state(), v1::RUNNING);
  EXPECT_EQ(state.live_world_size(), 6);
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(4, 5));
  EXPECT_EQ(state.members(5).state(), v1::DEAD);
  EXPECT_EQ(state.members(4).state(), v1::RETIRED);
  EXPECT_EQ(state.members(4).retired_by(), 5);
  EXPECT_THAT(state.last_change().reason(), HasSubstr("replica 2 (ranks 4..5) retired"));
  // One entry of the generation history for the death and its replica.
  const std::vector<v1::GenerationChange> history = job->GenerationHistory();
  ASSERT_EQ(history.size(), 2u);  // the start, then the loss
  EXPECT_THAT(history[1].reason(), HasSubstr("replica 2"));
  // Decisions now: rank 7's pair lost rank 5; rank 6's lost rank 4.
  EXPECT_THAT(Decision(*job, 7, 1).members(), ElementsAre(7));
  EXPECT_THAT(Decision(*job, 6, 1).members(), ElementsAre(6));
  EXPECT_THAT(Decision(*job, 6, 2).members(), ElementsAre(0, 2, 6));
}

TEST_F(ShardedJobTest, ReplacementReplica_AnsweredTogetherOnceComplete_ExpiryNamesMissingRanks) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Silence(*job, {5}, 3);
  // The first rank of the replacement waits (its Join is not answered).
  EXPECT_FALSE(StartJoin(*job, "new-4", std::nullopt).has_value());
  v1::Job state = State(*job);
  EXPECT_THAT(state.waiting_ranks(), ElementsAre(4));
  EXPECT_EQ(state.generation(), 2);
  // A generation change meanwhile (another replica lost) does not end the wait.
  Silence(*job, {0, 4, 5}, 3);  // rank 4 never beats (no credential yet); 0 dies
  ASSERT_EQ(State(*job).generation(), 3);
  EXPECT_FALSE(answers_.back()->has_value());
  // The second rank completes it: both answered, one admission step, one generation.
  std::optional<absl::StatusOr<v1::JoinResponse>> second = StartJoin(*job, "new-5", 5);
  ASSERT_TRUE(second.has_value());
  ASSERT_TRUE(second->ok()) << second->status();
  ASSERT_TRUE(answers_[answers_.size() - 2]->has_value());
  const absl::StatusOr<v1::JoinResponse>& first = **answers_[answers_.size() - 2];
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->rank(), 4);
  EXPECT_EQ((*second)->rank(), 5);
  EXPECT_EQ(first->admission_step(), (*second)->admission_step());
  EXPECT_GT(first->admission_step(), 3);
  EXPECT_EQ(first->generation(), 4);
  EXPECT_EQ((*second)->generation(), 4);
  EXPECT_THAT(first->subgroups(0).ranks(), ElementsAre(4, 6));
  state = State(*job);
  EXPECT_THAT(state.waiting_ranks(), IsEmpty());
  EXPECT_THAT(state.vacant_ranks(), ElementsAre(0, 1));

  // Replica 0's replacement: one rank only; its wait expires naming the missing rank.
  EXPECT_FALSE(StartJoin(*job, "lonely", 1).has_value());
  clock_.Advance(absl::Seconds(31));
  job->CheckStaleness();
  ASSERT_TRUE(answers_.back()->has_value());
  const absl::Status expired = answers_.back()->value().status();
  EXPECT_EQ(expired.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(expired.message(), HasSubstr("ranks 0 of replica 0 did not join"));
  EXPECT_THAT(State(*job).waiting_ranks(), IsEmpty());
}

TEST_F(ShardedJobTest, Restart_KeepsReplicaSizeAndRetiredMembers) {
  std::shared_ptr<Job> job = MakeRunningJob();
  Silence(*job, {2}, 3);
  const v1::Job before = State(*job);
  job.reset();
  registry_->Stop();
  registry_ = NewRegistry();
  ASSERT_EQ(*registry_->LoadFromStore(absl::Seconds(5)), 1);
  job = *registry_->Find("s");
  const v1::Job after = State(*job);
  EXPECT_EQ(after.spec().replica_size(), 2);
  EXPECT_EQ(after.generation(), before.generation());
  EXPECT_EQ(after.members(3).state(), v1::RETIRED);
  EXPECT_EQ(after.members(3).retired_by(), 2);
  EXPECT_THAT(after.vacant_ranks(), ElementsAre(2, 3));
}

}  // namespace
}  // namespace modelavg::server
