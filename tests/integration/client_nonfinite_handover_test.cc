// The finite check of the hand-over to a replacement (docs/elastic.md#non-finite-values): at a
// streaming level's step, the live members hand a replacement admitted there every fragment's
// anchor and momentum and the mean of their block's parameters, before the step's own round.
// A live member's NaN there must not be adopted. An elastic job of 4 modelavg-trace-worker
// ranks over Gloo on loopback, their parameters as 8 tensors: one outer level of the world
// (period 4 in 2 fragments, lr 0.7, momentum 0.9, nesterov). Rank 3 is killed with SIGKILL and
// a worker started without --rank replaces it; rank 2 makes one of its values NaN just before
// the call that admits the replacement (--testing_nonfinite_at_admission). Its call fails naming
// what it handed over and the coordinator retires it; ranks 0 and 1 and the replacement retry
// the admission round without it inside the same call: the replacement's first values are the
// mean of ranks 0 and 1's (finite), and from then on every fragment it syncs equals its peers'.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/elastic_workers_fixture.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr int kTensors = 8;
constexpr int64_t kSteps = 60;
constexpr int kVictim = 3;
constexpr int kBad = 2;
constexpr absl::Duration kRunDeadline = absl::Seconds(90);

class ClientNonFiniteHandOverTest : public ElasticWorkersTest {
 protected:
  ClientNonFiniteHandOverTest() : ElasticWorkersTest("nonfinite-handover", kWorld) {}

  // Starts a worker (rank -1: a replacement, the coordinator picks its rank).
  size_t Start(const std::string& job, int rank, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {absl::StrCat("--steps=", kSteps), "--numel=800",
                                      absl::StrCat("--tensors=", kTensors),
                                      "--step_delay_ms=100"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return StartWorker(job, rank, flags);
  }

  std::string Diagnostics() { return ElasticWorkersTest::Diagnostics(1500); }
};

TEST_F(ClientNonFiniteHandOverTest, DonorsNaN_NotAdopted_DonorRetired_ReplacementGetsTheOthers) {
  ASSERT_TRUE(cluster_.ok()) << cluster_.dir();
  const std::string job = "handover";
  v1::JobSpec spec = MakeSpec(job, kWorld, v1::PERIODIC, {{4, kWorld}}, 0, /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  v1::Level* level = spec.mutable_levels(0);
  level->mutable_outer()->set_lr(0.7);
  level->mutable_outer()->set_momentum(0.9);
  level->mutable_outer()->set_nesterov(true);
  level->set_fragments(2);
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  for (int r = 0; r < kWorld; ++r) {
    Start(job, r,
          r == kBad ? std::vector<std::string>{"--testing_nonfinite_at_admission",
                                               "--testing_nonfinite_tensor=5",
                                               "--check_untouched"}
                    : std::vector<std::string>{});
  }
  ASSERT_TRUE(WaitFor([&] {
    const Trace t = TraceOf(0);
    return !t.lines.empty() && t.lines.back().step >= 9;
  })) << Diagnostics();
  workers_[kVictim]->Signal(SIGKILL);
  ASSERT_TRUE(workers_[kVictim]->Wait(absl::Seconds(10)).has_value());
  // The survivors averaged without rank 3: a replacement.
  ASSERT_TRUE(WaitFor([&] {
    for (const TraceLine& l : TraceOf(0).lines) {
      if (l.action == "AVERAGE" && l.members == std::vector<int32_t>{0, 1, 2}) return true;
    }
    return false;
  })) << Diagnostics();
  const size_t replacement = Start(job, -1);

  // Rank 2: its call at the admission step fails naming what it handed over.
  const std::optional<int> bad_code = workers_[kBad]->Wait(kRunDeadline);
  ASSERT_TRUE(bad_code.has_value()) << "rank 2 still running" << Diagnostics();
  EXPECT_EQ(*bad_code, 1) << Diagnostics();
  const std::string bad_err = workers_[kBad]->err();
  EXPECT_THAT(bad_err, HasSubstr("non-finite values: NaN in tensor 5"));
  EXPECT_THAT(bad_err, HasSubstr("(rank 2, level 0, values handed to the replacement)"));
  EXPECT_THAT(bad_err, HasSubstr("[parameters untouched]"));
  for (size_t i : {size_t{0}, size_t{1}, replacement}) {
    const std::optional<int> code = workers_[i]->Wait(kRunDeadline);
    ASSERT_TRUE(code.has_value()) << "worker " << i << " still running" << Diagnostics();
    EXPECT_EQ(*code, 0) << "worker " << i << Diagnostics();
  }

  const Trace mine = TraceOf(replacement);
  const Trace bad = TraceOf(kBad);
  ASSERT_FALSE(mine.lines.empty()) << Diagnostics();
  const TraceLine& first = mine.lines.front();
  EXPECT_EQ(first.rank, kVictim);
  EXPECT_TRUE(first.admitted) << first.text;
  EXPECT_EQ(first.members, (std::vector<int32_t>{0, 1, 3})) << first.text;
  // Rank 2 printed every step before the admission step, none from it on.
  ASSERT_FALSE(bad.lines.empty());
  EXPECT_EQ(bad.lines.back().step, first.step - 1);
  const std::vector<Trace> peers = {TraceOf(0), TraceOf(1)};
  for (const Trace& p : peers) ASSERT_EQ(p.lines.size(), static_cast<size_t>(kSteps)) << p.who;
  // At the admission step the fragment not synced then holds the mean of ranks 0 and 1's values
  // (theirs do not change at that step): rank 2's NaN was not adopted, nor its values.
  const int synced = static_cast<int>((first.step / 2) % 2);
  const std::vector<double> got = first.values;
  ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << first.text;
  for (int t = 0; t < kTensors; ++t) {
    EXPECT_TRUE(std::isfinite(got[t])) << first.text;
    if (t / (kTensors / 2) == synced) continue;
    double mean = 0;
    for (const Trace& p : peers) mean += p.lines[first.step].values[t] / 2;
    EXPECT_NEAR(got[t], mean, std::max(1e-4, 1e-5 * std::fabs(mean)))
        << "tensor " << t << " of the admission line " << first.text;
  }
  // The mean with rank 2's values (its finite ones: its last line plus its update at the
  // admission step) would differ: the comparison is not blind.
  {
    const int t = synced == 0 ? kTensors - 1 : 0;
    const double bad_before = bad.lines.back().values[t] +
                              (t + 1) * (kBad + 1) * (first.step + 1) * 0.5;
    double with_bad = bad_before / 3, without = 0;
    for (const Trace& p : peers) {
      with_bad += p.lines[first.step].values[t] / 3;
      without += p.lines[first.step].values[t] / 2;
    }
    EXPECT_GT(std::fabs(with_bad - without), 1e-2);
  }
  // From the admission on, every fragment the replacement syncs equals its peers'.
  int compared = 0;
  for (const TraceLine& l : mine.lines) {
    if (l.action != "AVERAGE") continue;
    EXPECT_EQ(l.members, (std::vector<int32_t>{0, 1, 3})) << l.text;
    const int fragment = static_cast<int>((l.step / 2) % 2);
    const std::vector<double> values = l.values;
    for (const Trace& p : peers) {
      const std::vector<double> want = p.lines[l.step].values;
      for (int t = fragment * kTensors / 2; t < (fragment + 1) * kTensors / 2; ++t) {
        EXPECT_NEAR(values[t], want[t], std::max(1e-5, 1e-6 * std::fabs(want[t])))
            << "step " << l.step << " tensor " << t << ": " << l.text;
      }
    }
    ++compared;
  }
  EXPECT_GT(compared, 4) << "too few outer steps after the admission to prove it";
  absl::StatusOr<v1::Job> state = cluster_.admin()->GetJob(job);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->nonfinite_reports(), 1);
  EXPECT_EQ(state->last_nonfinite().rank(), kBad);
  EXPECT_EQ(state->last_nonfinite().step(), first.step);
  std::printf("handover: replacement admitted at step %lld without rank 2's NaN; %d outer steps "
              "compared\n",
              static_cast<long long>(first.step), compared);
}

}  // namespace
}  // namespace modelavg::testing
