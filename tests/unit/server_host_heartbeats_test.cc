// HostHeartbeats, the core of a HostHeartbeatStream, over a real registry and a fake clock: the
// beats of several members in one request are each recorded; which members' answers go out
// (first beats, news, errors); merging into an unsent reply; the keep-alive; the bounds; the
// members a broken stream reports.
#include "server/core/host_heartbeats.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/job/job.h"
#include "server/core/job_registry.h"
#include "server/store/state_store.h"

namespace modelavg::server {
namespace {

using ::testing::HasSubstr;

class HostHeartbeatsTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 3;

  HostHeartbeatsTest() {
    JobRegistryOptions options;
    options.clock = &clock_;
    options.start_staleness_thread = false;
    options.store = &store_;
    options.incarnation = "inc-1";
    registry_ = std::make_unique<JobRegistry>(options);
    v1::JobSpec spec;
    spec.set_job_id("j");
    spec.set_world_size(kWorld);
    spec.set_mode(v1::PERIODIC);
    spec.set_min_world_size(1);  // elastic: a Leave moves the generation
    spec.set_heartbeat_timeout_ms(10000);
    spec.add_levels()->set_period(1);
    spec.mutable_levels(0)->set_group_size(kWorld);
    EXPECT_TRUE(registry_->CreateJob(spec, nullptr).ok());
    job_ = *registry_->Find("j");
    std::vector<std::optional<absl::StatusOr<v1::JoinResponse>>> joined(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      v1::JoinRequest request;
      request.set_job_id("j");
      request.set_worker_id(absl::StrCat("w", r));
      request.set_rank(r);
      job_->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
                 [&joined, r](absl::StatusOr<v1::JoinResponse> j) { joined[r] = std::move(j); });
    }
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_TRUE(joined[r].has_value() && joined[r]->ok()) << r;
      credential_[r] = (*joined[r])->credential();
    }
  }

  v1::HeartbeatRequest Beat(int rank, int64_t step, bool closing = false) {
    v1::HeartbeatRequest b;
    b.set_job_id("j");
    b.set_rank(rank);
    b.set_generation(1);
    b.set_step(step);
    b.set_credential(credential_[rank]);
    b.set_closing(closing);
    return b;
  }
  static v1::HostHeartbeatRequest Request(std::vector<v1::HeartbeatRequest> beats,
                                          int64_t reply_interval_ms = 1000) {
    v1::HostHeartbeatRequest req;
    for (auto& b : beats) *req.add_beats() = std::move(b);
    req.set_reply_interval_ms(reply_interval_ms);
    return req;
  }
  // The step the job records for each rank.
  std::vector<int64_t> Steps() {
    v1::Job proto;
    job_->ToProto(&proto);
    std::vector<int64_t> steps(kWorld, -2);
    for (const v1::Member& m : proto.members()) steps[m.rank()] = m.last_step();
    return steps;
  }
  static std::vector<int> Ranks(const v1::HostHeartbeatResponse& out) {
    std::vector<int> ranks;
    for (const auto& m : out.members()) ranks.push_back(m.rank());
    return ranks;
  }

  FakeClock clock_;
  InMemoryStateStore store_;
  std::unique_ptr<JobRegistry> registry_;
  std::shared_ptr<Job> job_;
  std::string credential_[kWorld];
};

TEST_F(HostHeartbeatsTest, EveryBeatRecorded_FirstBeatsAnswered_ThenOnlyNewsAndTheKeepAlive) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  absl::StatusOr<bool> due = beats.Beat(Request({Beat(0, 5), Beat(1, 6), Beat(2, 7)}), &out);
  ASSERT_TRUE(due.ok()) << due.status();
  EXPECT_TRUE(*due);
  EXPECT_THAT(Ranks(out), ::testing::ElementsAre(0, 1, 2));
  for (const auto& m : out.members()) {
    EXPECT_EQ(m.job_id(), "j");
    EXPECT_EQ(m.error_code(), 0);
    EXPECT_EQ(m.reply().generation(), 1);
    EXPECT_EQ(m.reply().state(), v1::RUNNING);
    EXPECT_EQ(m.reply().coordinator_incarnation(), "inc-1");
  }
  EXPECT_THAT(Steps(), ::testing::ElementsAre(5, 6, 7));
  beats.Sent();
  out.Clear();

  // Nothing new, within the keep-alive: recorded, not answered.
  clock_.Advance(absl::Milliseconds(500));
  due = beats.Beat(Request({Beat(0, 8), Beat(1, 9), Beat(2, 10)}), &out);
  ASSERT_TRUE(due.ok());
  EXPECT_FALSE(*due);
  EXPECT_EQ(out.members_size(), 0);
  EXPECT_THAT(Steps(), ::testing::ElementsAre(8, 9, 10));

  // The keep-alive: an empty reply once the interval has passed since the last write.
  clock_.Advance(absl::Milliseconds(500));
  due = beats.Beat(Request({Beat(0, 11), Beat(1, 12), Beat(2, 13)}), &out);
  ASSERT_TRUE(due.ok());
  EXPECT_TRUE(*due);
  EXPECT_EQ(out.members_size(), 0);
  beats.Sent();

  // News: rank 2 leaves, the generation moves; ranks 0 and 1 are told at their next beat.
  v1::LeaveRequest leave;
  leave.set_job_id("j");
  leave.set_rank(2);
  leave.set_generation(1);
  leave.set_credential(credential_[2]);
  v1::LeaveResponse left;
  ASSERT_TRUE(job_->Leave(leave, &left).ok());
  clock_.Advance(absl::Milliseconds(10));
  due = beats.Beat(Request({Beat(0, 14), Beat(1, 15)}), &out);
  ASSERT_TRUE(due.ok());
  EXPECT_TRUE(*due);
  ASSERT_THAT(Ranks(out), ::testing::ElementsAre(0, 1));
  for (const auto& m : out.members()) {
    EXPECT_EQ(m.reply().generation(), 2);
    EXPECT_TRUE(m.reply().has_last_change());
  }
}

TEST_F(HostHeartbeatsTest, WhileAWriteIsInFlight_AnswersMergeNewestPerMember) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 1)}), &out).ok());
  // Not sent yet (a write in flight): rank 1's first beat joins it, rank 0 stays once.
  ASSERT_TRUE(beats.Beat(Request({Beat(1, 1)}), &out).ok());
  EXPECT_THAT(Ranks(out), ::testing::ElementsAre(0, 1));
  // A failing beat of rank 0 replaces its unsent answer.
  v1::HeartbeatRequest bad = Beat(0, 2);
  bad.set_credential("not-it");
  ASSERT_TRUE(beats.Beat(Request({bad}), &out).ok());
  ASSERT_THAT(Ranks(out), ::testing::ElementsAre(0, 1));
  EXPECT_EQ(out.members(0).error_code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(out.members(1).error_code(), 0);
}

TEST_F(HostHeartbeatsTest, AMemberFails_ItsErrorIsAnswered_TheOthersGoOn_ItsNextBeatIsAFirst) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  v1::HeartbeatRequest wrong = Beat(1, 3);
  wrong.set_credential("stolen");
  v1::HeartbeatRequest unknown = Beat(2, 3);
  unknown.set_job_id("no-such-job");
  absl::StatusOr<bool> due = beats.Beat(Request({Beat(0, 3), wrong, unknown}), &out);
  ASSERT_TRUE(due.ok()) << due.status();
  ASSERT_EQ(out.members_size(), 3);
  EXPECT_EQ(out.members(0).error_code(), 0);
  EXPECT_EQ(out.members(1).error_code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_FALSE(out.members(1).has_reply());
  EXPECT_EQ(out.members(2).error_code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(out.members(2).job_id(), "no-such-job");
  EXPECT_THAT(out.members(2).error_message(), HasSubstr("no-such-job"));
  EXPECT_EQ(beats.member_count(), 1u);
  EXPECT_EQ(Steps()[0], 3);
  EXPECT_NE(Steps()[1], 3);  // a beat without the member's credential records nothing
  beats.Sent();
  out.Clear();
  // With its credential again: a first beat, answered.
  clock_.Advance(absl::Milliseconds(1));
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 4), Beat(1, 4)}), &out).ok());
  EXPECT_THAT(Ranks(out), ::testing::ElementsAre(1));
  EXPECT_EQ(beats.member_count(), 2u);
}

TEST_F(HostHeartbeatsTest, Closing_TakesTheMemberOff_TheRestAreReportedWhenTheStreamBreaks) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 1), Beat(1, 1), Beat(2, 1)}), &out).ok());
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 2), Beat(1, 2, /*closing=*/true)}), &out).ok());
  std::vector<int> ranks;
  for (const HostHeartbeats::Member& m : beats.Members()) {
    ranks.push_back(m.rank);
    EXPECT_EQ(m.job.get(), job_.get());
    EXPECT_EQ(m.credential, credential_[m.rank]);
  }
  EXPECT_THAT(ranks, ::testing::UnorderedElementsAre(0, 2));
}

// A relay's `lost` beat: not recorded as a beat, the member is off the stream, and it dies at
// half the heartbeat timeout as a broken stream's member would; a lost beat with a wrong
// credential changes nothing.
TEST_F(HostHeartbeatsTest, LostBeat_NotRecorded_MemberOff_DeadAtHalfTheTimeout) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 1), Beat(1, 1), Beat(2, 1)}), &out).ok());
  v1::HeartbeatRequest lost = Beat(1, 7);
  lost.set_lost(true);
  v1::HeartbeatRequest forged = Beat(2, 7);
  forged.set_lost(true);
  forged.set_credential("not-rank-2s");
  out.Clear();
  absl::StatusOr<bool> due = beats.Beat(Request({Beat(0, 2), lost, forged}), &out);
  ASSERT_TRUE(due.ok()) << due.status();
  EXPECT_THAT(Ranks(out), ::testing::IsEmpty()) << out.DebugString();
  EXPECT_THAT(Steps(), ::testing::ElementsAre(2, 1, 1));
  std::vector<int> on_stream;
  for (const HostHeartbeats::Member& m : beats.Members()) on_stream.push_back(m.rank);
  EXPECT_THAT(on_stream, ::testing::UnorderedElementsAre(0, 2));
  // 6 s of the 10 s timeout: ranks 0 and 2 beat on; rank 1 is past its 5 s grace.
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(beats.Beat(Request({Beat(0, 3), Beat(2, 3)}), &out).ok());
  job_->CheckStaleness();
  v1::Job proto;
  job_->ToProto(&proto);
  EXPECT_THAT(proto.vacant_ranks(), ::testing::ElementsAre(1)) << proto.DebugString();
  EXPECT_EQ(proto.generation(), 2) << proto.DebugString();
}

TEST_F(HostHeartbeatsTest, MalformedRequests_InvalidArgument_SayingWhat) {
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  for (int64_t ms : {int64_t{0}, int64_t{-5}, int64_t{60001}}) {
    absl::StatusOr<bool> due = beats.Beat(Request({Beat(0, 1)}, ms), &out);
    ASSERT_FALSE(due.ok()) << ms;
    EXPECT_EQ(due.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(due.status().message(), HasSubstr("reply_interval_ms"));
  }
  absl::StatusOr<bool> twice = beats.Beat(Request({Beat(0, 1), Beat(0, 2)}), &out);
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.status().message(), HasSubstr("beats twice"));
  std::vector<v1::HeartbeatRequest> many(HostHeartbeats::kMaxBeatsPerRequest + 1, Beat(0, 1));
  absl::StatusOr<bool> too_many = beats.Beat(Request(many), &out);
  ASSERT_FALSE(too_many.ok());
  EXPECT_THAT(too_many.status().message(), HasSubstr("at most 4096 beats"));
  EXPECT_EQ(out.members_size(), 0);
  EXPECT_EQ(beats.member_count(), 0u);
}

// A stream tracks at most kMaxMembers members: one more ends it, saying so.
TEST_F(HostHeartbeatsTest, MoreMembersThanTheBound_InvalidArgument) {
  const int world = static_cast<int>(HostHeartbeats::kMaxMembers) + 1;
  v1::JobSpec spec;
  spec.set_job_id("big");
  spec.set_world_size(world);
  spec.set_mode(v1::PERIODIC);
  spec.add_levels()->set_period(1);
  spec.mutable_levels(0)->set_group_size(world);
  ASSERT_TRUE(registry_->CreateJob(spec, nullptr).ok());
  std::shared_ptr<Job> big = *registry_->Find("big");
  std::vector<std::string> credentials(world);
  for (int r = 0; r < world; ++r) {
    v1::JoinRequest request;
    request.set_job_id("big");
    request.set_worker_id(absl::StrCat("w", r));
    request.set_rank(r);
    big->Join(request, absl::InfiniteFuture(), registry_->NewWaitId(),
              [&credentials, r](absl::StatusOr<v1::JoinResponse> j) {
                if (j.ok()) credentials[r] = j->credential();
              });
  }
  const auto beat = [&](int r) {
    v1::HeartbeatRequest b;
    b.set_job_id("big");
    b.set_rank(r);
    b.set_generation(1);
    b.set_credential(credentials[r]);
    return b;
  };
  HostHeartbeats beats(registry_.get());
  v1::HostHeartbeatResponse out;
  std::vector<v1::HeartbeatRequest> first;
  for (int r = 0; r + 1 < world; ++r) first.push_back(beat(r));
  absl::StatusOr<bool> due = beats.Beat(Request(first), &out);
  ASSERT_TRUE(due.ok()) << due.status();
  EXPECT_EQ(beats.member_count(), HostHeartbeats::kMaxMembers);
  ASSERT_TRUE(beats.Beat(Request({beat(0), beat(1)}), &out).ok());  // tracked ones go on
  absl::StatusOr<bool> one_more = beats.Beat(Request({beat(world - 1)}), &out);
  ASSERT_FALSE(one_more.ok());
  EXPECT_EQ(one_more.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(one_more.status().message(), HasSubstr("at most 4096 members"));
}

}  // namespace
}  // namespace modelavg::server
