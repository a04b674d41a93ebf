// DiLoCo (JobSpec Level.outer) with real processes: modelavg-trace-worker ranks over Gloo on
// loopback against a coordinator started here. Every rank's value at every step is compared
// with an independent re-statement of the rule (outer_reference.h, double precision) and every
// line's "outer" with the spec: periodic with warm-up, hierarchical with the outer level last,
// first, and two outer levels, lr 1 / momentum 0 against plain averaging, worlds 2, 4, 6 and 8;
// and a checkpoint: a run stopped at a step and resumed in new processes from the saved
// state_dict() prints exactly what an uninterrupted run prints.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/reference/outer_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

class ClientOuterTest : public TraceJobTest {
 protected:
  ClientOuterTest() : TraceJobTest("outer") {}

  // Runs ranks 0..world-1 of `spec` (created here) for steps first..steps-1, rank r loading its
  // state from <load_prefix>r and saving it to <save_prefix>r where given; their traces by
  // rank, or empty with a test failure.
  std::vector<Trace> Run(const v1::JobSpec& spec, int64_t steps, int64_t numel = 64,
                         const std::string& load_prefix = "",
                         const std::string& save_prefix = "") {
    std::vector<std::vector<std::string>> rank_flags(spec.world_size());
    for (int r = 0; r < spec.world_size(); ++r) {
      if (!load_prefix.empty()) {
        rank_flags[r].push_back(absl::StrCat("--load_state=", load_prefix, r));
      }
      if (!save_prefix.empty()) {
        rank_flags[r].push_back(absl::StrCat("--save_state=", save_prefix, r));
      }
    }
    return RunJob(spec, steps, numel, {}, rank_flags);
  }

  // Every rank, every step: the reference's action, level, "outer" and value.
  void ExpectFollowsReference(const v1::JobSpec& spec, const std::vector<Trace>& traces,
                              int64_t steps) {
    const auto want = OuterReference(spec, steps);
    ASSERT_EQ(traces.size(), static_cast<size_t>(spec.world_size()));
    int outer_lines = 0;
    for (int r = 0; r < spec.world_size(); ++r) {
      ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(steps)) << "rank " << r;
      for (int64_t s = 0; s < steps; ++s) {
        const TraceLine& l = traces[r].lines[s];
        const OuterReferenceStep& w = want[s][r];
        const std::string where = absl::StrCat("rank ", r, " step ", s, ": ", l.text);
        ASSERT_EQ(l.step, s) << where;
        EXPECT_EQ(l.action, w.average ? "AVERAGE" : "SKIP") << where;
        EXPECT_EQ(l.level, w.level) << where;
        EXPECT_EQ(l.outer, w.outer) << where;
        outer_lines += l.outer;
        // float32 parameters and state against double arithmetic.
        EXPECT_NEAR(l.value, w.value, std::max(1e-4, 2e-6 * std::fabs(w.value)))
            << where << " (reference " << w.value << ")";
      }
    }
    EXPECT_GT(outer_lines, 0);
  }
};

// The reference itself against the worked example of docs/diloco.md (two ranks, PERIODIC,
// period 2, lr 0.5, momentum 0.5), computed by hand there.
TEST(OuterReferenceTest, WorkedExample_MatchesTheDocs) {
  v1::JobSpec spec = MakeSpec("example", 2, v1::PERIODIC, {{2, 2}}, 0);
  SetOuter(&spec, 0, 0.5, 0.5, false);
  const auto r = OuterReference(spec, 5);
  EXPECT_EQ(r[0][0].value, 1.25);
  EXPECT_EQ(r[1][0].value, 2.25);
  EXPECT_EQ(r[1][1].value, 3.25);
  EXPECT_EQ(r[2][0].value, 3.125);
  EXPECT_EQ(r[2][1].value, 3.125);
  EXPECT_EQ(r[3][1].value, 7.125);
  EXPECT_EQ(r[4][0].value, 7.4375);
  EXPECT_TRUE(r[4][0].outer);
  EXPECT_FALSE(r[3][0].average);
}

TEST_F(ClientOuterTest, Periodic_WithWarmup_FollowsRule) {
  for (int world : {2, 4}) {
    v1::JobSpec spec =
        MakeSpec(absl::StrCat("periodic", world), world, v1::PERIODIC, {{3, world}}, 5);
    SetOuter(&spec, 0, 0.7, 0.9, true);
    ExpectFollowsReference(spec, Run(spec, 24), 24);
  }
}

TEST_F(ClientOuterTest, Hierarchical_OuterLevelLast_FollowsRule) {
  v1::JobSpec spec = MakeSpec("last8", 8, v1::HIERARCHICAL, {{2, 2}, {4, 4}, {8, 8}}, 3);
  SetOuter(&spec, 2, 0.7, 0.9, true);
  ExpectFollowsReference(spec, Run(spec, 34), 34);
}

TEST_F(ClientOuterTest, Hierarchical_OuterLevelFirst_FollowsRule) {
  v1::JobSpec spec = MakeSpec("first6", 6, v1::HIERARCHICAL, {{2, 2}, {6, 6}}, 0);
  SetOuter(&spec, 0, 0.5, 0.5, false);
  ExpectFollowsReference(spec, Run(spec, 26), 26);
}

TEST_F(ClientOuterTest, Hierarchical_TwoOuterLevels_FollowsRule) {
  v1::JobSpec spec = MakeSpec("two4", 4, v1::HIERARCHICAL, {{2, 2}, {6, 4}}, 1);
  SetOuter(&spec, 0, 0.8, 0.9, false);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  ExpectFollowsReference(spec, Run(spec, 30), 30);
}

// Sharded replicas (JobSpec.replica_size 2): each rank's outer state is its shard's, averaged
// with the ranks of its group that hold that shard.
TEST_F(ClientOuterTest, ShardedReplicasOf2_TwoOuterLevels_FollowsRule) {
  v1::JobSpec spec = MakeSpec("sharded8", 8, v1::HIERARCHICAL, {{2, 4}, {6, 8}}, 1);
  spec.set_replica_size(2);
  SetOuter(&spec, 0, 0.8, 0.9, false);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  ExpectFollowsReference(spec, Run(spec, 26), 26);
}

// lr 1, momentum 0: A - mean(A - x) = mean(x), the plain average, every step.
TEST_F(ClientOuterTest, LrOneMomentumZero_EqualsPlainAveraging) {
  v1::JobSpec plain = MakeSpec("plain", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 1);
  v1::JobSpec outer = plain;
  outer.set_job_id("lr1");
  SetOuter(&outer, 0, 1.0, 0.0, false);
  SetOuter(&outer, 1, 1.0, 0.0, false);
  const std::vector<Trace> a = Run(plain, 20);
  const std::vector<Trace> b = Run(outer, 20);
  ExpectFollowsReference(outer, b, 20);
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].lines.size(), b[r].lines.size());
    for (size_t s = 0; s < a[r].lines.size(); ++s) {
      EXPECT_NEAR(a[r].lines[s].value, b[r].lines[s].value,
                  std::max(1e-4, 1e-6 * std::fabs(a[r].lines[s].value)))
          << "rank " << r << " step " << s;
      EXPECT_FALSE(a[r].lines[s].outer);
    }
  }
}

// Steps 0..10 saved with --save_state, steps 11..29 in new processes (a new job of the same
// spec) from --load_state: the same values, exactly, as one run of steps 0..29 — the anchors
// and momenta (two outer levels, nesterov) are restored, not rebuilt.
TEST_F(ClientOuterTest, StateDict_ResumeInNewProcesses_EqualsUninterruptedRun) {
  v1::JobSpec spec = MakeSpec("whole", 4, v1::HIERARCHICAL, {{2, 2}, {6, 4}}, 1);
  SetOuter(&spec, 0, 0.8, 0.9, false);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  const std::vector<Trace> whole = Run(spec, 30);
  const std::string prefix = absl::StrCat(cluster_.dir(), "/state-rank");
  spec.set_job_id("before");
  const std::vector<Trace> before = Run(spec, 11, 64, "", prefix);
  spec.set_job_id("after");
  const std::vector<Trace> after = Run(spec, 30, 64, prefix, "");
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(after.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(before[r].lines.size(), 11u);
    ASSERT_EQ(after[r].lines.size(), 19u) << "rank " << r;
    for (size_t i = 0; i < after[r].lines.size(); ++i) {
      const TraceLine& got = after[r].lines[i];
      const TraceLine& want = whole[r].lines[11 + i];
      EXPECT_EQ(got.step, want.step);
      EXPECT_EQ(got.value, want.value) << "rank " << r << " step " << got.step;
      EXPECT_EQ(got.outer, want.outer);
    }
  }
}

}  // namespace
}  // namespace modelavg::testing
