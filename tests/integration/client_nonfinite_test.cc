// The finite check through the client (ClientOptions::check_finite, on by default) with real
// processes: modelavg-trace-worker ranks over Gloo on loopback, rank 2 of 4 turning one of its
// values NaN or Inf before the call of step 32 (an average of the whole world). A strict job:
// every rank's call fails naming rank 2, the step and the value, and no rank ever printed a
// non-finite value. An elastic job: rank 2's call fails and the coordinator retires it (its
// report recorded in the job); the others average without it inside the same call, exactly
// as the rule says (CheckTraces), and run to the end. An outer level (DiLoCo): the
// pseudo-gradient is checked and named.
#include <cmath>
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

constexpr int kWorld = 4;
constexpr int64_t kSteps = 40;
constexpr int64_t kNaNStep = 32;

class ClientNonFiniteTest : public TraceJobTest {
 protected:
  ClientNonFiniteTest() : TraceJobTest("nonfinite") {}

  std::vector<std::vector<std::string>> BadRank2(const std::string& value) {
    std::vector<std::vector<std::string>> flags(kWorld);
    flags[2] = {absl::StrCat("--testing_nonfinite_at_step=", kNaNStep),
                "--testing_nonfinite_value=" + value};
    return flags;
  }
  static void ExpectAllFinite(const std::vector<Trace>& traces) {
    for (const Trace& t : traces) {
      for (const TraceLine& l : t.lines) {
        EXPECT_TRUE(std::isfinite(l.value)) << t.who << ": " << l.text;
      }
    }
  }
};

TEST_F(ClientNonFiniteTest, StrictJob_EveryRankFailsNamingTheRankAndNoValueIsNonFinite) {
  const v1::JobSpec spec =
      MakeSpec("strict", kWorld, v1::HIERARCHICAL, {{2, 2}, {4, kWorld}}, 0);
  std::vector<std::string> errors;
  const std::vector<Trace> traces = RunJob(spec, kSteps, 64, {}, BadRank2("nan"), &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("non-finite values: NaN in tensor 0")) << "rank " << r;
    EXPECT_THAT(errors[r], HasSubstr(absl::StrCat("step ", kNaNStep))) << "rank " << r;
    EXPECT_THAT(errors[r], HasSubstr("(rank 2, level 1, parameters)")) << "rank " << r;
    // Every rank printed its steps before the failed one, none after.
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kNaNStep)) << "rank " << r;
  }
  ExpectAllFinite(traces);
  const TraceCheckResult check = CheckTraces(traces, {2, kWorld});
  EXPECT_TRUE(check.ok()) << check.Report();
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("strict");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->nonfinite_reports(), 1);
  EXPECT_EQ(job->last_nonfinite().rank(), 2);
  EXPECT_EQ(job->last_nonfinite().step(), kNaNStep);
}

TEST_F(ClientNonFiniteTest, ElasticJob_TheRankIsRetiredAndTheOthersAverageWithoutIt) {
  v1::JobSpec spec =
      MakeSpec("elastic", kWorld, v1::HIERARCHICAL, {{2, 2}, {4, kWorld}}, 0, 3000);
  spec.set_min_world_size(2);
  std::vector<std::string> errors;
  const std::vector<Trace> traces = RunJob(spec, kSteps, 64, {}, BadRank2("-inf"), &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));
  EXPECT_THAT(errors[2], HasSubstr("non-finite values: -Inf in tensor 0"));
  EXPECT_THAT(errors[2], HasSubstr(absl::StrCat("step ", kNaNStep)));
  EXPECT_EQ(traces[2].lines.size(), static_cast<size_t>(kNaNStep));
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(errors[r], HasSubstr("exit 0")) << "rank " << r;
    ASSERT_EQ(traces[r].lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    const TraceLine& at = traces[r].lines[kNaNStep];
    EXPECT_EQ(at.action, "AVERAGE") << at.text;
    EXPECT_EQ(at.members, (std::vector<int32_t>{0, 1, 3})) << at.text;
  }
  ExpectAllFinite(traces);
  const TraceCheckResult check = CheckTraces(traces, {2, kWorld});
  EXPECT_TRUE(check.ok()) << check.Report();
  absl::StatusOr<v1::Job> job = cluster_.admin()->GetJob("elastic");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->nonfinite_reports(), 1);
  EXPECT_EQ(job->last_nonfinite().rank(), 2);
  EXPECT_EQ(job->last_nonfinite().value(), "-Inf");
}

TEST_F(ClientNonFiniteTest, OuterLevel_ThePseudoGradientIsCheckedAndNamed) {
  // DiLoCo on the top level: rank 2's NaN reaches the round as its pseudo-gradient.
  v1::JobSpec spec = MakeSpec("outer", kWorld, v1::HIERARCHICAL, {{2, 2}, {4, kWorld}}, 0);
  SetOuter(&spec, 1, 0.7, 0.9, true);
  std::vector<std::string> errors;
  const std::vector<Trace> traces = RunJob(spec, kSteps, 64, {}, BadRank2("inf"), &errors);
  ASSERT_EQ(errors.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    // The pseudo-gradient is the anchor minus the parameters: -Inf.
    EXPECT_THAT(errors[r], HasSubstr("non-finite values: -Inf in tensor 0")) << "rank " << r;
    EXPECT_THAT(errors[r], HasSubstr("(rank 2, level 1, pseudo-gradient)")) << "rank " << r;
    EXPECT_EQ(traces[r].lines.size(), static_cast<size_t>(kNaNStep)) << "rank " << r;
  }
  ExpectAllFinite(traces);
}

}  // namespace
}  // namespace modelavg::testing
