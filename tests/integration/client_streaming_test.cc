// Streaming sync (Level.fragments, mix, payload; docs/streaming.md) with real processes:
// modelavg-trace-worker ranks over Gloo on loopback, their parameters passed as 8 tensors,
// against a coordinator started here. Every rank's every tensor at every step is compared with
// an independent re-statement of the rule (streaming_reference.h, double precision): FP32
// exactly (to float32 rounding), BF16 and INT8 within the documented bound of the averaged
// pseudo-gradient, summed over the level's outer steps.
#include <cmath>
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
#include "tests/integration/streaming_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

constexpr int kTensors = 8;

// The "values" and "fragment" of a trace line.
std::vector<double> Values(const std::string& text) {
  std::vector<double> out;
  const size_t at = text.find("\"values\": [");
  if (at == std::string::npos) return out;
  const size_t from = at + 11;
  const size_t end = text.find(']', from);
  for (absl::string_view v : absl::StrSplit(text.substr(from, end - from), ", ")) {
    double d = 0;
    if (absl::SimpleAtod(v, &d)) out.push_back(d);
  }
  return out;
}

int FragmentOf(const std::string& text) {
  const size_t at = text.find("\"fragment\": ");
  if (at == std::string::npos) return 0;
  int f = 0;
  return absl::SimpleAtoi(text.substr(at + 12, text.find_first_of(",}", at + 12) - at - 12), &f)
             ? f
             : -1;
}

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
  void ExpectFollowsReference(const v1::JobSpec& spec, const std::vector<Trace>& traces,
                              int64_t steps, v1::Payload payload = v1::FP32) {
    const auto want = StreamingReference(spec, steps, kTensors);
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
          EXPECT_EQ(FragmentOf(l.text), w.fragment) << where;
          fragment_lines += w.fragment > 0;
        }
        const std::vector<double> got = Values(l.text);
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
    const std::vector<double> got = Values(traces[0].lines[s].text);
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
  for (v1::Payload payload : {v1::FP32, v1::INT8}) {
    SCOPED_TRACE(v1::Payload_Name(payload));
    const std::string name = absl::AsciiStrToLower(v1::Payload_Name(payload));
    v1::JobSpec spec = MakeSpec("whole" + name, 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 1);
    SetOuter(&spec, 1, 0.8, 0.9, true);
    spec.mutable_levels(1)->set_fragments(2);
    spec.mutable_levels(1)->set_sync_delay(2);
    spec.mutable_levels(1)->set_mix(0.25);
    spec.mutable_levels(1)->set_payload(payload);
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
        EXPECT_EQ(Values(got.text), Values(want.text)) << "rank " << r << " step " << got.step;
        EXPECT_EQ(got.action, want.action);
      }
    }
  }
}

}  // namespace
}  // namespace modelavg::testing
