// The rarest path of an elastic job's round, with real processes: a member loses the
// confirmation of a round that its peers completed (its last receive broke), and a member of
// the round then dies. The member that lost the confirmation must not average again with the
// survivors (its peers have moved on with the result): it learns from their round notes in the
// next generation that they completed it, and keeps the result it holds. The traces then follow
// the averaging rule (trace_check.h) with that round's members being the four ranks.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

TEST(ElasticAdoptTest, CommitLostThenAPeerDies_TheRoundIsKeptNotAveragedAgain) {
  Cluster cluster("elastic-adopt");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  // Pairs every step, all four every 2 steps; the round of step 10 is a world round.
  v1::JobSpec spec = MakeSpec("adopt", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                              /*heartbeat_ms=*/1500);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  constexpr int kSteps = 30;
  std::vector<std::unique_ptr<Process>> workers;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                     "--coordinator=" + cluster.coordinator().address(),
                                     "--job=adopt", absl::StrCat("--rank=", r), "--world_size=4",
                                     absl::StrCat("--steps=", kSteps), "--numel=1000",
                                     "--step_delay_ms=20", "--collective_timeout_ms=60000",
                                     "--log_level=info"};
    // Rank 1 loses the confirmation of step 10's round, which ranks 0, 2 and 3 complete; rank
    // 3 dies right after it, so the job moves on to a generation without it.
    if (r == 1) argv.push_back("--testing_fail_commit_at_step=10");
    if (r == 3) argv.push_back("--testing_die_after_step=10");
    workers.push_back(std::make_unique<Process>(
        argv, absl::StrCat(cluster.dir(), "/adopt-rank", r)));
  }
  for (int r = 0; r < 4; ++r) {
    auto code = workers[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " still running";
    EXPECT_EQ(*code, r == 3 ? 9 : 0) << "rank " << r << ": " << workers[r]->err();
  }
  EXPECT_THAT(workers[1]->err(), HasSubstr("injecting a lost commit"));
  EXPECT_THAT(workers[1]->err(), HasSubstr("its result is kept")) << workers[1]->err();
  std::vector<Trace> traces;
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->lines.size(), r == 3 ? 11u : static_cast<size_t>(kSteps)) << "rank " << r;
    traces.push_back(*std::move(t));
  }
  // Step 10 averaged over all four on every rank, rank 1 included (it kept the result).
  for (int r = 0; r < 4; ++r) {
    ASSERT_GT(traces[r].lines.size(), 10u);
    EXPECT_EQ(traces[r].lines[10].members, (std::vector<int32_t>{0, 1, 2, 3})) << "rank " << r;
  }
  TraceCheckResult check = CheckTraces(traces, {2, 4});
  EXPECT_TRUE(check.ok()) << check.Report();
  EXPECT_GT(check.averages, 60);
}

}  // namespace
}  // namespace modelavg::testing
