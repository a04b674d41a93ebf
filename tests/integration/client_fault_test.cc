// Faults with real processes: a worker killed with SIGKILL mid-run, the coordinator killed.
// The survivors must fail with a clear error, promptly (well before the collective timeout,
// which the workers set to 60 s): never hang.
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"

namespace modelavg::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// Waits until `p` has printed at least `lines` lines (or exited).
bool WaitForLines(Process& p, size_t lines, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (p.OutLines().size() >= lines) return true;
    if (p.Wait(absl::ZeroDuration()).has_value()) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

const std::vector<std::string> kLongRun = {"--steps=100000", "--step_sleep_ms=20",
                                           "--collective_timeout_ms=60000",
                                           "--heartbeat_interval_ms=100"};

TEST(ClientFaultTest, WorkerKilledMidRun_SurvivorsFailWithClearErrorWithinHeartbeatTimeout) {
  Cluster cluster("kill-worker");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killw", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                                       /*heartbeat_ms=*/1000))
                  .ok());
  auto workers = cluster.StartWorkers("killw", 4, kLongRun);
  ASSERT_TRUE(WaitForLines(*workers[0], 5, absl::Seconds(60))) << workers[0]->err();
  workers[2]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  for (int r : {0, 1, 3}) {
    // Heartbeat timeout (1 s) plus detection and reporting slack; far below the 60 s
    // collective timeout, so a pass proves the failure did not come from waiting it out.
    auto code = workers[r]->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still running after the kill";
    EXPECT_EQ(*code, 1) << "rank " << r;
    const std::string err = workers[r]->err();
    EXPECT_THAT(err, HasSubstr("error: ")) << err;
    EXPECT_THAT(err, AnyOf(HasSubstr("rank 2"), HasSubstr("connection broke"))) << err;
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(20));
}

// A large buffer (many Gloo segments) and no pause between steps, so the kill lands inside a
// collective: the survivors' parameters must be exactly as before the failed call.
TEST(ClientFaultTest, WorkerKilledMidCollective_SurvivorsParametersUntouched) {
  Cluster cluster("kill-mid");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killmid", 2, v1::PERIODIC, {{1, 2}}, 0,
                                       /*heartbeat_ms=*/1000))
                  .ok());
  auto workers = cluster.StartWorkers(
      "killmid", 2,
      {"--steps=100000", "--layout=f32:3000000", "--collective_timeout_ms=60000",
       "--check_untouched"});
  ASSERT_TRUE(WaitForLines(*workers[0], 3, absl::Seconds(60))) << workers[0]->err();
  workers[1]->Signal(SIGKILL);
  auto code = workers[0]->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "rank 0 still running after the kill";
  EXPECT_EQ(*code, 1);
  const std::string err = workers[0]->err();
  EXPECT_THAT(err, HasSubstr("[parameters untouched]")) << err;
}

TEST(ClientFaultTest, CoordinatorKilled_WorkersFailCleanly) {
  Cluster cluster("kill-coordinator");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killc", 2, v1::PERIODIC, {{1, 2}}, 0,
                                       /*heartbeat_ms=*/1000))
                  .ok());
  auto workers = cluster.StartWorkers("killc", 2, kLongRun);
  ASSERT_TRUE(WaitForLines(*workers[0], 5, absl::Seconds(60))) << workers[0]->err();
  cluster.coordinator().process().Signal(SIGKILL);
  for (int r : {0, 1}) {
    auto code = workers[r]->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still running without a coordinator";
    EXPECT_EQ(*code, 1) << "rank " << r;
    const std::string err = workers[r]->err();
    EXPECT_THAT(err, HasSubstr("coordinator")) << err;
  }
}

TEST(ClientFaultTest, MismatchedParameterSizes_EveryMemberGetsAClearError) {
  Cluster cluster("mismatch");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()->CreateJob(MakeSpec("mism", 2, v1::PERIODIC, {{1, 2}}, 0)).ok());
  std::vector<std::unique_ptr<Process>> workers;
  for (int r = 0; r < 2; ++r) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{MODELAVG_CLIENT_WORKER_BIN,
                                 "--coordinator=" + cluster.coordinator().address(),
                                 "--job=mism", absl::StrCat("--rank=", r), "--steps=3",
                                 absl::StrCat("--layout=f32:", 10 + r)},
        absl::StrCat(cluster.dir(), "/mism-rank", r)));
  }
  for (int r = 0; r < 2; ++r) {
    auto code = workers[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, 1);
    EXPECT_THAT(workers[r]->err(), HasSubstr("different parameter layouts")) << workers[r]->err();
    EXPECT_THAT(workers[r]->err(), HasSubstr("INVALID_ARGUMENT"));
  }
}

}  // namespace
}  // namespace modelavg::testing
