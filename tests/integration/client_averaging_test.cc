// Averaging with real processes on loopback: a modelavg-coordinator and W client_worker
// processes (Gloo). Every rank's decision and values after every step must equal a simulation
// driven by an independent transcription of PyTorch's rule (naive_schedule.h).
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"

namespace modelavg::testing {
namespace {

struct JobCase {
  std::string name;
  int world;
  v1::Mode mode;
  std::vector<std::pair<int64_t, int32_t>> levels;
  int64_t warmup;
  int64_t steps;
  std::string layout = "f32:64";
  int64_t start_step = 0;
};

void RunAndCheck(const JobCase& c) {
  Cluster cluster(c.name);
  ASSERT_TRUE(cluster.ok()) << "coordinator did not start; see " << cluster.dir();
  v1::JobSpec spec = MakeSpec(c.name, c.world, c.mode, c.levels, c.warmup);
  auto job = cluster.admin()->CreateJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();

  auto workers = cluster.StartWorkers(
      c.name, c.world,
      {absl::StrCat("--steps=", c.steps), "--layout=" + c.layout,
       absl::StrCat("--start_step=", c.start_step)});
  for (int r = 0; r < c.world; ++r) {
    auto code = workers[r]->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " hung";
    ASSERT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
  }
  const auto expected = Simulate(spec, c.layout, c.start_step, c.steps);
  for (int r = 0; r < c.world; ++r) {
    const std::vector<std::string> lines = workers[r]->OutLines();
    ASSERT_EQ(lines.size(), static_cast<size_t>(c.steps)) << "rank " << r;
    for (int64_t i = 0; i < c.steps; ++i) {
      StepLine got;
      ASSERT_TRUE(ParseStepLine(lines[i], &got)) << lines[i];
      const StepLine& want = expected[i][r];
      EXPECT_EQ(got.step, want.step) << lines[i];
      EXPECT_EQ(got.rank, r);
      EXPECT_EQ(got.action, want.action) << "rank " << r << ": " << lines[i];
      EXPECT_EQ(got.level, want.level) << "rank " << r << ": " << lines[i];
      ASSERT_EQ(got.values.size(), want.values.size()) << lines[i];
      for (size_t k = 0; k < want.values.size(); ++k) {
        if (std::isnan(want.values[k])) {
          EXPECT_TRUE(std::isnan(got.values[k])) << lines[i];
        } else {
          EXPECT_EQ(got.values[k], want.values[k])
              << "rank " << r << " step " << want.step << " tensor " << k << ": " << lines[i];
        }
      }
    }
  }
}

TEST(ClientAveragingTest, Periodic_World4_WithWarmup_ExactValuesEveryStep) {
  RunAndCheck({"periodic4", 4, v1::PERIODIC, {{2, 4}}, /*warmup=*/3, /*steps=*/10});
}

TEST(ClientAveragingTest, Periodic_World8_ExactValuesEveryStep) {
  RunAndCheck({"periodic8", 8, v1::PERIODIC, {{3, 8}}, /*warmup=*/0, /*steps=*/7});
}

TEST(ClientAveragingTest, Hierarchical_World4_TwoLevels_WithWarmup_ExactValuesEveryStep) {
  RunAndCheck({"hier4", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, /*warmup=*/3, /*steps=*/12});
}

TEST(ClientAveragingTest, Hierarchical_World8_ThreeLevels_WithWarmup_ExactValuesEveryStep) {
  RunAndCheck(
      {"hier8", 8, v1::HIERARCHICAL, {{1, 2}, {2, 4}, {4, 8}}, /*warmup=*/2, /*steps=*/10});
}

TEST(ClientAveragingTest, ManyTensorsOfMixedSizesAndDTypes_OneCall_ExactValues) {
  RunAndCheck({"mixed4", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, /*warmup=*/1, /*steps=*/6,
               "f32:1000,f64:3,f16:5,bf16:7,f32:0,f32:1,f64:100,f16:4099"});
}

TEST(ClientAveragingTest, HalfPrecisionOnly_StagedInFloat32_ExactValues) {
  RunAndCheck({"half4", 4, v1::PERIODIC, {{1, 4}}, /*warmup=*/0, /*steps=*/5,
               "f16:33,bf16:65"});
}

TEST(ClientAveragingTest, EmptyParameterList_DecisionsStillTaken) {
  RunAndCheck({"empty4", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, /*warmup=*/1, /*steps=*/5,
               "none"});
}

TEST(ClientAveragingTest, OneRankWorld_AveragingIsTheIdentity) {
  RunAndCheck({"solo", 1, v1::PERIODIC, {{1, 1}}, /*warmup=*/0, /*steps=*/4});
}

TEST(ClientAveragingTest, RestoredStep_WarmupIsNotReplayed) {
  // Steps 0..4 are warm-up; a worker restored at step 4 averages at 5, 7, ...
  RunAndCheck({"restore", 2, v1::PERIODIC, {{2, 2}}, /*warmup=*/5, /*steps=*/5, "f32:8",
               /*start_step=*/4});
}

}  // namespace
}  // namespace modelavg::testing
