// The finite check of a streaming level's background rounds (Level.sync_delay > 0,
// docs/streaming.md): the all-reduce started by the call at the sync step runs on a thread and
// is applied by the call sync_delay steps later, which is where a member's NaN is answered.
// modelavg-trace-worker ranks over Gloo on loopback, 4 of them, their parameters as 8 tensors:
// one outer level of the world (period 8 in 2 fragments, lr 0.7, momentum 0.9, nesterov,
// mix 0.5, sync_delay 2). Fragment 0 (tensors 0-3) syncs at steps 0, 8, 16, ...; fragment 1
// at 4, 12, ... One rank makes element 1 of tensor 0 non-finite before its call of step 8, so
// its pseudo-gradient of fragment 0 carries it into the sync started at step 8.
//  * A strict job: every rank's call of step 10 (the apply step) fails naming the rank, the
//    sync step, the value and the fragment's pseudo-gradient, with its parameters bit for bit
//    as before the call; the steps before follow the rule exactly (streaming_reference.h).
//  * An elastic job: that rank's call of step 10 fails the same way and the coordinator
//    retires it; the others run the sync of step 8 again without it, inside their call of
//    step 10, from their step-8 inputs, and go on to the end. Every rank's every tensor at
//    every step is compared with the rule restated here, with the members each sync had.
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/naive_outer_sgd.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 4;
constexpr int kTensors = 8;
constexpr int64_t kSteps = 32;
constexpr int64_t kNaNStep = 8;
constexpr int64_t kDelay = 2;

v1::JobSpec DelayedSpec(const std::string& id, bool elastic) {
  v1::JobSpec spec = MakeSpec(id, kWorld, v1::PERIODIC, {{8, kWorld}}, 0, /*heartbeat_ms=*/3000);
  if (elastic) spec.set_min_world_size(2);
  v1::Level* level = spec.mutable_levels(0);
  level->mutable_outer()->set_lr(0.7);
  level->mutable_outer()->set_momentum(0.9);
  level->mutable_outer()->set_nesterov(true);
  level->set_fragments(2);
  level->set_mix(0.5);
  level->set_sync_delay(kDelay);
  return spec;
}

// The rule for DelayedSpec, restated for a run in which rank `bad` calls up to step
// `bad_last` and is left out of the sync of step `excluded_at` (-1: of none): x_r,t starts at r
// and gets (t + 1)(r + 1)(s + 1)/2 before the call of step s; the sync of step s (s mod 4 == 0,
// fragment (s / 4) mod 2, tensors [4f, 4f + 4)) takes the mean over its contributors of x (the
// fragment's first sync) or A - x at s, and is applied at s + 2, before that step's decision, by
// its contributors that still call then: A := mean, or SGD on A with that mean (per rank, per
// tensor momentum); x := (1 - mix) A + mix x. Returns want[s][r] (empty where r made no call).
std::vector<std::vector<std::vector<double>>> Reference(const v1::JobSpec& spec, int bad,
                                                        int64_t bad_last, int64_t excluded_at) {
  const v1::Level& l = spec.levels(0);
  const int per = kTensors / l.fragments();
  const int64_t every = l.period() / l.fragments();
  const auto calls = [&](int r, int64_t s) { return r != bad || s <= bad_last; };
  std::vector<std::vector<double>> x(kWorld, std::vector<double>(kTensors));
  std::vector<std::vector<std::optional<double>>> anchor(
      kWorld, std::vector<std::optional<double>>(kTensors));
  auto momentum = anchor;
  for (int r = 0; r < kWorld; ++r) x[r].assign(kTensors, r);
  struct Sync {
    int64_t apply;
    int fragment;
    bool first;
    std::vector<int> to;
    std::vector<double> mean;  // per tensor of the fragment
  };
  std::vector<Sync> pending;
  std::vector<std::vector<std::vector<double>>> want(kSteps,
                                                     std::vector<std::vector<double>>(kWorld));
  for (int64_t s = 0; s < kSteps; ++s) {
    for (int r = 0; r < kWorld; ++r) {
      if (!calls(r, s)) continue;
      for (int t = 0; t < kTensors; ++t) x[r][t] += (t + 1) * (r + 1) * (s + 1) * 0.5;
    }
    for (const Sync& p : pending) {
      if (p.apply != s) continue;
      for (int r : p.to) {
        if (!calls(r, s)) continue;
        for (int i = 0; i < per; ++i) {
          const int t = p.fragment * per + i;
          const double a = p.first ? p.mean[i]
                                   : NaiveOuterSgd(l.outer(), p.mean[i], &momentum[r][t],
                                                   *anchor[r][t]);
          anchor[r][t] = a;
          x[r][t] = (1 - l.mix()) * a + l.mix() * x[r][t];
        }
      }
    }
    if (s % every == 0) {
      Sync p{s + l.sync_delay(), static_cast<int>((s / every) % l.fragments()), false, {}, {}};
      for (int r = 0; r < kWorld; ++r) {
        if (calls(r, s) && !(r == bad && s == excluded_at)) p.to.push_back(r);
      }
      p.first = !anchor[p.to[0]][p.fragment * per].has_value();
      const double n = static_cast<double>(p.to.size());
      for (int i = 0; i < per; ++i) {
        const int t = p.fragment * per + i;
        double mean = 0;
        for (int c : p.to) mean += (p.first ? x[c][t] : *anchor[c][t] - x[c][t]) / n;
        p.mean.push_back(mean);
      }
      pending.push_back(std::move(p));
    }
    for (int r = 0; r < kWorld; ++r) {
      if (calls(r, s)) want[s][r] = x[r];
    }
  }
  return want;
}

class ClientNonFiniteDelayedTest : public TraceJobTest {
 protected:
  ClientNonFiniteDelayedTest() : TraceJobTest("nonfinite-delayed") {}

  std::vector<Trace> Run(const v1::JobSpec& spec, int bad, const std::string& value,
                         std::vector<std::string>* errors) {
    std::vector<std::vector<std::string>> flags(kWorld);
    // Element 1: the printed first element of tensor 0 stays finite on the bad rank.
    flags[bad] = {absl::StrCat("--testing_nonfinite_at_step=", kNaNStep),
                  "--testing_nonfinite_value=" + value, "--testing_nonfinite_tensor=0",
                  "--testing_nonfinite_element=1"};
    return RunJob(spec, kSteps, /*numel=*/800,
                  {absl::StrCat("--tensors=", kTensors), "--check_untouched"}, flags, errors);
  }

  // Every line of every rank against `want`; returns the lines compared.
  static int ExpectFollows(const std::vector<Trace>& traces,
                           const std::vector<std::vector<std::vector<double>>>& want) {
    int compared = 0;
    for (int r = 0; r < kWorld; ++r) {
      for (const TraceLine& l : traces[r].lines) {
        const std::string where = absl::StrCat("rank ", r, " step ", l.step, ": ", l.text);
        const std::vector<double> got = l.values;
        EXPECT_EQ(got.size(), static_cast<size_t>(kTensors)) << where;
        EXPECT_EQ(want[l.step][r].size(), static_cast<size_t>(kTensors)) << where;
        if (got.size() != kTensors || want[l.step][r].size() != kTensors) continue;
        for (int t = 0; t < kTensors; ++t) {
          const double w = want[l.step][r][t];
          EXPECT_NEAR(got[t], w, std::max(1e-4, 2e-6 * std::fabs(w))) << where << " tensor " << t;
        }
        ++compared;
      }
    }
    return compared;
  }
};

TEST_F(ClientNonFiniteDelayedTest, StrictJob_EveryApplyCallFails_NothingChanges) {
  constexpr int kBad = 2;
  const v1::JobSpec spec = DelayedSpec("strict", /*elastic=*/false);
  std::vector<std::string> errors;
  const std::vector<Trace> traces = Run(spec, kBad, "nan", &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    const std::string& e = errors[r];
    EXPECT_THAT(e, HasSubstr("exit 1")) << "rank " << r;
    EXPECT_THAT(e, HasSubstr(absl::StrCat("step ", kNaNStep + kDelay, ": AverageParameters")))
        << "rank " << r;
    EXPECT_THAT(e, HasSubstr(absl::StrCat("sync of fragment 0 started at step ", kNaNStep)))
        << "rank " << r;
    EXPECT_THAT(e, HasSubstr("non-finite values: NaN in tensor 0")) << "rank " << r;
    EXPECT_THAT(e, HasSubstr("(rank 2, level 0, pseudo-gradient of fragment 1 of 2)"))
        << "rank " << r;
    EXPECT_THAT(e, HasSubstr("[parameters untouched]")) << "rank " << r;
    // Every rank printed the steps before the apply step (the sync step's call only started
    // the round), none after.
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kNaNStep + kDelay)) << "rank " << r;
  }
  // Up to the failed call, exactly the rule with every rank in every sync.
  const int compared = ExpectFollows(traces, Reference(spec, -1, kSteps, -1));
  EXPECT_EQ(compared, kWorld * (kNaNStep + kDelay));
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("strict");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->nonfinite_reports(), 1);
  EXPECT_EQ(job->last_nonfinite().rank(), kBad);
  EXPECT_EQ(job->last_nonfinite().step(), kNaNStep);
  EXPECT_EQ(job->last_nonfinite().value(), "NaN");
}

TEST_F(ClientNonFiniteDelayedTest, ElasticJob_RankRetired_OthersRunTheSyncAgainExactly) {
  constexpr int kBad = 3;
  const v1::JobSpec spec = DelayedSpec("elastic", /*elastic=*/true);
  std::vector<std::string> errors;
  const std::vector<Trace> traces = Run(spec, kBad, "nan", &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));
  const std::string& bad = errors[kBad];
  EXPECT_THAT(bad, HasSubstr("exit 1"));
  EXPECT_THAT(bad, HasSubstr(absl::StrCat("step ", kNaNStep + kDelay, ": AverageParameters")));
  EXPECT_THAT(bad, HasSubstr("non-finite values: NaN in tensor 0"));
  EXPECT_THAT(bad, HasSubstr("(rank 3, level 0, pseudo-gradient of fragment 1 of 2)"));
  EXPECT_THAT(bad, HasSubstr("[parameters untouched]"));
  EXPECT_EQ(traces[kBad].lines.size(), static_cast<size_t>(kNaNStep + kDelay));
  for (int r = 0; r < kWorld; ++r) {
    if (r == kBad) continue;
    EXPECT_THAT(errors[r], HasSubstr("exit 0")) << "rank " << r;
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (const TraceLine& l : traces[r].lines) {
      if (l.step <= kNaNStep || l.action != "AVERAGE") continue;
      EXPECT_EQ(l.members, (std::vector<int32_t>{0, 1, 2})) << l.text;
    }
  }
  const auto want = Reference(spec, kBad, kNaNStep + kDelay - 1, kNaNStep);
  const int compared = ExpectFollows(traces, want);
  EXPECT_EQ(compared, 3 * kSteps + kNaNStep + kDelay);
  // The reference is not blind: with the bad rank in the sync of step 8, the survivors' last
  // values differ.
  EXPECT_GT(std::fabs(Reference(spec, kBad, kNaNStep + kDelay - 1, -1)[kSteps - 1][0][0] -
                      want[kSteps - 1][0][0]),
            1e-2);
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("elastic");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->nonfinite_reports(), 1);
  EXPECT_EQ(job->last_nonfinite().rank(), kBad);
  EXPECT_EQ(job->last_nonfinite().step(), kNaNStep);
  // The survivors said what they did (their log, on stderr).
  EXPECT_THAT(errors[0], HasSubstr("rank 3, level 0, pseudo-gradient of fragment 1 of 2"));
  EXPECT_THAT(errors[0], HasSubstr("running it again without its member"));
  std::printf("elastic: %d lines compared; rank %d retired at the apply step %lld\n", compared,
              kBad, static_cast<long long>(kNaNStep + kDelay));
}

}  // namespace
}  // namespace modelavg::testing
