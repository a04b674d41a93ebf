// The coordinator core writes its hard state through a StateStore: what it writes at each
// transition, that steps and heartbeats write nothing, what a failed write does, and that a Job
// restored from the store continues where it was.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "common/job_spec.h"
#include "server/job.h"
#include "server/job_registry.h"
#include "server/state_store.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

v1::JobSpec Spec() {
  v1::JobSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(job_id: "j" mode: HIERARCHICAL world_size: 4
           levels { period: 2 group_size: 2 } levels { period: 4 group_size: 4 })pb",
      &spec));
  return spec;
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
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.header.generation, 2);
  EXPECT_EQ(stored.header.state, v1::PENDING);
  ASSERT_TRUE(stored.header.last_change.has_value());
  EXPECT_THAT(stored.header.last_change->reason(), HasSubstr("heartbeat timeout"));
  EXPECT_TRUE(stored.comm_ids.empty());
  for (const StoredMember& m : stored.members) EXPECT_EQ(m.state, v1::DEAD);
}

TEST_F(StateStoreTest, DeleteJob_RemovesItFromTheStore) {
  CreateJob();
  ASSERT_TRUE(registry_->DeleteJob("j").ok());
  EXPECT_TRUE(store_.LoadAll()->empty());
}

TEST_F(StateStoreTest, FailedWrites_FailTheRpcAndAreCarriedByTheNextWrite) {
  std::shared_ptr<Job> job = CreateJob();
  ASSERT_EQ(JoinAll(*job), 4);
  store_.FailWrites(absl::InternalError("disk full"));
  absl::Status s = Publish(*job, 1, "blob");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("disk full"));
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

  // The Leave happened in memory (generation 2); the store still says generation 1.
  EXPECT_EQ(Stored().header.generation, 1);

  store_.FailWrites(absl::OkStatus());
  v1::JoinRequest join;
  join.set_worker_id("w0");
  join.set_rank(0);
  job->Join(join, absl::InfiniteFuture(), registry_->NewWaitId(),
            [](absl::StatusOr<v1::JoinResponse>) {});
  const StoredJob stored = Stored();
  EXPECT_EQ(stored.header.generation, 2);
  ASSERT_EQ(stored.members.size(), 4u);
  EXPECT_EQ(stored.members[2].state, v1::LEFT);
  EXPECT_EQ(stored.members[0].generation, 2);
  EXPECT_TRUE(stored.comm_ids.empty());
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

}  // namespace
}  // namespace modelavg::server
