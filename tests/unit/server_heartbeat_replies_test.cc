// HeartbeatReplies: which beats of a HeartbeatStream are answered, driven by a fake clock.
#include "server/core/heartbeat_replies.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/heartbeat_keepalive.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::server {
namespace {

v1::HeartbeatResponse Reply(int64_t generation, v1::JobState state = v1::RUNNING) {
  v1::HeartbeatResponse r;
  r.set_generation(generation);
  r.set_state(state);
  return r;
}

TEST(HeartbeatRepliesTest, Create_IntervalOutOfRange_InvalidArgument) {
  FakeClock clock;
  for (int64_t ms : {int64_t{-1}, HeartbeatReplies::kMaxReplyIntervalMs + 1}) {
    absl::StatusOr<HeartbeatReplies> r = HeartbeatReplies::Create(ms, &clock);
    ASSERT_FALSE(r.ok()) << ms;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), testing::HasSubstr("reply_interval_ms"));
  }
  EXPECT_TRUE(HeartbeatReplies::Create(HeartbeatReplies::kMaxReplyIntervalMs, &clock).ok());
}

TEST(HeartbeatRepliesTest, ZeroInterval_EveryBeatAnswered) {
  FakeClock clock;
  HeartbeatReplies r = *HeartbeatReplies::Create(0, &clock);
  EXPECT_TRUE(r.per_beat());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(r.Due(Reply(1))) << i;
}

TEST(HeartbeatRepliesTest, Interval_FirstBeatAnswered_SameNewsSilentUntilTheIntervalPasses) {
  FakeClock clock;
  HeartbeatReplies r = *HeartbeatReplies::Create(1000, &clock);
  EXPECT_FALSE(r.per_beat());
  EXPECT_TRUE(r.Due(Reply(1)));
  for (int i = 0; i < 9; ++i) {
    clock.Advance(absl::Milliseconds(100));
    EXPECT_FALSE(r.Due(Reply(1))) << "at " << (i + 1) * 100 << " ms";
  }
  clock.Advance(absl::Milliseconds(100));  // 1000 ms since the last reply
  EXPECT_TRUE(r.Due(Reply(1)));
  clock.Advance(absl::Milliseconds(999));  // counted from that reply
  EXPECT_FALSE(r.Due(Reply(1)));
  clock.Advance(absl::Milliseconds(1));
  EXPECT_TRUE(r.Due(Reply(1)));
}

TEST(HeartbeatRepliesTest, Interval_NewGenerationOrState_AnsweredAtOnce) {
  FakeClock clock;
  HeartbeatReplies r = *HeartbeatReplies::Create(60000, &clock);
  EXPECT_TRUE(r.Due(Reply(1)));
  clock.Advance(absl::Milliseconds(10));
  EXPECT_TRUE(r.Due(Reply(2, v1::PENDING)));
  EXPECT_FALSE(r.Due(Reply(2, v1::PENDING)));
  EXPECT_TRUE(r.Due(Reply(2, v1::RUNNING)));
  EXPECT_FALSE(r.Due(Reply(2, v1::RUNNING)));
}

TEST(HeartbeatRepliesTest, Interval_NewLastChange_Answered) {
  FakeClock clock;
  HeartbeatReplies r = *HeartbeatReplies::Create(60000, &clock);
  v1::HeartbeatResponse a = Reply(3);
  EXPECT_TRUE(r.Due(a));
  v1::HeartbeatResponse b = a;
  b.mutable_last_change()->set_generation(3);
  b.mutable_last_change()->set_rank(2);
  b.mutable_last_change()->set_reason("rank 2 left");
  EXPECT_TRUE(r.Due(b));
  EXPECT_FALSE(r.Due(b));
  v1::HeartbeatResponse c = b;
  c.mutable_last_change()->set_rank(1);
  EXPECT_TRUE(r.Due(c));
  // What only the reply's envelope says is no news.
  v1::HeartbeatResponse d = c;
  d.set_coordinator_incarnation("other");
  d.set_recovery_grace_ms(5);
  EXPECT_FALSE(r.Due(d));
}

TEST(StreamReplyIntervalTest, Values_LongerWithTheTimeout_NeverBelowWhatEarlierClientsAsked) {
  EXPECT_EQ(StreamReplyIntervalMs(absl::Seconds(3), absl::Milliseconds(100)), 1000);
  EXPECT_EQ(StreamReplyIntervalMs(absl::Seconds(10), absl::Milliseconds(100)), 3300);
  EXPECT_EQ(StreamReplyIntervalMs(absl::Seconds(10), absl::Seconds(1)), 3000);
  EXPECT_EQ(StreamReplyIntervalMs(absl::Seconds(600), absl::Seconds(1)), kMaxReplyIntervalMs);
  EXPECT_EQ(StreamReplyIntervalMs(absl::Milliseconds(300), absl::Milliseconds(100)), 100);
  EXPECT_EQ(StreamReplyIntervalMs(absl::Milliseconds(2), absl::Milliseconds(1)), 1);
}

// A worker that beats every P and asks for StreamReplyIntervalMs(T, P), against the policy on a
// fake clock: at each of its beats, the time since the last reply it got (what it compares with T
// before re-opening the stream) stays within (T + P) / 2, leaving at least half the slack for the
// network; and with a long timeout most beats go unanswered.
TEST(StreamReplyIntervalTest, SteadyBeats_SilenceWellWithinTheTimeout) {
  struct Case {
    absl::Duration timeout, beat;
  };
  for (const Case& c : {Case{absl::Milliseconds(500), absl::Milliseconds(100)},
                        Case{absl::Seconds(3), absl::Milliseconds(100)},
                        Case{absl::Seconds(3), absl::Seconds(1)},
                        Case{absl::Seconds(10), absl::Milliseconds(100)},
                        Case{absl::Seconds(10), absl::Seconds(3)},
                        Case{absl::Seconds(600), absl::Seconds(1)}}) {
    FakeClock clock;
    HeartbeatReplies r =
        *HeartbeatReplies::Create(StreamReplyIntervalMs(c.timeout, c.beat), &clock);
    absl::Time last_reply = clock.Now();
    absl::Duration worst = absl::ZeroDuration();
    int replies = 0;
    const int beats = static_cast<int>(4 * kMaxReplyIntervalMs /
                                       absl::ToInt64Milliseconds(c.beat));
    for (int i = 0; i < beats; ++i) {
      worst = std::max(worst, clock.Now() - last_reply);
      if (r.Due(Reply(1))) {
        last_reply = clock.Now();
        ++replies;
      }
      clock.Advance(c.beat);
    }
    const std::string what = absl::StrCat("timeout ", absl::FormatDuration(c.timeout), ", beat ",
                                          absl::FormatDuration(c.beat));
    EXPECT_LE(worst, (c.timeout + c.beat) / 2) << what;
    EXPECT_GE(replies, 4) << what;
    if (c.beat <= c.timeout / 100) EXPECT_LE(replies * 20, beats) << what;
    if (c.timeout >= absl::Seconds(600)) EXPECT_LE(replies * 50, beats) << what;
  }
}

}  // namespace
}  // namespace modelavg::server
