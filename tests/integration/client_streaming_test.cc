// Streaming sync (Level.fragments, mix, payload; docs/streaming.md) with real processes:
// modelavg-trace-worker ranks over Gloo on loopback, their parameters passed as 8 tensors,
// against a coordinator started here. Every rank's every tensor at every step is compared with
// an independent re-statement of the rule (streaming_reference.h, double precision): FP32
// exactly (to float32 rounding), BF16 and INT8 within the documented bound of the averaged
// pseudo-gradient, summed over the level's outer steps.
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

constexpr int kTensors = 8;

class ClientStreamingTest : public TraceJobTest {
 protected:
  ClientStreamingTest() : TraceJobTest("streaming") {}

  // Each rank's parameters as kTensors tensors; `extra[r]`: more flags for rank r; `errors`: as
  // RunJob's.
  std::vector<Trace> Run(const v1::JobSpec& spec, int64_t steps, int64_t numel = 64,
                         const std::vector<std::vector<std::string>>& extra = {},
                         std::vector<std::string>* errors = nullptr) {
    return RunJob(spec, steps, numel, {absl::StrCat("--tensors=", kTensors)}, extra, errors);
  }

  // Every rank, every step, every tensor. `int8`/`bf16`: the compressed payload's bound, per
  // outer step of a tensor, added up over the run (the anchor carries the error on).
  // `modelled`: the reference restates the level's INT8/INT4 payload and error feedback
  // (StreamingReference's model_payload), so the values must match to float32 rounding.
  void ExpectFollowsReference(const v1::JobSpec& spec, const std::vector<Trace>& traces,
                              int64_t steps, v1::Payload payload = v1::FP32,
                              bool modelled = false) {
    const auto want = StreamingReference(spec, steps, kTensors, modelled);
    if (modelled) payload = v1::FP32;  // no allowance: the payload is in the reference
    ASSERT_EQ(traces.size(), static_cast<size_t>(spec.world_size()));
    int fragment_lines = 0;
    int inexact = 0;
    for (int r = 0; r < spec.world_size(); ++r) {
      ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(steps)) << "rank " << r;
      std::vector<double> allowed(kTensors, 0.0);
      for (int64_t s = 0; s < steps; ++s) {
        const TraceLine& l = traces[r].lines[s];
        const StreamingStep& w = want[s][r];
        const std::string where = absl::StrCat("rank ", r, " step ", s, ": ", l.text);
        ASSERT_EQ(l.step, s) << where;
        EXPECT_EQ(l.action, w.average ? "AVERAGE" : "SKIP") << where;
        EXPECT_EQ(l.level, w.level) << where;
        if (w.average) {
          EXPECT_EQ(l.fragment, w.fragment) << where;
          fragment_lines += w.fragment > 0;
        }
        const std::vector<double> got = l.values;
        ASSERT_EQ(got.size(), static_cast<size_t>(kTensors)) << where;
        // An INT8 block may hold several tensors of the fragment: its largest |A - x| is at most
        // the fragment's.
        double m_fragment = 0;
        for (double m : w.max_delta) m_fragment = std::max(m_fragment, m);
        for (int t = 0; t < kTensors; ++t) {
          // Documented bound of one averaged pseudo-gradient element (docs/streaming.md):
          // INT8 2 M / 254, BF16 2^-8 * 2 M, M the largest |A - x| of the block's members.
          const double m = w.max_delta[t];
          if (payload == v1::INT8 && m > 0) allowed[t] += 2 * m_fragment / 254 * 1.01;
          if (payload == v1::BF16) allowed[t] += std::ldexp(2 * m, -8) * 1.01;
          const double tol = std::max(1e-4, 2e-6 * std::fabs(w.values[t])) + allowed[t];
          EXPECT_NEAR(got[t], w.values[t], tol) << where << " tensor " << t;
          inexact += std::fabs(got[t] - w.values[t]) > 1e-3;
        }
      }
    }
    EXPECT_GT(fragment_lines, 0);
    if (payload != v1::FP32) EXPECT_GT(inexact, 0) << "the payload was not compressed";
  }
};

// The documented example: (4, 2) then (8, 4, fragments 4): the fragmented level takes every
// even step, one fragment at a time, and outranks the first level.
TEST_F(ClientStreamingTest, PlainFragmentedLevelOutranksAnother_FollowsRule) {
  v1::JobSpec spec = MakeSpec("plainfrag", 4, v1::HIERARCHICAL, {{4, 2}, {8, 4}}, 0);
  spec.mutable_levels(1)->set_fragments(4);
  ExpectFollowsReference(spec, Run(spec, 20), 20);
}

TEST_F(ClientStreamingTest, PlainFragmentsBelowWholeModelLevel_FollowsRule) {
  v1::JobSpec spec = MakeSpec("plainbelow", 4, v1::HIERARCHICAL, {{4, 2}, {12, 4}}, 3);
  spec.mutable_levels(0)->set_fragments(2);
  ExpectFollowsReference(spec, Run(spec, 26), 26);
}

TEST_F(ClientStreamingTest, OuterFragmentsNesterovMix_Periodic_FollowsRule) {
  for (int world : {2, 4}) {
    v1::JobSpec spec =
        MakeSpec(absl::StrCat("outerfrag", world), world, v1::PERIODIC, {{4, world}}, 3);
    SetOuter(&spec, 0, 0.7, 0.9, true);
    spec.mutable_levels(0)->set_fragments(2);
    spec.mutable_levels(0)->set_mix(0.25);
    ExpectFollowsReference(spec, Run(spec, 30), 30);
  }
}

TEST_F(ClientStreamingTest, OuterFragmentedLevelLast_Hierarchical_FollowsRule) {
  v1::JobSpec spec = MakeSpec("outerlast", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 1);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  spec.mutable_levels(1)->set_fragments(4);
  ExpectFollowsReference(spec, Run(spec, 34), 34);
}

// Sharded replicas (JobSpec.replica_size 2): fragments and a delayed, mixed sync of each
// shard among the ranks that hold it.
TEST_F(ClientStreamingTest, ShardedReplicasOf2_OuterFragmentsDelayedMix_FollowsRule) {
  v1::JobSpec spec = MakeSpec("sharded", 8, v1::HIERARCHICAL, {{2, 4}, {8, 8}}, 1);
  spec.set_replica_size(2);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  spec.mutable_levels(1)->set_fragments(2);
  spec.mutable_levels(1)->set_sync_delay(1);
  spec.mutable_levels(1)->set_mix(0.25);
  ExpectFollowsReference(spec, Run(spec, 26), 26);
}

TEST_F(ClientStreamingTest, CompressedPayloads_WithinDocumentedBound) {
  for (v1::Payload p : {v1::BF16, v1::INT8}) {
    // World 3: a fragment of 4 tensors of 125 elements is cut into chunks of 167 that cross
    // tensor boundaries, so INT8 blocks mix tensors of different magnitudes.
    v1::JobSpec spec =
        MakeSpec(absl::StrCat("payload", v1::Payload_Name(p)), 3, v1::PERIODIC, {{4, 3}}, 1);
    SetOuter(&spec, 0, 1.0, 0.0, false);
    spec.mutable_levels(0)->set_fragments(2);
    spec.mutable_levels(0)->set_payload(p);
    ExpectFollowsReference(spec, Run(spec, 24, 1000), 24,
                           p);
  }
}

// sync_delay: the all-reduce started at the sync step is applied tau steps later; the fragment's
// first sync too. Periodic with warm-up, nesterov, mix.
TEST_F(ClientStreamingTest, DelayedSyncWithMix_Periodic_FollowsRule) {
  for (int tau : {1, 3}) {
    v1::JobSpec spec =
        MakeSpec(absl::StrCat("delay", tau), 2, v1::PERIODIC, {{8, 2}}, 2);
    SetOuter(&spec, 0, 0.7, 0.9, true);
    spec.mutable_levels(0)->set_fragments(2);
    spec.mutable_levels(0)->set_sync_delay(tau);
    spec.mutable_levels(0)->set_mix(0.5);
    ExpectFollowsReference(spec, Run(spec, 40), 40);
  }
}

// The apply step s + tau is itself an averaging step of another level: the pending fragment is
// applied first, then that level averages the result.
TEST_F(ClientStreamingTest, DelayedSyncLandingOnAnotherLevelsStep_AppliedFirst) {
  v1::JobSpec spec = MakeSpec("landing", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0);
  SetOuter(&spec, 1, 0.7, 0.9, false);
  spec.mutable_levels(1)->set_fragments(2);
  spec.mutable_levels(1)->set_sync_delay(2);
  ExpectFollowsReference(spec, Run(spec, 34), 34);
}

TEST_F(ClientStreamingTest, DelayedSyncInt8_WithinDocumentedBound) {
  v1::JobSpec spec = MakeSpec("delayint8", 3, v1::PERIODIC, {{4, 3}}, 0);
  SetOuter(&spec, 0, 1.0, 0.0, false);
  spec.mutable_levels(0)->set_fragments(2);
  spec.mutable_levels(0)->set_sync_delay(1);
  spec.mutable_levels(0)->set_payload(v1::INT8);
  ExpectFollowsReference(spec, Run(spec, 24, 1000), 24, v1::INT8);
}

int64_t Field(const std::string& text, const std::string& name) {
  const std::string key = "\"" + name + "\": ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  int64_t v = -1;
  const size_t from = at + key.size();
  return absl::SimpleAtoi(text.substr(from, text.find_first_of(",}", from) - from), &v) ? v : -1;
}

// Overlap: rank 1 sleeps 1.5 s before its call at the sync step 8 (fragment 0's second sync).
// Rank 0's call at step 8 returns at once (the all-reduce runs in the background); its call at
// 8 + tau waits for rank 1. Values follow the rule throughout.
TEST_F(ClientStreamingTest, DelayedSync_CallAtSyncStepReturnsBeforeAllReduceEnds) {
  constexpr int kTau = 3;
  constexpr int kSleepMs = 1500;
  v1::JobSpec spec = MakeSpec("overlap", 2, v1::PERIODIC, {{8, 2}}, 0);
  SetOuter(&spec, 0, 0.7, 0.9, true);
  spec.mutable_levels(0)->set_fragments(2);
  spec.mutable_levels(0)->set_sync_delay(kTau);
  const std::vector<Trace> traces =
      Run(spec, 16, 64,
          {{"--unix_ms"},
           {"--unix_ms", "--testing_sleep_at_step=8",
            absl::StrCat("--testing_sleep_ms=", kSleepMs)}});
  ExpectFollowsReference(spec, traces, 16);
  ASSERT_EQ(traces.size(), 2u);
  ASSERT_EQ(traces[0].lines.size(), 16u);
  const std::string& at_sync = traces[0].lines[8].text;
  const std::string& at_apply = traces[0].lines[8 + kTau].text;
  // The sync step's call did not wait for the sleeping peer...
  EXPECT_LT(Field(at_sync, "call_ms"), kSleepMs / 3) << at_sync;
  // ...the apply step's call did (rank 0 reached it long before rank 1 woke).
  EXPECT_GT(Field(at_apply, "call_ms"), kSleepMs / 3) << at_apply;
  // And rank 0 finished step 8 before rank 1 had even started it.
  EXPECT_LT(Field(at_sync, "unix_ms") + kSleepMs / 2,
            Field(traces[1].lines[8].text, "unix_ms"));
}

// kill -9 of a member while a background all-reduce runs (strict job): rank 1 starts fragment
// 0's sync at step 8 and dies at once; rank 0, slowed before that call, joins the all-reduce
// with a dead peer. Its call at 8 + tau fails with a one-line error (no hang), and every line it
// printed before follows the rule.
TEST_F(ClientStreamingTest, MemberKilledDuringBackgroundAllReduce_SurvivorFailsCleanly) {
  constexpr int kTau = 2;
  v1::JobSpec spec = MakeSpec("killed", 2, v1::PERIODIC, {{8, 2}}, 0);
  spec.set_heartbeat_timeout_ms(2000);
  SetOuter(&spec, 0, 0.7, 0.9, true);
  spec.mutable_levels(0)->set_fragments(2);
  spec.mutable_levels(0)->set_sync_delay(kTau);
  std::vector<std::string> errors;
  const absl::Time start = absl::Now();
  const std::vector<Trace> traces =
      Run(spec, 16, 64,
          {{"--testing_sleep_at_step=8", "--testing_sleep_ms=500"},
           {"--testing_die_after_step=8"}},
          &errors);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "the survivor waited too long";
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_THAT(errors[0], ::testing::StartsWith("exit 1")) << errors[0];
  EXPECT_THAT(errors[0], ::testing::HasSubstr(absl::StrCat("step ", 8 + kTau))) << errors[0];
  EXPECT_THAT(errors[0], ::testing::HasSubstr("rank 1")) << errors[0];
  // Rank 0's lines before the failing call follow the rule.
  const auto want = StreamingReference(spec, 16, kTensors);
  ASSERT_EQ(traces.size(), 2u);
  ASSERT_EQ(traces[0].lines.size(), static_cast<size_t>(8 + kTau)) << errors[0];
  for (int64_t s = 0; s < 8 + kTau; ++s) {
    const std::vector<double> got = traces[0].lines[s].values;
    ASSERT_EQ(got.size(), static_cast<size_t>(kTensors));
    for (int t = 0; t < kTensors; ++t) {
      EXPECT_NEAR(got[t], want[s][0].values[t], std::max(1e-4, 2e-6 * std::fabs(got[t])))
          << "step " << s << " tensor " << t;
    }
  }
}

// state_dict() of a streaming level: per-fragment anchors and momenta, and the background
// all-reduce in flight at the checkpoint (fragment 1's sync started at step 20, due at 22).
// Steps 0..20 saved with --save_state, steps 21..29 in new processes (a new job of the same
// spec) from --load_state: the same values, exactly, as one run of steps 0..29; and that run
// follows the rule.
TEST_F(ClientStreamingTest, StateDict_ResumedWithPendingSync_EqualsUninterruptedRun) {
  // INT4 with error feedback: the residual is part of the state too.
  for (v1::Payload payload : {v1::FP32, v1::INT8, v1::INT4}) {
    SCOPED_TRACE(v1::Payload_Name(payload));
    const std::string name = absl::AsciiStrToLower(v1::Payload_Name(payload));
    v1::JobSpec spec = MakeSpec("whole" + name, 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 1);
    SetOuter(&spec, 1, 0.8, 0.9, true);
    spec.mutable_levels(1)->set_fragments(2);
    spec.mutable_levels(1)->set_sync_delay(2);
    spec.mutable_levels(1)->set_mix(0.25);
    spec.mutable_levels(1)->set_payload(payload);
    if (payload == v1::INT4) spec.mutable_levels(1)->set_error_feedback(0.9);
    constexpr int64_t kSteps = 30;
    constexpr int64_t kSaveAfter = 21;  // steps 0..20
    const std::vector<Trace> whole = Run(spec, kSteps);
    if (payload == v1::FP32) ExpectFollowsReference(spec, whole, kSteps);
    const std::string prefix = absl::StrCat(cluster_.dir(), "/state-", name, "-rank");
    std::vector<std::vector<std::string>> save(4), load(4);
    for (int r = 0; r < 4; ++r) {
      save[r] = {absl::StrCat("--save_state=", prefix, r)};
      load[r] = {absl::StrCat("--load_state=", prefix, r)};
    }
    spec.set_job_id("before" + name);
    const std::vector<Trace> before = Run(spec, kSaveAfter, 64, save);
    // The checkpoint holds the pending sync and both fragments' state.
    const absl::StatusOr<std::string> saved = ReadFileToString(prefix + "0");
    ASSERT_TRUE(saved.ok()) << saved.status();
    EXPECT_THAT(*saved, ::testing::HasSubstr("\npending 1 1 20 22 0\n"));
    EXPECT_THAT(*saved, ::testing::HasSubstr("\nfanchor 1 1 0 "));
    EXPECT_THAT(*saved, ::testing::HasSubstr("\nfmomentum 1 0 0 "));
    if (payload == v1::INT4) {
      EXPECT_THAT(*saved, ::testing::HasSubstr("\nfresidual 1 0 0 "));
      EXPECT_THAT(*saved, ::testing::HasSubstr("\nfresidual 1 1 0 "));
    }
    spec.set_job_id("after" + name);
    const std::vector<Trace> after = Run(spec, kSteps, 64, load);
    ASSERT_EQ(whole.size(), 4u);
    ASSERT_EQ(after.size(), 4u);
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(before[r].lines.size(), static_cast<size_t>(kSaveAfter));
      ASSERT_EQ(after[r].lines.size(), static_cast<size_t>(kSteps - kSaveAfter)) << "rank " << r;
      for (size_t i = 0; i < after[r].lines.size(); ++i) {
        const TraceLine& got = after[r].lines[i];
        const TraceLine& want = whole[r].lines[kSaveAfter + i];
        EXPECT_EQ(got.step, want.step);
        EXPECT_EQ(got.values, want.values) << "rank " << r << " step " << got.step;
        EXPECT_EQ(got.action, want.action);
      }
    }
  }
}

// Error feedback (Level.error_feedback, docs/streaming.md): every member, every step, against
// the reference that restates U = beta E + D, C = decode(encode(U)), E = U - C and the group's
// re-encoded mean of C from the payload's documented encoding. W 2 and 4, beta 1 and 0.9,
// INT4 (and INT8 once), fragments, nesterov momentum, a mix; and with a sync delay.
class ClientFeedbackTest : public ClientStreamingTest {
 protected:
  static v1::JobSpec FeedbackSpec(const std::string& id, int world, v1::Payload payload,
                                  double beta, int64_t delay) {
    v1::JobSpec spec = MakeSpec(id, world, v1::PERIODIC, {{4, world}}, 1);
    SetOuter(&spec, 0, 0.7, 0.9, true);
    spec.mutable_levels(0)->set_fragments(2);
    spec.mutable_levels(0)->set_payload(payload);
    spec.mutable_levels(0)->set_error_feedback(beta);
    spec.mutable_levels(0)->set_sync_delay(delay);
    if (delay == 0) spec.mutable_levels(0)->set_mix(0.25);
    return spec;
  }

  void ExpectFeedbackRun(const v1::JobSpec& spec, int64_t steps) {
    // 64 elements in 8 tensors: a fragment is 32 elements, one block of the payload.
    ExpectFollowsReference(spec, Run(spec, steps), steps, spec.levels(0).payload(),
                           /*modelled=*/true);
    // The payload matters: the modelled run leaves the FP32 rule's values.
    const auto exact = StreamingReference(spec, steps, kTensors, false);
    const auto modelled = StreamingReference(spec, steps, kTensors, true);
    double apart = 0;
    for (int64_t s = 0; s < steps; ++s) {
      for (int t = 0; t < kTensors; ++t) {
        apart = std::max(apart, std::fabs(exact[s][0].values[t] - modelled[s][0].values[t]));
      }
    }
    EXPECT_GT(apart, 1e-2) << "the payload changed nothing: the test would not see it";
  }
};

TEST_F(ClientFeedbackTest, Int4_Blocking_FollowsReference) {
  for (int world : {2, 4}) {
    for (double beta : {1.0, 0.9}) {
      SCOPED_TRACE(absl::StrCat("world ", world, " beta ", beta));
      ExpectFeedbackRun(FeedbackSpec(absl::StrCat("fb", world, "b", beta == 1 ? 10 : 9), world,
                                     v1::INT4, beta, 0),
                        26);
    }
  }
}

TEST_F(ClientFeedbackTest, Int4WithoutFeedback_FollowsReference) {
  ExpectFeedbackRun(FeedbackSpec("fbnone", 2, v1::INT4, 0.0, 0), 26);
}

TEST_F(ClientFeedbackTest, Int8_Blocking_FollowsReference) {
  ExpectFeedbackRun(FeedbackSpec("fbint8", 4, v1::INT8, 1.0, 0), 26);
}

TEST_F(ClientFeedbackTest, Int4_SyncDelay_FollowsReference) {
  for (int world : {2, 4}) {
    const double beta = world == 2 ? 1.0 : 0.9;
    SCOPED_TRACE(absl::StrCat("world ", world, " beta ", beta));
    ExpectFeedbackRun(FeedbackSpec(absl::StrCat("fbdelay", world), world, v1::INT4, beta, 1),
                      26);
  }
}

// bfloat16 rounding, to nearest even, restated (finite values).
double NaiveBf16(double v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  bits &= 0xffff0000u;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// TOPK with error feedback restated element by element (the elements of a tensor part ways
// once some are sent and others not), for the trace worker's update with --tensors=T and
// `numel` elements: a periodic job of one outer level (group = world, fragments F, no delay, no
// mix). Per member at a fragment's outer step: U = beta E + (A - x) (U in float32), C = the k
// entries of largest |U| of each block of 1024 of the fragment (ties: lower index) rounded to
// bfloat16, the rest 0; E = U - C (beta > 0); the mean of C over the members rounded to
// bfloat16 is D. Returns [step][rank][tensor]: each tensor's first element; `moved[t]`: how far
// the anchor of tensor t's first element moved from its fragment's first sync to the end.
std::vector<std::vector<std::vector<double>>> TopkReference(const v1::JobSpec& spec,
                                                            int64_t steps, int tensors,
                                                            int64_t numel,
                                                            std::vector<double>* moved) {
  const v1::Level& l = spec.levels(0);
  const int world = spec.world_size();
  const int fragments = Fragments(l);
  const int64_t per_tensor = numel / tensors;
  const int64_t k = static_cast<int64_t>(std::ceil(l.topk_density() * 1024));
  const double beta = l.error_feedback();
  std::vector<std::vector<double>> x(world, std::vector<double>(numel));
  std::vector<std::vector<double>> e(world, std::vector<double>(numel, 0.0));
  std::vector<double> anchor(numel, 0.0);  // the same on every member
  std::vector<double> first_anchor(numel, 0.0);
  std::vector<std::optional<double>> momentum(numel);
  std::vector<bool> has_anchor(fragments, false);
  for (int r = 0; r < world; ++r) std::fill(x[r].begin(), x[r].end(), r);
  std::vector<std::vector<std::vector<double>>> out;
  const int64_t h = l.period() / fragments;
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < numel; ++i) {
        x[r][i] += static_cast<double>(static_cast<float>((r + 1) * (s + 1)) * 0.5f) *
                   static_cast<double>(i / per_tensor + 1);
      }
    }
    if (s >= spec.warmup_steps() && (s - spec.warmup_steps()) % h == 0) {
      const int f = static_cast<int>(((s - spec.warmup_steps()) / h) % fragments);
      const int64_t lo = f * (tensors / fragments) * per_tensor;
      const int64_t hi = lo + (tensors / fragments) * per_tensor;
      if (!has_anchor[f]) {
        has_anchor[f] = true;
        for (int64_t i = lo; i < hi; ++i) {
          double mean = 0;
          for (int r = 0; r < world; ++r) mean += x[r][i] / world;
          anchor[i] = first_anchor[i] = mean;
          for (int r = 0; r < world; ++r) x[r][i] = mean;
        }
      } else {
        std::vector<double> mean(numel, 0.0);
        for (int r = 0; r < world; ++r) {
          std::vector<double> u(numel, 0.0);
          for (int64_t i = lo; i < hi; ++i) {
            u[i] = static_cast<float>(beta * e[r][i] + (anchor[i] - x[r][i]));
          }
          std::vector<double> c(numel, 0.0);
          for (int64_t b = lo; b < hi; b += 1024) {
            const int64_t end = std::min(hi, b + 1024);
            std::vector<int64_t> order;
            for (int64_t i = b; i < end; ++i) order.push_back(i);
            std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) {
              return std::fabs(u[p]) > std::fabs(u[q]);
            });
            for (int64_t j = 0; j < std::min<int64_t>(k, end - b); ++j) {
              c[order[j]] = NaiveBf16(u[order[j]]);
            }
          }
          for (int64_t i = lo; i < hi; ++i) {
            if (beta != 0) e[r][i] = u[i] - c[i];
            mean[i] += c[i] / world;
          }
        }
        for (int64_t i = lo; i < hi; ++i) {
          anchor[i] = NaiveOuterSgd(l.outer(), NaiveBf16(mean[i]), &momentum[i], anchor[i]);
          for (int r = 0; r < world; ++r) x[r][i] = anchor[i];
        }
      }
    }
    std::vector<std::vector<double>> row(world, std::vector<double>(tensors));
    for (int r = 0; r < world; ++r) {
      for (int t = 0; t < tensors; ++t) row[r][t] = x[r][t * per_tensor];
    }
    out.push_back(row);
  }
  moved->assign(tensors, 0.0);
  for (int t = 0; t < tensors; ++t) {
    (*moved)[t] = std::fabs(anchor[t * per_tensor] - first_anchor[t * per_tensor]);
  }
  return out;
}

// TOPK with and without feedback, W 2 and 4, beta 1, 0.9 and 0: every member, every step,
// against TopkReference. k = 125 of a fragment's 500 elements: exactly one tensor a sync, so
// that the selection never cuts through a tensor's equal elements (a tie that float32 rounding
// of the member's anchors would break differently from the reference's float64). Runs longer
// than 42 steps meet bfloat16 rounding ties of the mean that the float64 reference rounds
// differently; the rule is the same.
TEST_F(ClientFeedbackTest, Topk_FollowsReference_FeedbackSendsWhatTopkDrops) {
  constexpr int64_t kNumel = 1000;
  constexpr int64_t kSteps = 42;
  for (const auto& [world, beta] : std::vector<std::pair<int, double>>{
           {2, 0.9}, {4, 0.9}, {2, 0.0}, {4, 0.0}, {2, 1.0}, {4, 1.0}}) {
    SCOPED_TRACE(absl::StrCat("world ", world, " beta ", beta));
    v1::JobSpec spec = MakeSpec(absl::StrCat("topk", world, "b", static_cast<int>(beta * 10)),
                                world, v1::PERIODIC, {{4, world}}, 1);
    SetOuter(&spec, 0, 0.7, 0.9, true);
    spec.mutable_levels(0)->set_fragments(2);
    spec.mutable_levels(0)->set_payload(v1::TOPK);
    spec.mutable_levels(0)->set_topk_density(125.0 / 1024);
    spec.mutable_levels(0)->set_error_feedback(beta);
    std::vector<double> moved_by;
    const auto want = TopkReference(spec, kSteps, kTensors, kNumel, &moved_by);
    const std::vector<Trace> traces = Run(spec, kSteps, kNumel);
    ASSERT_EQ(traces.size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
      for (int64_t s = 0; s < kSteps; ++s) {
        const std::vector<double> got = traces[r].lines[s].values;
        ASSERT_EQ(got.size(), static_cast<size_t>(kTensors));
        for (int t = 0; t < kTensors; ++t) {
          EXPECT_NEAR(got[t], want[s][r][t], std::max(1e-4, 2e-6 * std::fabs(want[s][r][t])))
              << "rank " << r << " step " << s << " tensor " << t;
        }
      }
    }
    // The point of feedback: without it the top-k keeps picking the largest tensor of each
    // fragment and the others' anchors never move; with it the residuals of the others grow
    // until they are sent (all but the smallest tensor within these 10 syncs a fragment).
    int moved = 0;
    for (int t = 0; t < kTensors; ++t) moved += moved_by[t] > 1e-6;
    if (beta == 0) {
      EXPECT_EQ(moved, 2) << "without feedback only the largest tensor of a fragment moves";
    } else {
      EXPECT_GE(moved, kTensors - 1) << "with feedback the residuals were never sent";
    }
  }
}

}  // namespace
}  // namespace modelavg::testing
