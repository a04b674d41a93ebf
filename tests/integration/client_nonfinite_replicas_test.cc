// The finite check with sharded replicas (JobSpec.replica_size, docs/sharded.md): the replica is
// the unit of failure, so a NaN in one rank's shard retires its whole replica. An elastic job of
// 8 modelavg-trace-worker ranks over Gloo on loopback in replicas of 2 (ranks 2k and 2k + 1;
// shard 0 on the even ranks, shard 1 on the odd), groups of two replicas every 2 steps and the
// world every 4. Rank 5 (replica 2, shard 1) makes one of its values NaN before its call of
// step 32, a world step: its call fails naming it, the coordinator retires replica 2, its mate
// rank 4 ends with the replica-lost error, and the others average on without ranks 4 and 5 —
// shard 1 inside the same call — every value of every rank at every step exactly as the rule
// says (trace_check.h's CheckTracesFollowRule, from the printed values alone).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 8;
constexpr int64_t kSteps = 64;
constexpr int64_t kNaNStep = 32;
constexpr int kBad = 5;
constexpr int kMate = 4;

class ClientNonFiniteReplicasTest : public TraceJobTest {
 protected:
  ClientNonFiniteReplicasTest() : TraceJobTest("nonfinite-replicas") {}
};

TEST_F(ClientNonFiniteReplicasTest, NaNInOneShard_WholeReplicaRetired_SurvivorsExact) {
  v1::JobSpec spec =
      MakeSpec("replicas", kWorld, v1::HIERARCHICAL, {{2, 4}, {4, kWorld}}, 0, /*hb_ms=*/2000);
  spec.set_replica_size(2);
  spec.set_min_world_size(4);
  std::vector<std::vector<std::string>> flags(kWorld);
  flags[kBad] = {absl::StrCat("--testing_nonfinite_at_step=", kNaNStep),
                 "--testing_nonfinite_value=nan"};
  std::vector<std::string> errors;
  const std::vector<Trace> traces =
      RunJob(spec, kSteps, /*numel=*/64, {"--check_untouched", "--step_delay_ms=50"}, flags,
             &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));

  // The rank with the NaN: its call fails naming it, its parameters as before the call.
  EXPECT_THAT(errors[kBad], HasSubstr("exit 1"));
  EXPECT_THAT(errors[kBad], HasSubstr("non-finite values: NaN in tensor 0"));
  EXPECT_THAT(errors[kBad], HasSubstr(absl::StrCat("step ", kNaNStep)));
  EXPECT_THAT(errors[kBad], HasSubstr("(rank 5, level 1, parameters)"));
  EXPECT_THAT(errors[kBad], HasSubstr("[parameters untouched]"));
  EXPECT_EQ(traces[kBad].lines.size(), static_cast<size_t>(kNaNStep));
  // Its mate: the replica-lost error, with the coordinator's reason, at its first call after it
  // hears of the new generation (its shard-0 rounds do not involve rank 5: it may complete
  // the world round of step 32, and a step or two more, among peers that have not heard yet
  // either; the checker below holds those rounds to the rule like any other).
  EXPECT_THAT(errors[kMate], HasSubstr("exit 1"));
  EXPECT_THAT(errors[kMate], HasSubstr("rank 5 contributed non-finite values (NaN in tensor 0"));
  EXPECT_THAT(errors[kMate], HasSubstr("replica 2 (ranks 4..5) retired"));
  EXPECT_THAT(errors[kMate], HasSubstr("was retired because its rank 5"));
  const int64_t mate_lines = static_cast<int64_t>(traces[kMate].lines.size());
  EXPECT_GE(mate_lines, kNaNStep);
  EXPECT_LT(mate_lines, kSteps);

  // The others run to the end; shard 1's world round of step 32 ran without rank 5 inside the
  // same call, and no round after it had rank 5, nor rank 4 after its last line.
  for (int r = 0; r < kWorld; ++r) {
    if (r == kBad || r == kMate) continue;
    EXPECT_THAT(errors[r], HasSubstr("exit 0")) << "rank " << r;
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    const TraceLine& at = traces[r].lines[kNaNStep];
    EXPECT_EQ(at.action, "AVERAGE") << at.text;
    EXPECT_EQ(at.level, 1) << at.text;
    if (r % 2 == 1) EXPECT_EQ(at.members, (std::vector<int32_t>{1, 3, 7})) << at.text;
    for (const TraceLine& l : traces[r].lines) {
      for (int32_t m : l.members) {
        EXPECT_FALSE(m == kBad && l.step >= kNaNStep) << "rank " << r << ": " << l.text;
        EXPECT_FALSE(m == kMate && l.step >= mate_lines) << "rank " << r << ": " << l.text;
      }
    }
  }

  // Every value of every rank (the retired ones up to their last line) against the rule.
  const TraceCheckResult check =
      CheckTracesFollowRule(traces, spec, /*every_rank_lived=*/false, /*check_values=*/true);
  EXPECT_TRUE(check.ok()) << check.Report();
  EXPECT_GT(check.averages, (kWorld - 2) * kSteps / 2);
  // The checker is not blind: one survivor's value after the NaN step off by 0.1%.
  std::vector<Trace> doctored = traces;
  for (TraceLine& l : doctored[7].lines) {
    if (l.step == kNaNStep) l.value *= 1.001;
  }
  EXPECT_FALSE(CheckTracesFollowRule(doctored, spec, false, true).ok())
      << "a doctored value passed";

  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("replicas");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->nonfinite_reports(), 1);
  EXPECT_EQ(job->last_nonfinite().rank(), kBad);
  EXPECT_EQ(job->last_nonfinite().step(), kNaNStep);
  std::printf("replicas: %lld averaging and %lld skipping lines follow the rule; rank %d's last "
              "line: step %lld\n",
              static_cast<long long>(check.averages), static_cast<long long>(check.skips), kMate,
              static_cast<long long>(mate_lines - 1));
}

}  // namespace
}  // namespace modelavg::testing
