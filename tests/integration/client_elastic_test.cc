// Generations and real processes: no collective outlives its generation (a stopped peer does
// not hold the survivors in an all-reduce until the collective timeout); an elastic job
// (min_world_size) shrinks around a dead worker and lets finished subgroups leave.
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

// An elastic job (min_world_size 2 of 4): a worker killed with SIGKILL leaves the job RUNNING in
// a new generation with its rank vacant (GetJob), and the survivors go on without it: every call
// succeeds (the round the death interrupted is retried with the survivors), every step is
// printed, and a world-level average leaves the three survivors with one value.
TEST(ClientElasticTest, ElasticJob_WorkerKilled_SurvivorsGoOnWithoutIt) {
  Cluster cluster("elastic-kill");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  // 2 s: a loaded CI machine must not make a survivor miss its heartbeats too.
  v1::JobSpec spec = MakeSpec("ek", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                              /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  constexpr int kSteps = 150;
  auto workers = cluster.StartWorkers(
      // (One element: a ring over the three survivors reduces each chunk of a tensor in its own
      // order, so the elements of one tensor may differ in their last bit, which the worker's
      // check rejects.)
      "ek", 4, {absl::StrCat("--steps=", kSteps), "--layout=f32:1", "--step_sleep_ms=20",
                "--collective_timeout_ms=60000", "--heartbeat_interval_ms=100"});
  ASSERT_TRUE(WaitForLines(*workers[0], 5, absl::Seconds(60))) << workers[0]->err();
  workers[3]->Signal(SIGKILL);
  ASSERT_TRUE(workers[3]->Wait(absl::Seconds(10)).has_value());
  absl::StatusOr<v1::Job> job;
  for (int r : {0, 1, 2}) {
    auto code = workers[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still running";
    EXPECT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
    EXPECT_EQ(workers[r]->OutLines().size(), static_cast<size_t>(kSteps)) << "rank " << r;
    if (r == 0) job = cluster.admin()->GetJob("ek");
  }
  // The last even step (level 1, the world) averaged the three survivors.
  std::vector<std::string> last;
  for (int r : {0, 1, 2}) {
    const std::string line = workers[r]->OutLines()[kSteps - 2];
    EXPECT_THAT(line, HasSubstr("\"level\": 1")) << line;
    last.push_back(line.substr(line.find("\"values\"")));
  }
  EXPECT_EQ(last[0], last[1]);
  EXPECT_EQ(last[0], last[2]);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_GE(job->generation(), 2);
  bool saw_dead = false;
  for (const v1::Member& m : job->members()) {
    saw_dead = saw_dead || (m.rank() == 3 && m.state() == v1::DEAD);
  }
  EXPECT_TRUE(saw_dead) << job->DebugString();
}

// An elastic job whose second block finishes early: its ranks Leave, the job shrinks, and the
// first block, which never averages with them again, runs to the end.
TEST(ClientElasticTest, ElasticJob_BlockLeavesEarly_OthersFinish) {
  Cluster cluster("elastic-leave");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  // Step 0 averages over the world; from warm-up step 1 on only blocks of 2 (period 1).
  v1::JobSpec spec = MakeSpec("el", 4, v1::HIERARCHICAL, {{1, 2}, {1000, 4}}, 1);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  std::vector<std::unique_ptr<Process>> workers;
  for (int r = 0; r < 4; ++r) {
    workers.push_back(std::make_unique<Process>(
        std::vector<std::string>{MODELAVG_CLIENT_WORKER_BIN,
                                 "--coordinator=" + cluster.coordinator().address(), "--job=el",
                                 absl::StrCat("--rank=", r),
                                 absl::StrCat("--steps=", r < 2 ? 40 : 5), "--step_sleep_ms=20"},
        absl::StrCat(cluster.dir(), "/el-rank", r)));
  }
  for (int r = 0; r < 4; ++r) {
    auto code = workers[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.has_value()) << "rank " << r;
    EXPECT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
  }
  EXPECT_EQ(workers[0]->OutLines().size(), 40u);
  absl::StatusOr<v1::Job> job = cluster.admin()->GetJob("el");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::FINISHED);
}

// An elastic job whose every round goes through Gloo's direct exchange with its commit vote
// (client/comm/gloo/gloo_exchange.h: pairs at level 0, 256,000 bytes of the world at level 1)
// and whose workers average back to back, so that the SIGKILL lands inside a round (its data or
// its vote): the survivors retry or keep that round and go on; every call succeeds, every tensor's
// elements stay equal (the worker checks it at every step), and the world-level rounds leave the
// three survivors with the same bits.
TEST(ClientElasticTest, ElasticJob_WorkerKilledInsideDirectRounds_SurvivorsAgreeBitForBit) {
  Cluster cluster("elastic-direct-kill");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  v1::JobSpec spec = MakeSpec("edk", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                              /*heartbeat_ms=*/2000);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  constexpr int kSteps = 120;
  auto workers = cluster.StartWorkers(
      "edk", 4, {absl::StrCat("--steps=", kSteps), "--layout=f32:40000,f16:24000",
                 "--collective_timeout_ms=60000", "--heartbeat_interval_ms=100"});
  ASSERT_TRUE(WaitForLines(*workers[0], 20, absl::Seconds(60))) << workers[0]->err();
  workers[3]->Signal(SIGKILL);
  ASSERT_TRUE(workers[3]->Wait(absl::Seconds(10)).has_value());
  for (int r : {0, 1, 2}) {
    auto code = workers[r]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still running";
    EXPECT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
    EXPECT_EQ(workers[r]->OutLines().size(), static_cast<size_t>(kSteps)) << "rank " << r;
  }
  std::vector<std::string> last;
  for (int r : {0, 1, 2}) {
    const std::string line = workers[r]->OutLines()[kSteps - 2];
    EXPECT_THAT(line, HasSubstr("\"level\": 1")) << line;
    last.push_back(line.substr(line.find("\"values\"")));
  }
  EXPECT_EQ(last[0], last[1]);
  EXPECT_EQ(last[0], last[2]);
}

}  // namespace
}  // namespace modelavg::testing
