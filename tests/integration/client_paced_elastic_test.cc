// Paced rounds (docs/paced.md) in elastic jobs, with real processes: modelavg-trace-worker ranks
// of unequal speed over Gloo on loopback against a coordinator started here. kill -9 of a member
// while the others are in or near a paced round: the survivors go on with the weights of the
// members left, and a replacement is admitted at a paced round planned for it (nobody held its
// decisions) and paced from there. A member that stalls while its heartbeats go on: Level.max_lag
// fails it out as a straggler and the others go on. Every printed round is checked against the
// weighted rule restated naively (paced_trace_check.h).
#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/paced_trace_check.h"
#include "tests/integration/trace_job_fixture.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

class ClientPacedElasticTest : public TraceJobTest {
 protected:
  ClientPacedElasticTest() : TraceJobTest("paced-elastic") {}

  // Starts a trace worker of `spec` (rank < 0: a replacement taking a vacant rank).
  std::unique_ptr<Process> Start(const v1::JobSpec& spec, int rank,
                                 const std::vector<std::string>& flags,
                                 const std::string& name) {
    std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                     "--coordinator=" + cluster_.coordinator().address(),
                                     "--job=" + spec.job_id(),
                                     absl::StrCat("--world_size=", spec.world_size()),
                                     "--numel=16",
                                     "--backend=gloo",
                                     "--join_timeout_ms=30000",
                                     "--collective_timeout_ms=30000"};
    if (rank >= 0) argv.push_back(absl::StrCat("--rank=", rank));
    argv.insert(argv.end(), flags.begin(), flags.end());
    return std::make_unique<Process>(argv, absl::StrCat(cluster_.dir(), "/", name));
  }

  static size_t RoundsPrinted(Process& p) {
    size_t n = 0;
    for (const std::string& l : p.OutLines()) n += absl::StrContains(l, "\"round\"") ? 1 : 0;
    return n;
  }

  static Trace TraceOf(Process& p, const std::string& who) {
    absl::StatusOr<Trace> t = ParseTrace(who, p.out());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : Trace{};
  }
};

TEST_F(ClientPacedElasticTest, KillNine_SurvivorsGoOn_ReplacementPacedFromItsAdmissionRound) {
  v1::JobSpec spec = MakeSpec("kill", 3, v1::PERIODIC, {{8, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  const std::vector<std::string> fast = {"--step_delay_ms=10", "--rounds=30"};
  const std::vector<std::string> slow = {"--step_delay_ms=25", "--rounds=30"};
  std::vector<std::unique_ptr<Process>> procs;
  procs.push_back(Start(spec, 0, fast, "rank0"));
  procs.push_back(Start(spec, 1, fast, "rank1"));
  procs.push_back(Start(spec, 2, slow, "rank2"));
  // Once the slow member has been paced for a while, kill it without warning.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (RoundsPrinted(*procs[2]) < 4 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(RoundsPrinted(*procs[2]), 4u) << procs[2]->err();
  procs[2]->Signal(SIGKILL);
  procs[2]->Wait(absl::Seconds(10));
  procs.push_back(Start(spec, -1, slow, "replacement"));
  std::vector<Trace> traces;
  const char* names[] = {"rank 0", "rank 1", "rank 2 (killed)", "rank 2 (replacement)"};
  for (size_t i = 0; i < procs.size(); ++i) {
    std::optional<int> code = procs[i]->Wait(kRunDeadline);
    if (i != 2) {
      EXPECT_EQ(code.value_or(-1), 0) << names[i] << ": " << procs[i]->err();
    }
    traces.push_back(TraceOf(*procs[i], names[i]));
  }
  PacedCheck check;
  check.elastic = true;
  const TraceCheckResult result = CheckPacedTraces(traces, check);
  EXPECT_TRUE(result.ok()) << result.Report();
  // The survivors ended after round 29; the replacement was admitted at a paced round, as a
  // joining member, and contributed with its own weight in the rounds after it.
  for (int i : {0, 1, 3}) {
    ASSERT_FALSE(traces[i].lines.empty()) << names[i];
    EXPECT_EQ(traces[i].lines.back().round, 29) << names[i];
  }
  const TraceLine& admitted = traces[3].lines.front();
  EXPECT_TRUE(admitted.admitted) << admitted.text;
  EXPECT_GE(admitted.round, 0) << admitted.text;
  EXPECT_THAT(admitted.joining, ::testing::ElementsAre(2)) << admitted.text;
  int contributed = 0;
  for (const TraceLine& l : traces[3].lines) {
    if (l.round > admitted.round) {
      EXPECT_GT(l.weight, 0) << l.text;
      EXPECT_THAT(l.members, ::testing::Contains(2)) << l.text;
      ++contributed;
    }
  }
  EXPECT_GE(contributed, 2);
}

TEST_F(ClientPacedElasticTest, MemberStallsWithHeartbeats_MaxLagFailsItOutAsAStraggler) {
  v1::JobSpec spec = MakeSpec("stall", 3, v1::PERIODIC, {{8, 3}}, 0);
  spec.mutable_levels(0)->set_paced(true);
  spec.mutable_levels(0)->set_max_lag(3);
  spec.set_min_world_size(2);
  ASSERT_TRUE(cluster_.ok());
  ASSERT_TRUE(cluster_.admin()->CreateJob(spec).ok());
  std::vector<std::unique_ptr<Process>> procs;
  procs.push_back(Start(spec, 0, {"--step_delay_ms=10", "--rounds=12"}, "rank0"));
  procs.push_back(Start(spec, 1, {"--step_delay_ms=10", "--rounds=12"}, "rank1"));
  // Rank 2 stalls for 20 s before its step 40 (past a few paced rounds): its heartbeat thread
  // beats on, so only max_lag can tell; a round lasts 8 x 20 ms, so 3 rounds' time is ~0.5 s.
  procs.push_back(Start(spec, 2,
                        {"--step_delay_ms=20", "--rounds=12", "--testing_sleep_at_step=40",
                         "--testing_sleep_ms=20000"},
                        "rank2"));
  const absl::Time started = absl::Now();
  for (int i : {0, 1}) {
    std::optional<int> code = procs[i]->Wait(kRunDeadline);
    EXPECT_EQ(code.value_or(-1), 0) << "rank " << i << ": " << procs[i]->err();
  }
  // The survivors did not wait out the stall.
  EXPECT_LT(absl::Now() - started, absl::Seconds(15));
  // The coordinator says why (its log, warnings and up).
  const std::string log = ReadWholeFile(cluster_.dir() + "/coordinator.err");
  EXPECT_THAT(log, ::testing::HasSubstr("failed out as a straggler")) << TailOf(log, 3000);
  EXPECT_THAT(log, ::testing::HasSubstr("rank 2 (worker")) << TailOf(log, 3000);
  procs[2]->Signal(SIGKILL);
  procs[2]->Wait(absl::Seconds(10));
  std::vector<Trace> traces = {TraceOf(*procs[0], "rank 0"), TraceOf(*procs[1], "rank 1"),
                               TraceOf(*procs[2], "rank 2 (stalled)")};
  PacedCheck check;
  check.elastic = true;
  const TraceCheckResult result = CheckPacedTraces(traces, check);
  EXPECT_TRUE(result.ok()) << result.Report();
  EXPECT_EQ(traces[0].lines.back().round, 11);
  // The rounds after the stall average ranks 0 and 1 only.
  EXPECT_THAT(traces[0].lines.back().members, ::testing::ElementsAre(0, 1));
}

}  // namespace
}  // namespace modelavg::testing
