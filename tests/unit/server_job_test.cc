// The coordinator core with a fake clock: rendezvous, liveness, generations, comm ids, watchers.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::server {
namespace {

using ::modelavg::testing::SpecFromText;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kHeartbeatTimeout = absl::Seconds(3);
constexpr absl::Duration kJoinTimeout = absl::Seconds(60);

// Result slot of a Join or GetCommId callback.
template <typename T>
struct Slot {
  // Shared with the callback, so a wait completed after the test body (at teardown) is harmless.
  std::shared_ptr<std::optional<absl::StatusOr<T>>> state =
      std::make_shared<std::optional<absl::StatusOr<T>>>();
  std::optional<absl::StatusOr<T>>& result = *state;
  auto Callback() {
    return [s = state](absl::StatusOr<T> r) {
      EXPECT_FALSE(s->has_value()) << "completed twice";
      *s = std::move(r);
    };
  }
  bool done() const { return result.has_value(); }
  absl::StatusCode code() const { return result->status().code(); }
  std::string message() const { return std::string(result->status().message()); }
};

class RecordingWatcher final : public JobWatcher {
 public:
  void OnEvent(const v1::JobEvent& event) override {
    absl::MutexLock lock(&mu_);
    kinds_.push_back(event.kind());
  }
  void OnClosed(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    closed_ = status;
  }
  std::vector<v1::JobEvent::Kind> kinds() {
    absl::MutexLock lock(&mu_);
    return kinds_;
  }
  std::optional<absl::Status> closed() {
    absl::MutexLock lock(&mu_);
    return closed_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::JobEvent::Kind> kinds_;
  std::optional<absl::Status> closed_;
};

class JobTest : public ::testing::Test {
 protected:
  JobTest() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.defaults.heartbeat_timeout = kHeartbeatTimeout;
    options.defaults.join_timeout = kJoinTimeout;
    registry_ = std::make_unique<JobRegistry>(options);
  }

  // A hierarchical job: world 4, levels (period 2, groups of 2), (period 4, world).
  std::shared_ptr<Job> MakeJob(int world = 4) {
    v1::JobSpec spec = SpecFromText(absl::StrCat(
        R"pb(job_id: "j" mode: HIERARCHICAL levels { period: 2 group_size: 2 } )pb",
        "world_size: ", world, " levels { period: 4 group_size: ", world, " }"));
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    return *registry_->Find("j");
  }

  void Join(Job& job, const std::string& worker, std::optional<int> rank,
            Slot<v1::JoinResponse>* slot, absl::Time deadline = absl::InfiniteFuture()) {
    v1::JoinRequest request;
    request.set_job_id(job.id());
    request.set_worker_id(worker);
    request.set_host("host");
    if (rank.has_value()) request.set_rank(*rank);
    // Each rank's credential, as its member would keep it.
    job.Join(request, deadline, registry_->NewWaitId(),
             [this, cb = slot->Callback()](absl::StatusOr<v1::JoinResponse> r) mutable {
               if (r.ok()) credentials_[r->rank()] = r->credential();
               cb(std::move(r));
             });
  }

  // A re-join by the holder of `holder`'s rank, proving it with that member's credential
  // (a restart); asks for `rank` (nullopt: finds its rank by the credential).
  void Rejoin(Job& job, const std::string& worker, std::optional<int> rank, int holder,
              Slot<v1::JoinResponse>* slot) {
    v1::JoinRequest request;
    request.set_job_id(job.id());
    request.set_worker_id(worker);
    request.set_host("host");
    if (rank.has_value()) request.set_rank(*rank);
    request.set_credential(credentials_[holder]);
    job.Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
             [this, cb = slot->Callback()](absl::StatusOr<v1::JoinResponse> r) mutable {
               if (r.ok()) credentials_[r->rank()] = r->credential();
               cb(std::move(r));
             });
  }

  // Joins every rank (worker "w<r>" asks for rank r) and checks the world completes.
  void JoinAll(Job& job, int world, std::vector<Slot<v1::JoinResponse>>* slots) {
    slots->resize(world);
    for (int r = 0; r < world; ++r) Join(job, absl::StrCat("w", r), r, &(*slots)[r]);
    for (int r = 0; r < world; ++r) ASSERT_TRUE((*slots)[r].done() && (*slots)[r].result->ok());
  }

  absl::Status Heartbeat(Job& job, int rank, int64_t generation, int64_t step,
                         v1::HeartbeatResponse* response = nullptr) {
    v1::HeartbeatRequest request;
    request.set_job_id(job.id());
    request.set_rank(rank);
    request.set_generation(generation);
    request.set_step(step);
    request.set_credential(credentials_[rank]);
    v1::HeartbeatResponse ignored;
    return job.Heartbeat(request, response != nullptr ? response : &ignored);
  }

  absl::Status Step(Job& job, int rank, int64_t generation, int64_t step,
                    v1::StepDecision* decision = nullptr) {
    v1::StepRequest request;
    request.set_job_id(job.id());
    request.set_rank(rank);
    request.set_generation(generation);
    request.set_step(step);
    request.set_credential(credentials_[rank]);
    v1::StepDecision ignored;
    return job.Step(request, decision != nullptr ? decision : &ignored);
  }

  absl::Status Publish(Job& job, int64_t generation, int level, int subgroup, int rank,
                       const std::string& blob, const std::string& key = "") {
    v1::PublishCommIdRequest request;
    request.set_job_id(job.id());
    request.set_generation(generation);
    request.set_level(level);
    request.set_subgroup(subgroup);
    request.set_rank(rank);
    request.set_unique_id(blob);
    request.set_key(key);
    request.set_credential(credentials_[rank]);
    return job.PublishCommId(request);
  }

  void GetCommId(Job& job, int64_t generation, int level, int subgroup, int rank,
                 Slot<std::string>* slot, int64_t timeout_ms = 0, const std::string& key = "") {
    v1::GetCommIdRequest request;
    request.set_job_id(job.id());
    request.set_generation(generation);
    request.set_level(level);
    request.set_subgroup(subgroup);
    request.set_rank(rank);
    request.set_key(key);
    request.set_timeout_ms(timeout_ms);
    request.set_credential(credentials_[rank]);
    job.GetCommId(request, absl::InfiniteFuture(), registry_->NewWaitId(), slot->Callback());
  }

  absl::Status Leave(Job& job, int rank, int64_t generation, v1::LeaveResponse* response) {
    v1::LeaveRequest request;
    request.set_job_id(job.id());
    request.set_rank(rank);
    request.set_generation(generation);
    request.set_reason("done");
    request.set_credential(credentials_[rank]);
    return job.Leave(request, response);
  }

  v1::Job Snapshot(const Job& job) {
    v1::Job proto;
    job.ToProto(&proto);
    return proto;
  }

  FakeClock clock_;
  std::unique_ptr<JobRegistry> registry_;
  // rank -> the credential of its latest completed Join.
  std::map<int, std::string> credentials_;
};

// ---------------------------------------------------------------------------------- CreateJob

TEST_F(JobTest, CreateJob_Valid_StartsPendingAtGenerationOne) {
  v1::Job job;
  ASSERT_TRUE(registry_
                  ->CreateJob(SpecFromText(R"pb(job_id: "a" world_size: 2 mode: PERIODIC
                                        levels { period: 4 group_size: 2 })pb"),
                              &job)
                  .ok());
  EXPECT_EQ(job.state(), v1::PENDING);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.members_size(), 0);
  EXPECT_EQ(job.spec().heartbeat_timeout_ms(), 3000);  // the default filled in
  EXPECT_EQ(job.min_step(), -1);
}

TEST_F(JobTest, CreateJob_Duplicate_AlreadyExists) {
  MakeJob();
  v1::JobSpec spec = SpecFromText(R"pb(job_id: "j" world_size: 2 mode: PERIODIC
                               levels { period: 4 group_size: 2 })pb");
  EXPECT_EQ(registry_->CreateJob(spec, nullptr).code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(JobTest, CreateJob_InvalidSpecs_InvalidArgumentNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"pb(job_id: "" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 })pb",
       "job_id"},
      {R"pb(job_id: "a b" world_size: 2 mode: PERIODIC levels { period: 1 group_size: 2 })pb",
       "job_id"},
      {R"pb(job_id: "a" world_size: 0 mode: PERIODIC levels { period: 1 group_size: 2 })pb",
       "world_size"},
      {R"pb(job_id: "a" world_size: 2 levels { period: 1 group_size: 2 })pb", "mode"},
      {R"pb(job_id: "a" world_size: 2 mode: PERIODIC)pb", "level"},
      {R"pb(job_id: "a" world_size: 2 mode: PERIODIC levels { period: 0 group_size: 2 })pb",
       "period"},
      {R"pb(job_id: "a" world_size: 4 mode: HIERARCHICAL levels { period: 1 group_size: 3 }
            levels { period: 2 group_size: 4 })pb",
       "group_size"},
      {R"pb(job_id: "a" world_size: 2 warmup_steps: -1 mode: PERIODIC
            levels { period: 1 group_size: 2 })pb",
       "warmup_steps"},
      {R"pb(job_id: "a" world_size: 2 mode: PERIODIC heartbeat_timeout_ms: -5
            levels { period: 1 group_size: 2 })pb",
       "heartbeat_timeout_ms"},
      {R"pb(job_id: "a" world_size: 2 mode: PERIODIC join_timeout_ms: 999999999999
            levels { period: 1 group_size: 2 })pb",
       "join_timeout_ms"},
  };
  for (const auto& [text, field] : cases) {
    absl::Status s = registry_->CreateJob(SpecFromText(text), nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(s.message()), HasSubstr(field)) << text;
  }
  EXPECT_TRUE(registry_->ListJobs().empty());
}

TEST_F(JobTest, CreateJob_TooManyRanksInAll_ResourceExhaustedUntilDeleted) {
  const std::string big = R"pb(world_size: 65536 mode: PERIODIC
                               levels { period: 1 group_size: 65536 })pb";
  const int fit = static_cast<int>(kMaxTotalWorldSize / 65536);
  for (int i = 0; i < fit; ++i) {
    ASSERT_TRUE(
        registry_->CreateJob(SpecFromText(absl::StrCat("job_id: \"b", i, "\" ", big)), nullptr)
            .ok());
  }
  const v1::JobSpec one_more = SpecFromText(absl::StrCat("job_id: \"one-more\" ", big));
  absl::Status s = registry_->CreateJob(one_more, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("delete finished jobs"));
  ASSERT_TRUE(registry_->DeleteJob("b0").ok());
  EXPECT_TRUE(registry_->CreateJob(one_more, nullptr).ok());
}

TEST_F(JobTest, Find_UnknownJob_NotFound) {
  EXPECT_EQ(registry_->Find("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_->DeleteJob("nope").code(), absl::StatusCode::kNotFound);
}

// ------------------------------------------------------------------------------------- Join

TEST_F(JobTest, Join_AllRanksJoin_CompletesWithRankAndSubgroups) {
  auto job = MakeJob();
  std::vector<Slot<v1::JoinResponse>> slots(4);
  for (int r = 0; r < 3; ++r) Join(*job, absl::StrCat("w", r), std::nullopt, &slots[r]);
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(slots[r].done());
  EXPECT_EQ(Snapshot(*job).state(), v1::PENDING);
  Join(*job, "w3", std::nullopt, &slots[3]);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(slots[r].done());
    ASSERT_TRUE(slots[r].result->ok()) << slots[r].result->status();
    const v1::JoinResponse& resp = **slots[r].result;
    EXPECT_EQ(resp.rank(), r);
    EXPECT_EQ(resp.world_size(), 4);
    EXPECT_EQ(resp.generation(), 1);
    EXPECT_EQ(resp.spec().job_id(), "j");
    ASSERT_EQ(resp.subgroups_size(), 2);
    EXPECT_EQ(resp.subgroups(0).subgroup(), r / 2);
    EXPECT_EQ(resp.subgroups(0).ranks_size(), 2);
    EXPECT_EQ(resp.subgroups(0).ranks(0), (r / 2) * 2);
    EXPECT_THAT(resp.subgroups(1).ranks(), ElementsAre(0, 1, 2, 3));
  }
  const v1::Job snap = Snapshot(*job);
  EXPECT_EQ(snap.state(), v1::RUNNING);
  ASSERT_EQ(snap.members_size(), 4);
  EXPECT_EQ(snap.members(2).worker_id(), "w2");
  EXPECT_EQ(snap.members(2).state(), v1::ALIVE);
}

TEST_F(JobTest, Join_SubgroupRanksFromSpec_ReplyListsNoRanksToThoseWhoAsked) {
  // Ranks 1 and 3 take their subgroups' ranks from the spec; 0 and 2 get them listed as ever.
  auto job = MakeJob();
  std::vector<Slot<v1::JoinResponse>> slots(4);
  for (int r = 0; r < 4; ++r) {
    v1::JoinRequest request;
    request.set_job_id(job->id());
    request.set_worker_id(absl::StrCat("w", r));
    request.set_rank(r);
    request.set_subgroup_ranks_from_spec(r % 2 == 1);
    job->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(), slots[r].Callback());
  }
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(slots[r].done());
    ASSERT_TRUE(slots[r].result->ok()) << slots[r].result->status();
    const v1::JoinResponse& resp = **slots[r].result;
    EXPECT_EQ(resp.rank(), r);
    ASSERT_EQ(resp.subgroups_size(), 2);
    EXPECT_EQ(resp.subgroups(0).subgroup(), r / 2);
    EXPECT_EQ(resp.subgroups(0).period(), 2);
    EXPECT_EQ(resp.subgroups(1).subgroup(), 0);
    if (r % 2 == 1) {
      EXPECT_EQ(resp.subgroups(0).ranks_size(), 0);
      EXPECT_EQ(resp.subgroups(1).ranks_size(), 0);
    } else {
      EXPECT_THAT(resp.subgroups(0).ranks(), ElementsAre((r / 2) * 2, (r / 2) * 2 + 1));
      EXPECT_THAT(resp.subgroups(1).ranks(), ElementsAre(0, 1, 2, 3));
    }
  }
}

TEST_F(JobTest, Join_Timeout_DeadlineExceededNamingMissingRanks) {
  auto job = MakeJob();
  Slot<v1::JoinResponse> a, b;
  Join(*job, "w0", 0, &a);
  Join(*job, "w1", 1, &b, clock_.Now() + absl::Seconds(100));
  clock_.Advance(kJoinTimeout - absl::Seconds(1));
  registry_->CheckStaleness();
  EXPECT_FALSE(a.done());
  clock_.Advance(absl::Seconds(2));
  registry_->CheckStaleness();
  ASSERT_TRUE(a.done());
  EXPECT_EQ(a.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(a.message(), HasSubstr("missing ranks: 2, 3"));
  EXPECT_THAT(a.message(), HasSubstr("2 of 4"));
  ASSERT_TRUE(b.done());
  EXPECT_EQ(b.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(JobTest, Join_CallDeadlineBeforeJoinTimeout_UsesCallDeadline) {
  auto job = MakeJob();
  Slot<v1::JoinResponse> a;
  Join(*job, "w0", 0, &a, clock_.Now() + absl::Seconds(5));
  clock_.Advance(absl::Seconds(6));
  registry_->CheckStaleness();
  ASSERT_TRUE(a.done());
  EXPECT_EQ(a.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(JobTest, Join_AfterTimeout_RankIsFreeAndWorkerCanRetry) {
  auto job = MakeJob(2);
  Slot<v1::JoinResponse> a, retry, b;
  Join(*job, "w0", 0, &a);
  clock_.Advance(kJoinTimeout + absl::Seconds(1));
  registry_->CheckStaleness();
  ASSERT_EQ(a.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Snapshot(*job).members_size(), 0);
  Join(*job, "other", 0, &retry);  // rank 0 is free again
  Join(*job, "w1", 1, &b);
  ASSERT_TRUE(retry.done() && retry.result->ok());
  EXPECT_EQ((*retry.result)->rank(), 0);
}

TEST_F(JobTest, Join_RequestedRankTaken_AlreadyExists) {
  auto job = MakeJob();
  Slot<v1::JoinResponse> a, b;
  Join(*job, "w0", 2, &a);
  Join(*job, "w1", 2, &b);
  ASSERT_TRUE(b.done());
  EXPECT_EQ(b.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(b.message(), HasSubstr("rank 2"));
  EXPECT_THAT(b.message(), HasSubstr("w0"));
  EXPECT_FALSE(a.done());
}

TEST_F(JobTest, Join_NoRank_GetsLowestFreeRank) {
  auto job = MakeJob();
  std::vector<Slot<v1::JoinResponse>> s(4);
  Join(*job, "a", 0, &s[0]);
  Join(*job, "b", 2, &s[1]);
  Join(*job, "c", std::nullopt, &s[2]);
  Join(*job, "d", std::nullopt, &s[3]);
  for (auto& slot : s) ASSERT_TRUE(slot.done() && slot.result->ok());
  EXPECT_EQ((*s[2].result)->rank(), 1);
  EXPECT_EQ((*s[3].result)->rank(), 3);
}

TEST_F(JobTest, Join_SameWorkerTwice_NewerCallWins) {
  auto job = MakeJob(2);
  Slot<v1::JoinResponse> first, second, other;
  Join(*job, "w0", std::nullopt, &first);
  Join(*job, "w0", std::nullopt, &second);
  ASSERT_TRUE(first.done());
  EXPECT_EQ(first.code(), absl::StatusCode::kAborted);
  Join(*job, "w1", std::nullopt, &other);
  ASSERT_TRUE(second.done() && second.result->ok());
  EXPECT_EQ((*second.result)->rank(), 0);
  EXPECT_EQ((*other.result)->rank(), 1);
}

TEST_F(JobTest, Join_InvalidRequests_InvalidArgument) {
  auto job = MakeJob();
  Slot<v1::JoinResponse> bad_rank, negative, no_worker;
  Join(*job, "w", 4, &bad_rank);
  Join(*job, "w", -1, &negative);
  Join(*job, "", std::nullopt, &no_worker);
  EXPECT_EQ(bad_rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_rank.message(), HasSubstr("rank 4 is outside [0, 4)"));
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(no_worker.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_worker.message(), HasSubstr("worker_id"));
}

TEST_F(JobTest, Join_RunningJobNewWorker_FailedPrecondition) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  Slot<v1::JoinResponse> extra;
  Join(*job, "stranger", std::nullopt, &extra);
  ASSERT_TRUE(extra.done());
  EXPECT_EQ(extra.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Snapshot(*job).generation(), 1);
}

TEST_F(JobTest, Join_RejoinWhileRunning_BumpsGenerationAndRestartsRound) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  Slot<v1::JoinResponse> rejoin, survivor;
  Rejoin(*job, "w1-restarted", 1, 1, &rejoin);
  EXPECT_FALSE(rejoin.done());
  v1::Job snap = Snapshot(*job);
  EXPECT_EQ(snap.generation(), 2);
  EXPECT_EQ(snap.state(), v1::PENDING);
  EXPECT_EQ(snap.last_change().reason(), "rank 1 re-joined");
  EXPECT_EQ(snap.last_change().rank(), 1);
  EXPECT_EQ(Step(*job, 0, 1, 5).code(), absl::StatusCode::kFailedPrecondition);
  Join(*job, "w0", 0, &survivor);
  ASSERT_TRUE(rejoin.done() && rejoin.result->ok());
  EXPECT_EQ((*rejoin.result)->generation(), 2);
  EXPECT_EQ((*survivor.result)->generation(), 2);
  EXPECT_EQ(Snapshot(*job).state(), v1::RUNNING);
}

TEST_F(JobTest, Join_RejoinByWorkerId_KeepsRank) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  Slot<v1::JoinResponse> rejoin, survivor;
  Rejoin(*job, "w1", std::nullopt, 1, &rejoin);
  Join(*job, "w0", std::nullopt, &survivor);
  ASSERT_TRUE(rejoin.done() && rejoin.result->ok());
  EXPECT_EQ((*rejoin.result)->rank(), 1);
  EXPECT_EQ((*survivor.result)->rank(), 0);
  EXPECT_EQ((*survivor.result)->generation(), 2);
}

TEST_F(JobTest, CancelWait_PendingJoin_CancelledAndRankFreed) {
  auto job = MakeJob(2);
  v1::JoinRequest request;
  request.set_job_id("j");
  request.set_worker_id("w0");
  request.set_rank(0);
  Slot<v1::JoinResponse> a, b, c;
  const WaitId id = registry_->NewWaitId();
  job->Join(request, absl::InfiniteFuture(), id, a.Callback());
  job->CancelWait(id);
  ASSERT_TRUE(a.done());
  EXPECT_EQ(a.code(), absl::StatusCode::kCancelled);
  Join(*job, "x", 0, &b);  // no ALREADY_EXISTS: the rank was freed
  Join(*job, "y", 1, &c);
  EXPECT_TRUE(b.done() && b.result->ok());
  job->CancelWait(id);  // a completed wait: no effect
}

// ------------------------------------------------------------------- Heartbeat and liveness

TEST_F(JobTest, Heartbeat_MissedWhileRunning_BumpsGenerationAndAbortsWaits) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  Slot<std::string> waiting;
  GetCommId(*job, 1, 1, 0, 1, &waiting);
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(Heartbeat(*job, 1, 1, i).ok());
    registry_->CheckStaleness();
  }
  ASSERT_TRUE(waiting.done());
  EXPECT_EQ(waiting.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(waiting.message(), HasSubstr("rank 0 heartbeat timeout"));
  v1::Job snap = Snapshot(*job);
  EXPECT_EQ(snap.generation(), 2);
  EXPECT_EQ(snap.state(), v1::PENDING);
  EXPECT_EQ(snap.members(0).state(), v1::DEAD);
  EXPECT_EQ(snap.last_change().rank(), 0);
  // The survivor learns it from its next heartbeat, which does not fail.
  v1::HeartbeatResponse hb;
  ASSERT_TRUE(Heartbeat(*job, 1, 1, 10, &hb).ok());
  EXPECT_EQ(hb.generation(), 2);
  EXPECT_EQ(hb.state(), v1::PENDING);
  EXPECT_EQ(hb.last_change().reason(), "rank 0 heartbeat timeout");
  // ... and Step says why it is stale.
  absl::Status step = Step(*job, 1, 1, 11);
  EXPECT_EQ(step.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(step.message()),
              HasSubstr("generation 1 is stale; job j is at generation 2 since rank 0 "
                        "heartbeat timeout; re-join"));
}

TEST_F(JobTest, Heartbeat_WhilePending_NoTimeout) {
  auto job = MakeJob(2);
  Slot<v1::JoinResponse> a;
  Join(*job, "w0", 0, &a);
  clock_.Advance(kHeartbeatTimeout * 5);
  registry_->CheckStaleness();
  EXPECT_EQ(Snapshot(*job).generation(), 1);
  EXPECT_FALSE(a.done());
}

TEST_F(JobTest, Heartbeat_RecordsStepsAndLag) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  ASSERT_TRUE(Heartbeat(*job, 0, 1, 7).ok());
  ASSERT_TRUE(Step(*job, 1, 1, 12).ok());
  clock_.Advance(absl::Milliseconds(250));
  v1::Job snap = Snapshot(*job);
  EXPECT_EQ(snap.min_step(), 7);
  EXPECT_EQ(snap.max_step(), 12);
  EXPECT_EQ(snap.members(1).last_step(), 12);
  EXPECT_EQ(snap.members(0).ms_since_heartbeat(), 250);
  EXPECT_EQ(job->GetStats().step_lag, 5);
}

TEST_F(JobTest, Heartbeat_BadRankOrStep_InvalidArgument) {
  auto job = MakeJob(2);
  EXPECT_EQ(Heartbeat(*job, 2, 1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Heartbeat(*job, -1, 1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Heartbeat(*job, 0, 1, -3).code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------- Step

TEST_F(JobTest, Step_Running_ReturnsTheScheduleDecision) {
  auto job = MakeJob(4);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 4, &slots);
  v1::StepDecision d;
  ASSERT_TRUE(Step(*job, 3, 1, 2, &d).ok());
  EXPECT_EQ(d.action(), v1::AVERAGE);
  EXPECT_EQ(d.level(), 0);
  EXPECT_EQ(d.subgroup(), 1);
  EXPECT_THAT(d.ranks(), ElementsAre(2, 3));
  EXPECT_EQ(d.generation(), 1);
  ASSERT_TRUE(Step(*job, 3, 1, 4, &d).ok());
  EXPECT_EQ(d.level(), 1);
  EXPECT_THAT(d.ranks(), ElementsAre(0, 1, 2, 3));
  ASSERT_TRUE(Step(*job, 3, 1, 3, &d).ok());
  EXPECT_EQ(d.action(), v1::SKIP);
}

TEST_F(JobTest, Step_BadInput_Errors) {
  auto job = MakeJob(2);
  EXPECT_EQ(Step(*job, 0, 1, 0).code(), absl::StatusCode::kFailedPrecondition);  // PENDING
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  EXPECT_EQ(Step(*job, 0, 1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Step(*job, 5, 1, 0).code(), absl::StatusCode::kInvalidArgument);
  absl::Status future = Step(*job, 0, 7, 0);
  EXPECT_EQ(future.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(future.message()), HasSubstr("at generation 1"));
}

// -------------------------------------------------------------------------------- GetSchedule

TEST_F(JobTest, GetSchedule_Bounds_InvalidArgument) {
  auto job = MakeJob(4);
  auto get = [&](int64_t from, int64_t count, std::optional<int> rank) {
    v1::GetScheduleRequest request;
    request.set_job_id("j");
    request.set_from_step(from);
    request.set_count(count);
    if (rank) request.set_rank(*rank);
    v1::GetScheduleResponse response;
    return job->GetSchedule(request, &response);
  };
  EXPECT_EQ(get(0, 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(get(0, 100001, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(get(0, -5, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(get(-1, 10, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(get(0, 10, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(get(INT64_MAX - 3, 10, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(get(0, 100000, 0).ok());
  EXPECT_TRUE(get(0, 100000, std::nullopt).ok());
}

TEST_F(JobTest, GetSchedule_AllSubgroups_OneDecisionPerSubgroup) {
  auto job = MakeJob(4);
  v1::GetScheduleRequest request;
  request.set_job_id("j");
  request.set_from_step(1);
  request.set_count(2);  // step 1: SKIP, step 2: two subgroups of level 0
  v1::GetScheduleResponse response;
  ASSERT_TRUE(job->GetSchedule(request, &response).ok());
  ASSERT_EQ(response.decisions_size(), 3);
  EXPECT_EQ(response.decisions(0).action(), v1::SKIP);
  EXPECT_THAT(response.decisions(1).ranks(), ElementsAre(0, 1));
  EXPECT_THAT(response.decisions(2).ranks(), ElementsAre(2, 3));
  EXPECT_EQ(response.generation(), 1);
}

TEST_F(JobTest, GetSchedule_HugeReply_InvalidArgumentInsteadOfOversizeMessage) {
  ASSERT_TRUE(registry_
                  ->CreateJob(SpecFromText(R"pb(job_id: "big" world_size: 65536 mode: PERIODIC
                                        levels { period: 1 group_size: 65536 })pb"),
                              nullptr)
                  .ok());
  auto job = *registry_->Find("big");
  v1::GetScheduleRequest request;
  request.set_job_id("big");
  request.set_count(100000);
  v1::GetScheduleResponse response;
  absl::Status s = job->GetSchedule(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("smaller count"));
}

// --------------------------------------------------------------------------------- Comm ids

class CommIdTest : public JobTest {
 protected:
  void SetUp() override {
    job_ = MakeJob(4);
    JoinAll(*job_, 4, &slots_);
  }
  std::shared_ptr<Job> job_;
  std::vector<Slot<v1::JoinResponse>> slots_;
};

TEST_F(CommIdTest, PublishCommId_ThenGet_ReturnsTheBytes) {
  const std::string blob(128, '\x7f');
  ASSERT_TRUE(Publish(*job_, 1, 0, 1, 2, blob).ok());
  Slot<std::string> got;
  GetCommId(*job_, 1, 0, 1, 3, &got);
  ASSERT_TRUE(got.done() && got.result->ok());
  EXPECT_EQ(**got.result, blob);
}

TEST_F(CommIdTest, GetCommId_BeforePublish_CompletesOnPublish) {
  Slot<std::string> got, other_key;
  GetCommId(*job_, 1, 1, 0, 3, &got);
  GetCommId(*job_, 1, 1, 0, 2, &other_key, 0, "gloo/0");
  EXPECT_FALSE(got.done());
  ASSERT_TRUE(Publish(*job_, 1, 1, 0, 0, "abc").ok());
  ASSERT_TRUE(got.done() && got.result->ok());
  EXPECT_EQ(**got.result, "abc");
  EXPECT_FALSE(other_key.done());
  ASSERT_TRUE(Publish(*job_, 1, 1, 0, 0, "xyz", "gloo/0").ok());
  ASSERT_TRUE(other_key.done());
  EXPECT_EQ(**other_key.result, "xyz");
}

TEST_F(CommIdTest, GetCommId_NothingPublished_DeadlineExceeded) {
  Slot<std::string> got, defaulted;
  GetCommId(*job_, 1, 0, 0, 1, &got, /*timeout_ms=*/500);
  GetCommId(*job_, 1, 0, 0, 0, &defaulted, /*timeout_ms=*/0);  // capped by the join timeout
  clock_.Advance(absl::Milliseconds(400));
  registry_->CheckStaleness();
  EXPECT_FALSE(got.done());
  clock_.Advance(absl::Milliseconds(200));
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(Heartbeat(*job_, r, 1, 0).ok());
  registry_->CheckStaleness();
  ASSERT_TRUE(got.done());
  EXPECT_EQ(got.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.message(), HasSubstr("is rank 0 (the subgroup's leader) alive?"));
  EXPECT_FALSE(defaulted.done());
  Slot<std::string> negative;
  GetCommId(*job_, 1, 0, 0, 1, &negative, -1);
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CommIdTest, GetCommId_OutsideSubgroup_PermissionDenied) {
  ASSERT_TRUE(Publish(*job_, 1, 0, 0, 0, "id").ok());
  Slot<std::string> got;
  GetCommId(*job_, 1, 0, 0, 3, &got);  // rank 3 is in subgroup 1 at level 0
  ASSERT_TRUE(got.done());
  EXPECT_EQ(got.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Publish(*job_, 1, 0, 1, 0, "id").code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CommIdTest, PublishCommId_BadInput_Errors) {
  EXPECT_EQ(Publish(*job_, 1, 0, 0, 0, std::string(4097, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Publish(*job_, 1, 0, 0, 0, std::string(4096, 'x')).ok());
  EXPECT_EQ(Publish(*job_, 1, 0, 0, 0, "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(*job_, 1, 2, 0, 0, "a").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(*job_, 1, 0, 2, 0, "a").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(*job_, 1, 0, 0, 9, "a").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(*job_, 1, 0, 0, 0, "a", std::string(257, 'k')).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Publish(*job_, 2, 0, 0, 0, "a").code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CommIdTest, PublishCommId_SameKeyTwice_IdenticalOkDifferentAlreadyExists) {
  ASSERT_TRUE(Publish(*job_, 1, 1, 0, 0, "same").ok());
  EXPECT_TRUE(Publish(*job_, 1, 1, 0, 0, "same").ok());
  EXPECT_EQ(Publish(*job_, 1, 1, 0, 1, "different").code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(CommIdTest, GetCommId_StaleGeneration_FailedPreconditionAndOldIdsDiscarded) {
  ASSERT_TRUE(Publish(*job_, 1, 1, 0, 0, "gen1").ok());
  Slot<std::string> rejoin;
  Slot<v1::JoinResponse> j;
  Rejoin(*job_, "w2", 2, 2, &j);  // re-join by the holder: generation 2
  Slot<std::string> stale;
  GetCommId(*job_, 1, 1, 0, 1, &stale);
  ASSERT_TRUE(stale.done());
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.message(), HasSubstr("generation 1 is stale"));
  std::vector<Slot<v1::JoinResponse>> others(3);
  Join(*job_, "w0", 0, &others[0]);
  Join(*job_, "w1", 1, &others[1]);
  Join(*job_, "w3", 3, &others[2]);
  ASSERT_TRUE(j.done() && j.result->ok());
  Slot<std::string> fresh;
  GetCommId(*job_, 2, 1, 0, 1, &fresh, 100);
  EXPECT_FALSE(fresh.done());  // generation 1's id is gone
}

// ------------------------------------------------------------------------------------ Leave

TEST_F(JobTest, Leave_OneOfTwo_BumpsGenerationThenLastFinishes) {
  auto job = MakeJob(2);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  v1::LeaveResponse response;
  ASSERT_TRUE(Leave(*job, 0, 1, &response).ok());
  EXPECT_EQ(response.generation(), 2);
  EXPECT_EQ(response.state(), v1::PENDING);
  EXPECT_THAT(Snapshot(*job).last_change().reason(), HasSubstr("rank 0 left (done)"));
  ASSERT_TRUE(Leave(*job, 1, 1, &response).ok());  // stale generation is accepted
  EXPECT_EQ(response.state(), v1::FINISHED);
  EXPECT_EQ(response.generation(), 2);
  Slot<v1::JoinResponse> late;
  Join(*job, "late", std::nullopt, &late);
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(JobTest, Leave_NeverJoinedOrBadRank_Errors) {
  auto job = MakeJob(2);
  v1::LeaveResponse response;
  // A rank without a member has no credential to present.
  EXPECT_EQ(Leave(*job, 1, 1, &response).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Leave(*job, 7, 1, &response).code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------- DeleteJob, Stop, Watch

TEST_F(JobTest, DeleteJob_WithWaiters_AbortsThemAndClosesWatchers) {
  auto job = MakeJob(2);
  auto watcher = std::make_shared<RecordingWatcher>();
  job->Watch(watcher);
  Slot<v1::JoinResponse> waiting;
  Join(*job, "w0", 0, &waiting);
  ASSERT_TRUE(registry_->DeleteJob("j").ok());
  ASSERT_TRUE(waiting.done());
  EXPECT_EQ(waiting.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(waiting.message(), HasSubstr("deleted"));
  EXPECT_EQ(registry_->Find("j").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(watcher->kinds(), ElementsAre(v1::JobEvent::SNAPSHOT, v1::JobEvent::MEMBER_JOINED,
                                            v1::JobEvent::JOB_DELETED));
  ASSERT_TRUE(watcher->closed().has_value());
  EXPECT_EQ(watcher->closed()->code(), absl::StatusCode::kAborted);
  Slot<v1::JoinResponse> after;
  Join(*job, "w1", 1, &after);  // someone still holding the Job gets the same answer
  EXPECT_EQ(after.code(), absl::StatusCode::kAborted);
}

TEST_F(JobTest, Stop_WithWaiters_Unavailable) {
  auto job = MakeJob(2);
  Slot<v1::JoinResponse> waiting;
  Join(*job, "w0", 0, &waiting);
  registry_->Stop();
  ASSERT_TRUE(waiting.done());
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(registry_->Find("j").status().code(), absl::StatusCode::kUnavailable);
  v1::Job out;
  EXPECT_EQ(registry_->CreateJob(SpecFromText(R"pb(job_id: "x" world_size: 1 mode: PERIODIC
                                           levels { period: 1 group_size: 1 })pb"),
                                 &out)
                .code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(JobTest, Watch_Lifecycle_SnapshotFirstThenEventsInOrder) {
  auto job = MakeJob(2);
  auto watcher = std::make_shared<RecordingWatcher>();
  job->Watch(watcher);
  std::vector<Slot<v1::JoinResponse>> slots;
  JoinAll(*job, 2, &slots);
  v1::LeaveResponse response;
  ASSERT_TRUE(Leave(*job, 0, 1, &response).ok());
  ASSERT_TRUE(Leave(*job, 1, 1, &response).ok());
  EXPECT_THAT(watcher->kinds(),
              ElementsAre(v1::JobEvent::SNAPSHOT, v1::JobEvent::MEMBER_JOINED,
                          v1::JobEvent::MEMBER_JOINED, v1::JobEvent::WORLD_COMPLETE,
                          v1::JobEvent::GENERATION_CHANGED, v1::JobEvent::JOB_FINISHED));
}

TEST_F(JobTest, StalenessThread_RealClock_ExpiresWaits) {
  JobRegistryOptions options;
  options.staleness_interval = absl::Milliseconds(5);
  JobRegistry registry(options);
  ASSERT_TRUE(registry
                  .CreateJob(SpecFromText(R"pb(job_id: "t" world_size: 2 mode: PERIODIC
                                       join_timeout_ms: 1000 levels { period: 1 group_size: 2 })pb"),
                             nullptr)
                  .ok());
  absl::Notification done;
  absl::Status status;
  v1::JoinRequest request;
  request.set_job_id("t");
  request.set_worker_id("w");
  (*registry.Find("t"))
      ->Join(request, absl::InfiniteFuture(), registry.NewWaitId(),
             [&](absl::StatusOr<v1::JoinResponse> r) {
               status = r.status();
               done.Notify();
             });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace modelavg::server
