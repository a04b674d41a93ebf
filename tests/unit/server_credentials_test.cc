// Per-member credentials in the coordinator core (fake clock): each rank-scoped call without a
// credential, with another rank's and with the right one; Join of a live rank; the credential
// kept only as a digest, stored, and surviving a restart.
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/membership/member_credential.h"
#include "server/store/state_store.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class CredentialTest : public ::testing::Test {
 protected:
  CredentialTest() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.store = &store_;
    registry_ = std::make_unique<JobRegistry>(options);
    v1::JobSpec spec;
    spec.set_job_id("j");
    spec.set_world_size(2);
    spec.set_mode(v1::PERIODIC);
    spec.add_levels()->set_period(1);
    spec.mutable_levels(0)->set_group_size(2);
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    job_ = *registry_->Find("j");
    for (int r = 0; r < 2; ++r) Join(r, absl::StrCat("w", r), "", &joined_[r]);
    EXPECT_TRUE(joined_[0].has_value() && joined_[0]->ok());
    EXPECT_TRUE(joined_[1].has_value() && joined_[1]->ok());
  }

  void Join(int rank, const std::string& worker, const std::string& credential,
            std::optional<absl::StatusOr<v1::JoinResponse>>* out) {
    v1::JoinRequest request;
    request.set_job_id("j");
    request.set_worker_id(worker);
    request.set_rank(rank);
    request.set_credential(credential);
    job_->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
               [out](absl::StatusOr<v1::JoinResponse> r) { *out = std::move(r); });
  }
  std::string Credential(int rank) { return (*joined_[rank])->credential(); }

  absl::Status Heartbeat(int rank, const std::string& credential, int64_t step) {
    v1::HeartbeatRequest request;
    request.set_rank(rank);
    request.set_generation(1);
    request.set_step(step);
    request.set_credential(credential);
    v1::HeartbeatResponse response;
    return job_->Heartbeat(request, &response);
  }
  absl::Status Publish(int rank, const std::string& credential, const std::string& blob) {
    v1::PublishCommIdRequest request;
    request.set_generation(job_generation());
    request.set_rank(rank);
    request.set_unique_id(blob);
    request.set_credential(credential);
    return job_->PublishCommId(request);
  }
  absl::StatusOr<std::string> GetCommId(int rank, const std::string& credential) {
    v1::GetCommIdRequest request;
    request.set_generation(job_generation());
    request.set_rank(rank);
    request.set_timeout_ms(10);
    request.set_credential(credential);
    std::optional<absl::StatusOr<std::string>> got;
    job_->GetCommId(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                    [&](absl::StatusOr<std::string> r) { got = std::move(r); });
    if (!got.has_value()) {
      clock_.Advance(absl::Milliseconds(20));
      job_->CheckStaleness();
    }
    return *got;
  }
  absl::Status Leave(int rank, const std::string& credential) {
    v1::LeaveRequest request;
    request.set_rank(rank);
    request.set_generation(1);
    request.set_credential(credential);
    v1::LeaveResponse response;
    return job_->Leave(request, &response);
  }
  int64_t job_generation() {
    v1::Job proto;
    job_->ToProto(&proto);
    return proto.generation();
  }
  v1::Job Proto() {
    v1::Job proto;
    job_->ToProto(&proto);
    return proto;
  }

  FakeClock clock_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
  std::shared_ptr<Job> job_;
  std::optional<absl::StatusOr<v1::JoinResponse>> joined_[2];
};

TEST_F(CredentialTest, Join_HandsEachMemberItsOwnCredential) {
  EXPECT_EQ(Credential(0).size(), 32u);
  EXPECT_NE(Credential(0), Credential(1));
}

// The probe kept a dead rank looking alive with a Heartbeat for the other rank (step 777).
TEST_F(CredentialTest, Heartbeat_WithoutOrWithOthersCredential_DeniedAndChangesNothing) {
  for (const std::string& wrong : {std::string(), Credential(0), std::string(32, '0')}) {
    const absl::Status s = Heartbeat(1, wrong, 777);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
    EXPECT_THAT(std::string(s.message()), Not(HasSubstr(Credential(1))));
  }
  EXPECT_EQ(Proto().members(1).last_step(), -1);
  // Time passes with only the forged beats: rank 1 is declared dead all the same.
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(Heartbeat(0, Credential(0), 1).ok());
  EXPECT_TRUE(Heartbeat(1, Credential(0), 777).code() == absl::StatusCode::kPermissionDenied);
  clock_.Advance(absl::Seconds(2));
  job_->CheckStaleness();
  EXPECT_EQ(Proto().generation(), 2);
  EXPECT_EQ(Proto().last_change().rank(), 1);
}

TEST_F(CredentialTest, Heartbeat_RightCredential_Counts) {
  ASSERT_TRUE(Heartbeat(1, Credential(1), 777).ok());
  EXPECT_EQ(Proto().members(1).last_step(), 777);
}

// The probe published "EVIL" as rank 0, rank 1 fetched it and the real leader was refused.
TEST_F(CredentialTest, PublishCommId_WithoutCredential_DeniedAndTheLeadersIdStands) {
  EXPECT_EQ(Publish(0, "", "EVIL").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Publish(0, Credential(1), "EVIL").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(GetCommId(1, Credential(1)).status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(Publish(0, Credential(0), "real").ok());
  absl::StatusOr<std::string> got = GetCommId(1, Credential(1));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "real");
}

TEST_F(CredentialTest, GetCommId_WithoutOrWithOthersCredential_Denied) {
  ASSERT_TRUE(Publish(0, Credential(0), "secret-id").ok());
  EXPECT_EQ(GetCommId(1, "").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(GetCommId(1, Credential(0)).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(*GetCommId(1, Credential(1)), "secret-id");
}

// The probe's Leave for the other rank bumped the generation.
TEST_F(CredentialTest, Leave_ForAnotherRank_DeniedAndNoNewGeneration) {
  EXPECT_EQ(Leave(1, "").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Leave(1, Credential(0)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Proto().generation(), 1);
  EXPECT_EQ(Proto().state(), v1::RUNNING);
  ASSERT_TRUE(Leave(1, Credential(1)).ok());
  EXPECT_EQ(Proto().generation(), 2);
}

// Step answers anyone (a schedule is no secret) but records progress only from the member.
TEST_F(CredentialTest, Step_WithoutCredential_AnsweredButNotRecorded) {
  v1::StepRequest request;
  request.set_rank(1);
  request.set_generation(1);
  request.set_step(55);
  v1::StepDecision decision;
  ASSERT_TRUE(job_->Step(request, &decision).ok());
  EXPECT_EQ(Proto().members(1).last_step(), -1);
  request.set_credential(Credential(1));
  ASSERT_TRUE(job_->Step(request, &decision).ok());
  EXPECT_EQ(Proto().members(1).last_step(), 55);
}

// The probe's Join of a live rank with a new worker id pushed the real worker out.
TEST_F(CredentialTest, Join_LiveRankByAnother_AlreadyExistsNamingTheHolder) {
  std::optional<absl::StatusOr<v1::JoinResponse>> intruder;
  Join(1, "intruder", "", &intruder);
  ASSERT_TRUE(intruder.has_value());
  EXPECT_EQ(intruder->status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(intruder->status().message()), HasSubstr("held by worker \"w1\""));
  // The same worker id without the credential is no better.
  intruder.reset();
  Join(1, "w1", "", &intruder);
  EXPECT_EQ(intruder->status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Proto().generation(), 1);
  EXPECT_EQ(Proto().state(), v1::RUNNING);
  EXPECT_TRUE(Heartbeat(1, Credential(1), 3).ok());
}

// The holder restarting with its credential re-takes its rank (a new generation).
TEST_F(CredentialTest, Join_LiveRankByItsHolder_RetakesIt) {
  const std::string old = Credential(1);
  std::optional<absl::StatusOr<v1::JoinResponse>> again;
  Join(1, "w1-restarted", old, &again);
  EXPECT_FALSE(again.has_value());  // waiting for the new round
  EXPECT_EQ(Proto().generation(), 2);
  std::optional<absl::StatusOr<v1::JoinResponse>> zero;
  Join(0, "w0", "", &zero);  // rank 0's holder re-joins the new round
  ASSERT_TRUE(again.has_value() && again->ok());
  EXPECT_NE((*again)->credential(), old);
  // The old credential no longer acts as rank 1.
  EXPECT_EQ(Heartbeat(1, old, 1).code(), absl::StatusCode::kPermissionDenied);
}

// A credential once found right is not hashed again, but it stays the member's only: beats with
// it count, a forged one of the same length after it is still refused, and once the rank is
// re-taken the old one (checked many times before) is refused.
TEST_F(CredentialTest, Heartbeat_AfterTheRightCredential_OnlyItStillCounts) {
  const std::string old = Credential(1);
  for (int step = 1; step <= 3; ++step) ASSERT_TRUE(Heartbeat(1, old, step).ok());
  std::string forged = old;
  forged.back() = forged.back() == '0' ? '1' : '0';
  EXPECT_EQ(Heartbeat(1, forged, 99).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Heartbeat(1, Credential(0), 99).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Heartbeat(1, old, 4).ok());
  EXPECT_EQ(Proto().members(1).last_step(), 4);
  std::optional<absl::StatusOr<v1::JoinResponse>> again, zero;
  Join(1, "w1-restarted", old, &again);
  Join(0, "w0", "", &zero);
  ASSERT_TRUE(again.has_value() && again->ok());
  EXPECT_EQ(Heartbeat(1, old, 5).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Heartbeat(1, (*again)->credential(), 5).ok());
  EXPECT_EQ(Heartbeat(1, old, 6).code(), absl::StatusCode::kPermissionDenied);
}

// A rank whose holder died is free again, for anyone.
TEST_F(CredentialTest, Join_DeadHoldersRank_FreeForAnyone) {
  clock_.Advance(absl::Seconds(4));
  ASSERT_TRUE(Heartbeat(0, Credential(0), 1).ok());
  job_->CheckStaleness();
  ASSERT_EQ(Proto().generation(), 2);
  std::optional<absl::StatusOr<v1::JoinResponse>> replacement, zero;
  Join(1, "replacement", "", &replacement);
  Join(0, "w0", "", &zero);
  ASSERT_TRUE(replacement.has_value() && replacement->ok());
}

// Only a digest is kept and stored; it survives a restart, and the credential still works.
TEST_F(CredentialTest, Credentials_StoredAsDigests_SurviveARestart) {
  absl::StatusOr<std::vector<StoredJob>> stored = store_.LoadAll();
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->size(), 1u);
  const StoredJob& j = (*stored)[0];
  ASSERT_EQ(j.members.size(), 2u);
  for (const Member& m : j.members) {
    EXPECT_EQ(m.credential_digest, CredentialDigest(Credential(m.rank)));
    EXPECT_NE(m.credential_digest, Credential(m.rank));
  }
  absl::StatusOr<Schedule> schedule = Schedule::Create(*ScheduleSpecFromProto(j.spec));
  ASSERT_TRUE(schedule.ok());
  InMemoryStateStore other;
  ASSERT_TRUE(other.CreateJob(j.spec, j.created_unix_ms).ok());
  Job restored(j.spec, *std::move(schedule), JobDefaults{}, &clock_, &other, j.created_unix_ms);
  restored.Restore(j, absl::Seconds(10));
  v1::HeartbeatRequest beat;
  beat.set_rank(1);
  beat.set_generation(1);
  beat.set_credential(Credential(1));
  v1::HeartbeatResponse reply;
  EXPECT_TRUE(restored.Heartbeat(beat, &reply).ok());
  beat.set_credential(Credential(0));
  EXPECT_EQ(restored.Heartbeat(beat, &reply).code(), absl::StatusCode::kPermissionDenied);
}

TEST(CredentialDigestTest, MatchesOnlyItsCredential) {
  const std::string c = NewMemberCredential();
  EXPECT_TRUE(CredentialMatches(c, CredentialDigest(c)));
  EXPECT_FALSE(CredentialMatches(c + "x", CredentialDigest(c)));
  EXPECT_FALSE(CredentialMatches("", CredentialDigest("")));
  EXPECT_FALSE(CredentialMatches(c, ""));
  EXPECT_NE(NewMemberCredential(), c);
}

}  // namespace
}  // namespace modelavg::server
