// The client's side of paced rounds that needs no coordinator: the compute pace a member reports
// on its heartbeats (client/session/pace_tracker.h) on a FakeClock, and ClientOptions'
// tokens_per_step with MODELAVG_TOKENS_PER_STEP (client/session/join.h).
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/time/time.h"
#include "client/session/join.h"
#include "client/session/pace_tracker.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/client/client.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;

// One step: `compute` outside the averaging call, then `inside` in it.
void Step(FakeClock& clock, PaceTracker& pace, absl::Duration compute, absl::Duration inside) {
  clock.Advance(compute);
  pace.CallStarted();
  clock.Advance(inside);
  pace.CallEnded();
}

TEST(PaceTracker, ZeroUntilAStepIsMeasured) {
  FakeClock clock;
  PaceTracker pace(clock);
  EXPECT_EQ(pace.steps_per_second(), 0);
  // The first call has no step before it to measure.
  clock.Advance(absl::Seconds(3));
  pace.CallStarted();
  clock.Advance(absl::Milliseconds(100));
  pace.CallEnded();
  EXPECT_EQ(pace.steps_per_second(), 0);
  Step(clock, pace, absl::Milliseconds(250), absl::Milliseconds(10));
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 4.0);
}

TEST(PaceTracker, TimeInsideTheCallsDoesNotCount) {
  FakeClock clock;
  PaceTracker pace(clock);
  pace.CallStarted();
  pace.CallEnded();
  // 100 ms of compute a step, and long waits at the rounds: still 10 steps a second.
  for (int i = 0; i < 8; ++i) {
    Step(clock, pace, absl::Milliseconds(100), absl::Milliseconds(i % 2 == 0 ? 900 : 5));
  }
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 10.0);
}

TEST(PaceTracker, FollowsAChangeOfPaceWithinTheWindow) {
  FakeClock clock;
  PaceTracker pace(clock, absl::Seconds(2));
  pace.CallStarted();
  pace.CallEnded();
  for (int i = 0; i < 30; ++i) Step(clock, pace, absl::Milliseconds(100), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 10.0);
  // Twice slower: once the window (2 s) holds only slow steps, the pace is theirs.
  for (int i = 0; i < 12; ++i) Step(clock, pace, absl::Milliseconds(200), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 5.0);
  // A step longer than the window is still a measure: the newest is always kept.
  Step(clock, pace, absl::Seconds(10), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 0.1);
}

// With paced rounds the pace is over the steps since the start of the previous round (the
// round the next one repeats), not the last 2 s: a member that ran 4x faster at the end of a
// round (its cores to itself while the others waited) reports the round's whole pace, and
// rounds shorter than 2 s do not blur a change of pace over more rounds.
TEST(PaceTracker, PacedRounds_OverThePreviousRoundAndTheCurrentOne) {
  FakeClock clock;
  PaceTracker pace(clock, absl::Seconds(2));
  pace.CallStarted();
  pace.CallEnded();
  // Round 0: ends after 5 steps of 100 ms.
  for (int i = 0; i < 4; ++i) Step(clock, pace, absl::Milliseconds(100), absl::ZeroDuration());
  clock.Advance(absl::Milliseconds(100));
  pace.CallStarted();
  pace.CallEnded(/*paced_round=*/true);
  // Round 1: 30 steps of 200 ms (6 s), then 10 of 50 ms, and the round taken.
  for (int i = 0; i < 30; ++i) Step(clock, pace, absl::Milliseconds(200), absl::ZeroDuration());
  for (int i = 0; i < 9; ++i) Step(clock, pace, absl::Milliseconds(50), absl::ZeroDuration());
  clock.Advance(absl::Milliseconds(50));
  pace.CallStarted();
  pace.CallEnded(/*paced_round=*/true);
  // Every step of round 1: 40 steps in 6.5 s (the last 2 s alone: 10 of 50 ms and 7.5 of 200).
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 40 / 6.5);
  // Into round 2: its steps join round 1's.
  Step(clock, pace, absl::Milliseconds(500), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 41 / 7.0);
  // Round 2 ends: round 1's steps go, round 2's are the pace.
  Step(clock, pace, absl::Milliseconds(500), absl::ZeroDuration());
  clock.Advance(absl::Milliseconds(500));
  pace.CallStarted();
  pace.CallEnded(/*paced_round=*/true);
  Step(clock, pace, absl::Milliseconds(500), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 2.0);
  // A job without paced rounds keeps the 2 s window (FollowsAChangeOfPaceWithinTheWindow), and
  // Reset forgets the rounds too.
  pace.Reset();
  pace.CallStarted();
  pace.CallEnded();
  for (int i = 0; i < 40; ++i) Step(clock, pace, absl::Milliseconds(100), absl::ZeroDuration());
  for (int i = 0; i < 20; ++i) Step(clock, pace, absl::Milliseconds(200), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 5.0);
}

TEST(PaceTracker, MixedStepsAreStepsOverComputeTime) {
  FakeClock clock;
  PaceTracker pace(clock, absl::Seconds(10));
  pace.CallStarted();
  pace.CallEnded();
  Step(clock, pace, absl::Milliseconds(100), absl::Milliseconds(50));
  Step(clock, pace, absl::Milliseconds(300), absl::Milliseconds(50));
  // 2 steps in 0.4 s of compute.
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 5.0);
}

TEST(PaceTracker, ResetForgetsTheStepsAndTheGapAfterIt) {
  FakeClock clock;
  PaceTracker pace(clock);
  pace.CallStarted();
  pace.CallEnded();
  Step(clock, pace, absl::Milliseconds(100), absl::ZeroDuration());
  ASSERT_GT(pace.steps_per_second(), 0);
  pace.Reset();
  EXPECT_EQ(pace.steps_per_second(), 0);
  // The time to the next call (a checkpoint restore) is no step's compute.
  clock.Advance(absl::Seconds(30));
  pace.CallStarted();
  pace.CallEnded();
  EXPECT_EQ(pace.steps_per_second(), 0);
  Step(clock, pace, absl::Milliseconds(50), absl::ZeroDuration());
  EXPECT_DOUBLE_EQ(pace.steps_per_second(), 20.0);
}

ClientOptions Valid() {
  ClientOptions o;
  o.coordinator = "127.0.0.1:1";
  o.job_id = "job";
  return o;
}

TEST(TokensPerStep, DefaultIsOneAndValidValuesPass) {
  EXPECT_EQ(ClientOptions{}.tokens_per_step, 1);
  for (double t : {1e-9, 0.5, 1.0, 4096.0, 1e12}) {
    ClientOptions o = Valid();
    o.tokens_per_step = t;
    EXPECT_TRUE(ValidateOptions(o).ok()) << t;
  }
}

TEST(TokensPerStep, OutOfRangeIsInvalidArgument) {
  for (double t : {0.0, -1.0, 1.000001e12, std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::quiet_NaN()}) {
    ClientOptions o = Valid();
    o.tokens_per_step = t;
    absl::Status s = ValidateOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_THAT(s.message(), HasSubstr("ClientOptions.tokens_per_step")) << t;
    EXPECT_THAT(s.message(), HasSubstr("(0, 1e12]")) << t;
  }
}

class TokensPerStepEnvironment : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("MODELAVG_TOKENS_PER_STEP"); }
};

TEST_F(TokensPerStepEnvironment, UnsetOrEmptyGivesTheFallback) {
  unsetenv("MODELAVG_TOKENS_PER_STEP");
  EXPECT_EQ(*TokensPerStepFromEnvironment(1), 1);
  EXPECT_EQ(*TokensPerStepFromEnvironment(3), 3);
  setenv("MODELAVG_TOKENS_PER_STEP", "", 1);
  EXPECT_EQ(*TokensPerStepFromEnvironment(1), 1);
}

TEST_F(TokensPerStepEnvironment, ANumberIsTaken) {
  setenv("MODELAVG_TOKENS_PER_STEP", "2048", 1);
  EXPECT_EQ(*TokensPerStepFromEnvironment(1), 2048);
  setenv("MODELAVG_TOKENS_PER_STEP", "0.25", 1);
  EXPECT_EQ(*TokensPerStepFromEnvironment(1), 0.25);
}

TEST_F(TokensPerStepEnvironment, ABadValueNamesTheVariable) {
  for (const char* v : {"0", "-3", "abc", "nan", "inf", "2e12", "1 2"}) {
    setenv("MODELAVG_TOKENS_PER_STEP", v, 1);
    absl::StatusOr<double> t = TokensPerStepFromEnvironment(1);
    ASSERT_FALSE(t.ok()) << v;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_THAT(t.status().message(), HasSubstr("MODELAVG_TOKENS_PER_STEP=")) << v;
  }
}

}  // namespace
}  // namespace modelavg::client
