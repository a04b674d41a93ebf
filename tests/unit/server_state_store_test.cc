// The coordinator core writes its hard state through a StateStore: what it writes at each
// transition, that steps and heartbeats write nothing, what a failed write does, and that a Job
// restored from the store continues where it was.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/store/state_store.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/paced_rounds_store_cases.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Spec() {
  return ::modelavg::testing::MakeSpec("j", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0);
}

class StateStoreTest : public ::testing::Test {
 protected:
  StateStoreTest() { registry_ = MakeRegistry(); }

  std::unique_ptr<JobRegistry> MakeRegistry() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.store = &store_;
    options.defaults.heartbeat_timeout = absl::Seconds(3);
    return std::make_unique<JobRegistry>(options);
  }

  std::shared_ptr<Job> CreateJob() {
    EXPECT_TRUE(registry_->CreateJob(Spec(), nullptr).ok());
    return *registry_->Find("j");
  }

  // Joins ranks 0..3; returns how many Joins completed OK.
  int JoinAll(Job& job) {
    auto ok = std::make_shared<int>(0);
    for (int r = 0; r < 4; ++r) {
      v1::JoinRequest request;
      request.set_worker_id(absl::StrCat("w", r));
      request.set_rank(r);
      job.Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
               [this, ok](absl::StatusOr<v1::JoinResponse> r) {
                 *ok += r.ok() ? 1 : 0;
                 if (r.ok()) credentials_[r->rank()] = r->credential();
               });
    }
    return *ok;
  }

  absl::Status Publish(Job& job, int64_t generation, const std::string& blob) {
    v1::PublishCommIdRequest request;
    request.set_generation(generation);
    request.set_level(0);
    request.set_subgroup(0);
    request.set_rank(0);
    request.set_unique_id(blob);
    request.set_credential(credentials_[0]);
    return job.PublishCommId(request);
  }

  StoredJob Stored() {
    absl::StatusOr<std::vector<StoredJob>> jobs = store_.LoadAll();
    EXPECT_TRUE(jobs.ok());
    EXPECT_EQ(jobs->size(), 1u);
    return jobs->empty() ? StoredJob{} : (*jobs)[0];
  }

  FakeClock clock_;
  // rank -> its member's credential (JoinResponse.credential).
  std::map<int, std::string> credentials_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
};

TEST_F(StateStoreTest, CreateJob_StoresSpecPendingGenerationOne) {
  CreateJob();
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.spec.job_id(), "j");
  EXPECT_EQ(stored.header.state, v1::PENDING);
  EXPECT_EQ(stored.header.generation, 1);
  EXPECT_TRUE(stored.members.empty());
}

TEST_F(StateStoreTest, JoinAndPublish_StoredBeforeAnswered) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  ASSERT_TRUE(Publish(*job, 1, "blob").ok());
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.header.state, v1::RUNNING);
  ASSERT_EQ(stored.members.size(), 4u);
  EXPECT_EQ(stored.members[3].worker_id, "w3");
  EXPECT_EQ(stored.members[3].generation, 1);
  ASSERT_EQ(stored.comm_ids.size(), 1u);
  EXPECT_EQ(stored.comm_ids[0].blob, "blob");
}

TEST_F(StateStoreTest, StepsHeartbeatsAndRepeatedPublish_WriteNothing) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  ASSERT_TRUE(Publish(*job, 1, "blob").ok());
  const int64_t writes = store_.applied();
  for (int step = 0; step < 100; ++step) {
    v1::HeartbeatRequest hb;
    hb.set_rank(step % 4);
    hb.set_generation(1);
    hb.set_step(step);
    hb.set_credential(credentials_[step % 4]);
    v1::HeartbeatResponse hb_reply;
    ASSERT_TRUE(job->Heartbeat(hb, &hb_reply).ok());
    v1::StepRequest st;
    st.set_rank(step % 4);
    st.set_generation(1);
    st.set_step(step);
    st.set_credential(credentials_[step % 4]);
    v1::StepDecision decision;
    ASSERT_TRUE(job->Step(st, &decision).ok());
  }
  ASSERT_TRUE(Publish(*job, 1, "blob").ok());  // identical bytes again
  job->CheckStaleness();
  EXPECT_EQ(store_.applied(), writes);
}

TEST_F(StateStoreTest, HeartbeatTimeout_StoresNewGenerationAndDropsOldIds) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  ASSERT_TRUE(Publish(*job, 1, "blob").ok());
  clock_.Advance(absl::Seconds(4));
  job->CheckStaleness();
  // Every member silent at once is ridden through for three heartbeat timeouts (the
  // coordinator may be the one cut off); past that the silent are dead.
  clock_.Advance(absl::Seconds(10));
  job->CheckStaleness();
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.header.generation, 2);
  EXPECT_EQ(stored.header.state, v1::PENDING);
  ASSERT_TRUE(stored.header.last_change.has_value());
  EXPECT_THAT(stored.header.last_change->reason(), HasSubstr("heartbeat timeout"));
  EXPECT_TRUE(stored.comm_ids.empty());
  for (const Member& m : stored.members) EXPECT_EQ(m.state, v1::DEAD);
}

TEST_F(StateStoreTest, DeleteJob_RemovesItFromTheStore) {
  CreateJob();
  ASSERT_TRUE(registry_->DeleteJob("j").ok());
  EXPECT_TRUE(store_.LoadAll()->empty());
}

// A change takes effect if and only if it is durable: a refused write leaves memory as it was.
TEST_F(StateStoreTest, FailedWrites_AnswerUnavailableAndChangeNothing) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  store_.FailWrites(absl::InternalError("disk full"));
  absl::Status s = Publish(*job, 1, "blob");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("disk full"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("nothing was changed"));
  v1::LeaveRequest leave;
  leave.set_rank(2);
  leave.set_credential(credentials_[2]);
  v1::LeaveResponse left;
  EXPECT_EQ(job->Leave(leave, &left).code(), absl::StatusCode::kUnavailable);
  v1::JobSpec other = Spec();
  other.set_job_id("k");
  EXPECT_EQ(registry_->CreateJob(other, nullptr).code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(registry_->Find("k").ok());
  EXPECT_EQ(registry_->DeleteJob("j").code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(registry_->Find("j").ok());

  // Neither the Leave nor the id happened: memory and the store both say generation 1.
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.state(), v1::RUNNING);
  EXPECT_EQ(proto.generation(), 1);
  EXPECT_EQ(proto.members(2).state(), v1::ALIVE);
  EXPECT_EQ(Stored().header.generation, 1);
  v1::GetCommIdRequest get;
  get.set_generation(1);
  get.set_rank(1);
  get.set_credential(credentials_[1]);
  get.set_timeout_ms(1);
  std::optional<absl::StatusOr<std::string>> got;
  job->GetCommId(get, absl::InfiniteFuture(), registry_->NewWaitId(),
                 [&](absl::StatusOr<std::string> r) { got = std::move(r); });
  EXPECT_FALSE(got.has_value()) << "an id that was never stored was handed out";
  job->CancelWait(registry_->NewWaitId());

  // Once writes succeed the same calls work, each exactly once.
  store_.FailWrites(absl::OkStatus());
  ASSERT_TRUE(job->Leave(leave, &left).ok());
  EXPECT_EQ(left.generation(), 2);
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.header.generation, 2);
  EXPECT_EQ(stored.members[2].state, v1::LEFT);
}

// The Join that completes a world (a world-1 job here) is answered only once the round is
// written; refused, the job stays PENDING without it, and its retry completes it.
TEST_F(StateStoreTest, FailedWriteOfTheCompletingJoin_NotAnsweredOkNotInMemory) {
  v1::JobSpec one = Spec();
  one.set_job_id("one");
  one.set_world_size(1);
  one.clear_levels();
  one.set_mode(v1::PERIODIC);
  one.add_levels()->set_period(1);
  one.mutable_levels(0)->set_group_size(1);
  ASSERT_TRUE(registry_->CreateJob(one, nullptr).ok());
  std::shared_ptr<Job> job = *registry_->Find("one");
  store_.FailWrites(absl::ResourceExhaustedError("database or disk is full"));
  v1::JoinRequest join;
  join.set_worker_id("w0");
  std::optional<absl::StatusOr<v1::JoinResponse>> answer;
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(),
            [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), absl::StatusCode::kUnavailable) << answer->status();
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.state(), v1::PENDING);
  EXPECT_EQ(proto.members_size(), 0);
  EXPECT_EQ(proto.live_world_size(), 0);

  store_.FailWrites(absl::OkStatus());
  answer.reset();
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(),
            [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok()) << answer->status();
  EXPECT_EQ((*answer)->generation(), 1);
  absl::StatusOr<std::vector<StoredJob>> jobs = store_.LoadAll();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  const StoredJob& stored = (*jobs)[0];
  ASSERT_EQ(stored.spec.job_id(), "one");
  EXPECT_EQ(stored.header.state, v1::RUNNING);
  ASSERT_EQ(stored.members.size(), 1u);
  EXPECT_EQ(stored.members[0].state, v1::ALIVE);
}

// The last Join of a bigger world, refused: the others keep waiting, the retry completes it.
TEST_F(StateStoreTest, FailedWriteOfTheLastJoin_OthersKeepWaiting_RetryCompletes) {
  std::shared_ptr<Job> job = CreateJob();
  int answered = 0, ok = 0;
  auto join = [&](int r) {
    v1::JoinRequest request;
    request.set_worker_id(absl::StrCat("w", r));
    request.set_rank(r);
    job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
              [&](absl::StatusOr<v1::JoinResponse> a) {
                ++answered;
                ok += a.ok() ? 1 : 0;
              });
  };
  for (int r = 0; r < 3; ++r) join(r);
  store_.FailWrites(absl::InternalError("disk full"));
  join(3);
  EXPECT_EQ(answered, 1);
  EXPECT_EQ(ok, 0);
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.state(), v1::PENDING);
  EXPECT_EQ(proto.live_world_size(), 3);
  store_.FailWrites(absl::OkStatus());
  join(3);
  EXPECT_EQ(answered, 5);
  EXPECT_EQ(ok, 4);
  EXPECT_EQ(Stored().header.state, v1::RUNNING);
  EXPECT_EQ(Stored().header.generation, 1);
}

// Issue: each retry of a refused Join counted as a re-join and moved the generation.
TEST_F(StateStoreTest, RefusedReJoin_RetriedThreeTimes_MovesTheGenerationOnce) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  v1::JoinRequest rejoin;
  rejoin.set_worker_id("w0-restarted");
  rejoin.set_rank(0);
  rejoin.set_credential(credentials_[0]);
  store_.FailWrites(absl::InternalError("disk full"));
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::optional<absl::StatusOr<v1::JoinResponse>> answer;
    job->Join(rejoin, absl::InfiniteFuture(), registry_->NewWaitId(),
              [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
    ASSERT_TRUE(answer.has_value());
    EXPECT_EQ(answer->status().code(), absl::StatusCode::kUnavailable);
    v1::Job proto;
    job->ToProto(&proto);
    EXPECT_EQ(proto.generation(), 1);
    EXPECT_EQ(proto.state(), v1::RUNNING);
  }
  store_.FailWrites(absl::OkStatus());
  job->Join(rejoin, absl::InfiniteFuture(), registry_->NewWaitId(),
            [](absl::StatusOr<v1::JoinResponse>) {});
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 2);
  EXPECT_EQ(Stored().header.generation, 2);
}

// An elastic replacement refused on a full disk is not admitted; its retries move nothing.
TEST_F(StateStoreTest, ElasticAdmissionRefused_NotAdmitted_RetriesMoveNoGeneration) {
  v1::JobSpec spec = Spec();
  spec.set_job_id("e");
  spec.set_min_world_size(2);
  ASSERT_TRUE(registry_->CreateJob(spec, nullptr).ok());
  std::shared_ptr<Job> job = *registry_->Find("e");
  for (int r = 0; r < 4; ++r) {
    v1::JoinRequest request;
    request.set_worker_id(absl::StrCat("w", r));
    request.set_rank(r);
    job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
              [this](absl::StatusOr<v1::JoinResponse> a) {
                if (a.ok()) credentials_[a->rank()] = a->credential();
              });
  }
  auto beat = [&](int r, int64_t generation) {
    v1::HeartbeatRequest hb;
    hb.set_rank(r);
    hb.set_generation(generation);
    hb.set_step(10);
    hb.set_credential(credentials_[r]);
    v1::HeartbeatResponse reply;
    return job->Heartbeat(hb, &reply);
  };
  clock_.Advance(absl::Seconds(2));
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(beat(r, 1).ok());
  clock_.Advance(absl::Seconds(2));
  job->CheckStaleness();  // rank 3 dies: generation 2 of the survivors
  v1::Job proto;
  job->ToProto(&proto);
  ASSERT_EQ(proto.generation(), 2);
  ASSERT_EQ(proto.state(), v1::RUNNING);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(beat(r, 2).ok());

  store_.FailWrites(absl::InternalError("disk full"));
  v1::JoinRequest replacement;
  replacement.set_worker_id("new");
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::optional<absl::StatusOr<v1::JoinResponse>> answer;
    job->Join(replacement, absl::InfiniteFuture(), registry_->NewWaitId(),
              [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
    ASSERT_TRUE(answer.has_value());
    EXPECT_EQ(answer->status().code(), absl::StatusCode::kUnavailable) << answer->status();
  }
  proto.Clear();
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 2);
  EXPECT_EQ(proto.live_world_size(), 3);
  EXPECT_EQ(proto.admissions(), 0);
  ASSERT_EQ(proto.vacant_ranks_size(), 1);
  EXPECT_EQ(proto.vacant_ranks(0), 3);

  store_.FailWrites(absl::OkStatus());
  std::optional<absl::StatusOr<v1::JoinResponse>> answer;
  job->Join(replacement, absl::InfiniteFuture(), registry_->NewWaitId(),
            [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(answer->ok()) << answer->status();
  EXPECT_EQ((*answer)->rank(), 3);
  EXPECT_EQ((*answer)->generation(), 3);
}

// A death the coordinator cannot record stops the job, loudly, rather than diverge from what a
// restarted coordinator would load; it goes on once the write succeeds.
TEST_F(StateStoreTest, DeathThatCannotBeWritten_HaltsTheJobUntilItIs) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  store_.FailWrites(absl::InternalError("disk full"));
  clock_.Advance(absl::Seconds(4));
  job->CheckStaleness();
  // Every member silent at once is ridden through for three heartbeat timeouts (the
  // coordinator may be the one cut off); past that the silent are dead.
  clock_.Advance(absl::Seconds(10));
  job->CheckStaleness();
  v1::Job proto;
  job->ToProto(&proto);
  EXPECT_EQ(proto.generation(), 1);  // as stored
  EXPECT_EQ(proto.members(0).state(), v1::ALIVE);
  ASSERT_GE(proto.warnings_size(), 1);
  EXPECT_THAT(proto.warnings(proto.warnings_size() - 1), HasSubstr("halted"));
  v1::StepRequest st;
  st.set_rank(0);
  st.set_generation(1);
  st.set_step(3);
  st.set_credential(credentials_[0]);
  v1::StepDecision decision;
  absl::Status s = job->Step(st, &decision);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("the death of rank 0 heartbeat timeout (and 3 more ranks) cannot be recorded"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("disk full"));
  EXPECT_EQ(Stored().header.generation, 1);

  store_.FailWrites(absl::OkStatus());
  job->CheckStaleness();
  EXPECT_EQ(Stored().header.generation, 2);
  s = job->Step(st, &decision);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("stale"));
}

// Issue: Joins refused with "the coordinator is shutting down" were stored, reloaded as ALIVE
// members, and a new worker asking for the rank got ALREADY_EXISTS.
TEST_F(StateStoreTest, JoinsPendingAtShutdown_AreNeverStored) {
  std::shared_ptr<Job> job = CreateJob();
  int unavailable = 0;
  for (int r = 0; r < 3; ++r) {
    v1::JoinRequest request;
    request.set_worker_id(absl::StrCat("w", r));
    request.set_rank(r);
    job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
              [&](absl::StatusOr<v1::JoinResponse> a) {
                unavailable += a.status().code() == absl::StatusCode::kUnavailable ? 1 : 0;
              });
  }
  // Nothing is stored while the round assembles (a kill -9 now leaves no member behind either).
  EXPECT_TRUE(Stored().members.empty());
  registry_->Stop();
  EXPECT_EQ(unavailable, 3);
  EXPECT_TRUE(Stored().members.empty());

  // After the restart the ranks are free for anyone.
  job.reset();
  registry_ = MakeRegistry();
  ASSERT_TRUE(registry_->LoadFromStore(absl::Seconds(1)).ok());
  std::shared_ptr<Job> restored = *registry_->Find("j");
  v1::JoinRequest other;
  other.set_worker_id("someone-else");
  other.set_rank(0);
  std::optional<absl::StatusOr<v1::JoinResponse>> answer;
  restored->Join(other, absl::InfiniteFuture(), registry_->NewWaitId(),
                 [&](absl::StatusOr<v1::JoinResponse> r) { answer = std::move(r); });
  EXPECT_FALSE(answer.has_value()) << answer->status();  // waiting for the round, not refused
  v1::Job proto;
  restored->ToProto(&proto);
  EXPECT_EQ(proto.live_world_size(), 1);
  registry_->Stop();  // fails the Join while `answer` is alive
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(StateStoreTest, Restore_ContinuesGenerationMembersAndIds) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  ASSERT_TRUE(Publish(*job, 1, "blob").ok());

  // A second core on the same store, as after a restart.
  const StoredJob stored = Stored();
  absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(stored.spec);
  ASSERT_TRUE(schedule_spec.ok());
  absl::StatusOr<Schedule> schedule = Schedule::Create(*schedule_spec);
  ASSERT_TRUE(schedule.ok());
  InMemoryStateStore other_store;
  ASSERT_TRUE(other_store.CreateJob(stored.spec, stored.created_unix_ms).ok());
  Job restored(stored.spec, *std::move(schedule), JobDefaults{}, &clock_, &other_store,
               stored.created_unix_ms);
  restored.Restore(stored, absl::ZeroDuration());
  v1::Job proto;
  restored.ToProto(&proto);
  EXPECT_EQ(proto.state(), v1::RUNNING);
  EXPECT_EQ(proto.generation(), 1);
  EXPECT_EQ(proto.members_size(), 4);
  v1::GetCommIdRequest get;
  get.set_generation(1);
  get.set_rank(1);
  get.set_credential(credentials_[1]);  // credentials are hard state: they survive the restart
  std::optional<absl::StatusOr<std::string>> got;
  restored.GetCommId(get, absl::InfiniteFuture(), 1,
                     [&](absl::StatusOr<std::string> r) { got = std::move(r); });
  ASSERT_TRUE(got.has_value());
  ASSERT_TRUE(got->ok());
  EXPECT_EQ(**got, "blob");
}

// A paced job's planned rounds (tests/tools/paced_rounds_store_cases.h); the in-memory store is
// its own restart.
TEST(InMemoryStateStoreTest, PacedRounds_KeptInRoundOrder_DroppedFromTheFront_GoneWithTheJob) {
  InMemoryStateStore store;
  ::modelavg::testing::RunPacedRoundsCases(&store, [&store] { return &store; });
}

TEST(InMemoryStateStoreTest, PacedRounds_FailedWrite_LeavesNeitherRoundsNorMember) {
  InMemoryStateStore store;
  ASSERT_TRUE(store.CreateJob(Spec(), 1).ok());
  JobDelta kept;
  kept.paced_rounds.push_back(::modelavg::testing::MakePacedRound(0));
  ASSERT_TRUE(store.Apply("j", kept).ok());
  JobDelta delta;
  delta.members.push_back(Member{0, "w0", "h0", v1::ALIVE, 1});
  delta.paced_rounds.push_back(::modelavg::testing::MakePacedRound(1));
  delta.drop_paced_rounds_before = 1;
  store.FailWrites(absl::InternalError("disk full"));
  EXPECT_EQ(store.Apply("j", delta).code(), absl::StatusCode::kInternal);
  store.FailWrites(absl::OkStatus());
  StoredJob stored = ::modelavg::testing::LoadPacedJob(store, "j");
  EXPECT_TRUE(stored.members.empty());
  ::modelavg::testing::ExpectPacedRounds(stored.paced_rounds, {0});
  ASSERT_TRUE(store.Apply("j", delta).ok());
  stored = ::modelavg::testing::LoadPacedJob(store, "j");
  EXPECT_EQ(stored.members.size(), 1u);
  ::modelavg::testing::ExpectPacedRounds(stored.paced_rounds, {1});
}

}  // namespace
}  // namespace modelavg::server
