// Generations and real processes: no collective outlives its generation (a stopped peer does
// not hold the survivors in an all-reduce until the collective timeout).
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"

namespace modelavg::testing {
namespace {

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

// A strict job (no min_world_size): one worker is stopped with SIGSTOP while the others average
// back to back, so they are blocked in an all-reduce with it. Once the coordinator declares it
// dead (heartbeat timeout 1 s) the survivors' collectives are aborted: they fail with an error
// that names the stopped rank, with their parameters as before the failed call, long before the
// 60 s collective timeout would have freed them.
TEST(ClientElasticTest, StrictJob_PeerStopped_SurvivorsAbortTheCollective) {
  Cluster cluster("stop-strict");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("stopped", 4, v1::PERIODIC, {{1, 4}}, 0,
                                       /*heartbeat_ms=*/1000))
                  .ok());
  auto workers = cluster.StartWorkers(
      "stopped", 4,
      {"--steps=1000000", "--layout=f32:200000", "--collective_timeout_ms=60000",
       "--heartbeat_interval_ms=100", "--check_untouched"});
  ASSERT_TRUE(WaitForLines(*workers[0], 20, absl::Seconds(60))) << workers[0]->err();
  workers[2]->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  absl::Duration slowest;
  for (int r : {0, 1, 3}) {
    // Far below the 60 s collective timeout: a pass proves the collective was aborted.
    auto code = workers[r]->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still blocked after SIGSTOP of rank 2";
    slowest = std::max(slowest, absl::Now() - stopped);
    EXPECT_EQ(*code, 1) << "rank " << r;
    const std::string err = workers[r]->err();
    EXPECT_THAT(err, HasSubstr("rank 2")) << err;
    EXPECT_THAT(err, HasSubstr("FAILED_PRECONDITION")) << err;
    EXPECT_THAT(err, HasSubstr("[parameters untouched]")) << err;
  }
  // The figure (heartbeat timeout 1 s): no assertion on time beyond the bound above.
  std::printf("SIGSTOP of rank 2 -> every survivor failed after %s\n",
              absl::FormatDuration(slowest).c_str());
  workers[2]->Signal(SIGKILL);
}

}  // namespace
}  // namespace modelavg::testing
