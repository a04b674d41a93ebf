// The session's timeouts on a FakeClock: the coordinator-outage bound, the retries of Join and
// Leave through an unreachable coordinator, a decision's wait for a proposed plan, and the clock
// itself. Time is advanced, not slept.
#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "client/session/decision_window.h"
#include "client/session/join.h"
#include "client/session/leave.h"
#include "client/session/retry_wait.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// Nothing listens there: every call fails at once with UNAVAILABLE.
constexpr char kNowhere[] = "127.0.0.1:1";

TEST(FakeClockTest, AwaitWithDeadline_EndsOnceAdvancedPastTheDeadline) {
  FakeClock clock;
  const absl::Time start = clock.Now();
  absl::Mutex mu;
  bool flag = false;
  std::atomic<bool> returned{false};
  bool result = true;
  std::thread waiter([&] {
    absl::MutexLock l(&mu);
    result = clock.AwaitWithDeadline(mu, absl::Condition(&flag), start + absl::Minutes(10));
    returned = true;
  });
  ASSERT_TRUE(clock.AwaitWaits(1, absl::Seconds(30)));
  clock.Advance(absl::Minutes(9));
  EXPECT_FALSE(returned);  // (it may not have looked yet; it must not have ended early)
  clock.Advance(absl::Minutes(1));
  waiter.join();
  EXPECT_FALSE(result);
  EXPECT_EQ(clock.Now(), start + absl::Minutes(10));
}

TEST(FakeClockTest, AwaitWithDeadline_ConditionMet_TrueWithoutTheClockMoving) {
  FakeClock clock;
  const absl::Time start = clock.Now();
  absl::Mutex mu;
  bool flag = false;
  std::thread setter([&] {
    ASSERT_TRUE(clock.AwaitWaits(1, absl::Seconds(30)));
    absl::MutexLock l(&mu);
    flag = true;
  });
  {
    absl::MutexLock l(&mu);
    EXPECT_TRUE(clock.AwaitWithDeadline(mu, absl::Condition(&flag), start + absl::Hours(1)));
  }
  setter.join();
  EXPECT_EQ(clock.Now(), start);
}

TEST(FakeClockTest, SleepFor_AdvanceOnWait_MovesTheClockAtOnce) {
  FakeClock clock(absl::FromUnixSeconds(100), /*advance_on_wait=*/true);
  clock.SleepFor(absl::Hours(2));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100) + absl::Hours(2));
  EXPECT_EQ(clock.waits(), 1);
}

TEST(RetryWaitTest, SleepUnlessCancelled_Cancelled_EndsWithoutTheClockMoving) {
  FakeClock clock;
  CancelToken cancel;
  std::thread canceller([&] {
    ASSERT_TRUE(clock.AwaitWaits(1, absl::Seconds(30)));
    cancel.Cancel();
  });
  SleepUnlessCancelled(clock, &cancel, absl::Hours(1));
  canceller.join();
  EXPECT_EQ(clock.Now(), FakeClock().Now());
}

TEST(CoordinatorOutageTest, Exceeded_OnlyOnceTheTimeoutHasPassed) {
  FakeClock clock;
  CoordinatorOutage outage("coord:1", absl::Minutes(5), &clock);
  EXPECT_EQ(outage.OutageLength(), absl::ZeroDuration());
  outage.NoteUnreachable(absl::UnavailableError("connection refused"));
  clock.Advance(absl::Minutes(5));
  outage.NoteUnreachable(absl::UnavailableError("connection refused"));
  EXPECT_EQ(outage.OutageLength(), absl::Minutes(5));
  EXPECT_FALSE(outage.Exceeded());
  clock.Advance(absl::Seconds(1));
  EXPECT_TRUE(outage.Exceeded());
  const absl::Status error = outage.Error("training", absl::UnavailableError("refused"));
  EXPECT_EQ(error.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(error.message()), HasSubstr("has not answered for 5m1s"));
  EXPECT_THAT(std::string(error.message()), HasSubstr("coordinator_outage_timeout is 5m"));
  outage.NoteReachable();
  EXPECT_EQ(outage.OutageLength(), absl::ZeroDuration());
  EXPECT_FALSE(outage.Exceeded());
}

TEST(CoordinatorOutageTest, Retry_UnreachableThroughout_FailsAtTheTimeout) {
  FakeClock clock(absl::FromUnixSeconds(100), /*advance_on_wait=*/true);
  CoordinatorOutage outage("coord:1", absl::Minutes(5), &clock);
  int calls = 0;
  const absl::Status s = outage.Retry("fetching an id", [&] {
    ++calls;
    return absl::UnavailableError("connection refused");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("fetching an id needs it"));
  // Backoffs of 50, 100, 200, then 250 ms: past 5 minutes after about 1,200 calls.
  EXPECT_GT(calls, 1000);
  EXPECT_GE(clock.Now() - absl::FromUnixSeconds(100), absl::Minutes(5));
}

TEST(CoordinatorOutageTest, Retry_AnswersAgain_ResultAndOutageOver) {
  FakeClock clock(absl::FromUnixSeconds(100), /*advance_on_wait=*/true);
  CoordinatorOutage outage("coord:1", absl::Minutes(5), &clock);
  int calls = 0;
  absl::StatusOr<int> s = outage.Retry("reading", [&]() -> absl::StatusOr<int> {
    if (++calls < 4) return absl::UnavailableError("connection refused");
    return 7;
  });
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 7);
  EXPECT_EQ(clock.Now() - absl::FromUnixSeconds(100), absl::Milliseconds(50 + 100 + 200));
  EXPECT_EQ(outage.OutageLength(), absl::ZeroDuration());
}

class SessionOnClockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ConnectionOptions copts;
    copts.coordinator = kNowhere;
    auto c = CoordinatorClient::Create(copts);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
    options_.coordinator = kNowhere;
    options_.job_id = "job";
    options_.worker_id = "w0";
    options_.rank = 0;
  }

  v1::LeaveRequest Request() const {
    v1::LeaveRequest req;
    req.set_job_id("job");
    req.set_rank(0);
    req.set_generation(1);
    return req;
  }

  FakeClock clock_{absl::FromUnixSeconds(100), /*advance_on_wait=*/true};
  std::unique_ptr<CoordinatorClient> coordinator_;
  ClientOptions options_;
};

TEST_F(SessionOnClockTest, SendLeave_CoordinatorUnreachable_RetriedForLeaveTimeout) {
  CoordinatorOutage outage(kNowhere, absl::Minutes(5), &clock_);
  options_.leave_timeout = absl::Seconds(20);
  const absl::Status s = SendLeave(*coordinator_, outage, clock_, options_, Request(), "done",
                                   absl::OkStatus(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // Backoffs of 0.1, 0.2, 0.4, 0.8 s, then 1 s: the attempt at 19.5 s is the last one whose
  // backoff would not reach 20 s; the 23rd attempt, at 19.5 s, gives up.
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("did not answer within ClientOptions.leave_timeout (20s, 23 attempts)"));
  EXPECT_EQ(clock_.Now(), absl::FromUnixSeconds(100) + absl::Milliseconds(19500));
}

TEST_F(SessionOnClockTest, SendLeave_AfterAFailure_OneAttempt) {
  CoordinatorOutage outage(kNowhere, absl::Minutes(5), &clock_);
  const absl::Status s = SendLeave(*coordinator_, outage, clock_, options_, Request(), "done",
                                   absl::InternalError("round failed"), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 attempts"));
  EXPECT_EQ(clock_.Now(), absl::FromUnixSeconds(100));
}

TEST_F(SessionOnClockTest, SendLeave_OutageAlreadyPastItsTimeout_NotWaitedForAgain) {
  CoordinatorOutage outage(kNowhere, absl::Minutes(5), &clock_);
  outage.NoteUnreachable(absl::UnavailableError("gone"));
  clock_.Advance(absl::Minutes(6));
  const absl::Status s = SendLeave(*coordinator_, outage, clock_, options_, Request(), "done",
                                   absl::OkStatus(), nullptr);
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 attempts"));
}

TEST_F(SessionOnClockTest, JoinJob_CoordinatorUnreachable_UnavailableAtTheJoinTimeout) {
  options_.join_timeout = absl::Minutes(5);
  absl::StatusOr<Joined> joined = JoinJob(*coordinator_, options_, "host", clock_);
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kUnavailable) << joined.status();
  EXPECT_THAT(std::string(joined.status().message()),
              HasSubstr("cannot reach the coordinator at 127.0.0.1:1 within 5m"));
  // It gave up when the next backoff (2 s at most) would have passed the timeout.
  EXPECT_GE(clock_.Now() - absl::FromUnixSeconds(100), absl::Minutes(5) - absl::Seconds(2));
  EXPECT_LE(clock_.Now() - absl::FromUnixSeconds(100), absl::Minutes(5));
}

// A window whose rank answered a proposed plan (it gave back its decisions past step 0, and a
// later step waits for the switch step).
std::unique_ptr<DecisionWindow> WindowThatGaveBack(CoordinatorClient& coordinator,
                                                   CoordinatorOutage& outage, const Clock& clock) {
  absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(::modelavg::testing::SpecFromText(
      R"pb(job_id: "job" world_size: 2 mode: PERIODIC levels { period: 2 group_size: 2 })pb"));
  absl::StatusOr<Schedule> schedule =
      spec.ok() ? Schedule::Create(*spec) : absl::StatusOr<Schedule>(spec.status());
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  auto window = std::make_unique<DecisionWindow>(coordinator, outage, clock,
                                                 PlanHistory(*std::move(schedule)), "job", 0,
                                                 "credential", 16);
  window->OnBeat(0);
  v1::HeartbeatResponse proposal;
  proposal.set_proposed_plan(1);
  EXPECT_TRUE(window->OnReply(proposal).ok());
  return window;
}

// A job deleted while an update was proposed: the rank had given back its decisions and waited
// for the switch step; its heartbeat learnt that the job was gone (the session broke), but the
// wait went on for the whole outage timeout (5 minutes) and then failed "has not answered".
// Now the wait ends at once with the reason the session broke, whether it broke before the wait
// or during it.
TEST_F(SessionOnClockTest, DecisionWaitingForASwitch_SessionBroken_FailsAtOnceWithTheReason) {
  const absl::Status deleted = absl::FailedPreconditionError(
      "job job is unknown to the coordinator ... or the job was deleted");
  {
    CoordinatorOutage outage(kNowhere, absl::Minutes(5), &clock_);
    std::unique_ptr<DecisionWindow> window = WindowThatGaveBack(*coordinator_, outage, clock_);
    const absl::Time start = clock_.Now();
    window->Break(deleted);
    absl::StatusOr<Decision> d = window->At(5);
    EXPECT_EQ(d.status(), deleted);
    EXPECT_LT(clock_.Now() - start, absl::Seconds(1));
  }
  {
    FakeClock still(absl::FromUnixSeconds(100));  // advanced only by hand
    CoordinatorOutage outage(kNowhere, absl::Minutes(5), &still);
    std::unique_ptr<DecisionWindow> window = WindowThatGaveBack(*coordinator_, outage, still);
    auto waiting = std::async(std::launch::async, [&] { return window->At(5); });
    EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
        << "the decision did not wait for the switch step";
    window->Break(deleted);
    if (waiting.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "the decision still waits after the session broke";
      still.Advance(absl::Hours(1));  // let it end
    }
    EXPECT_EQ(waiting.get().status(), deleted);
  }
}

}  // namespace
}  // namespace modelavg::client
