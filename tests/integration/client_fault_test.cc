// Faults with real processes: a worker killed (SIGKILL: the kernel closes its sockets at once) or
// stopped (SIGSTOP: nothing is closed or reset, the peer just goes silent) between calls or in
// the middle of a collective, and the coordinator killed. Every survivor must exit with the
// documented error — the status code and the rank and cause named — within the documented
// bound plus a small slack, its parameters untouched.
//
// The bounds (README, "Faults"): the coordinator declares a silent worker dead after the job's
// heartbeat timeout (kHeartbeat); the survivors learn it from their next heartbeat reply, abort
// any collective of the old generation in flight, and their averaging call fails with
// FAILED_PRECONDITION naming the rank and "heartbeat timeout". So every survivor exits within
// kHeartbeat + kSlack of the fault, well before the collective timeout (kCollective): a pass
// proves that no survivor waited a collective out. A killed worker's peers see its sockets
// close at once and wait at most a heartbeat timeout for the coordinator's cause.
#include <signal.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kHeartbeat = absl::Seconds(1);   // the jobs' heartbeat_timeout_ms
// The workers' collective timeout: longer than kHeartbeat + kSlack, so that waiting it out fails.
constexpr absl::Duration kCollective = absl::Seconds(4);
// Detection, reporting, process exit and the test's 10 ms polling, on a loaded 2-core machine.
constexpr absl::Duration kSlack = absl::Seconds(2);
// The earliest a survivor can learn of a stopped peer: the heartbeat timeout counts from the
// peer's last beat, up to two 100 ms beat intervals before the stop.
const absl::Duration kEarliestDeath = kHeartbeat - absl::Milliseconds(200);

struct Exit {
  std::optional<int> code;  // nullopt: still running at the deadline
  absl::Duration after;     // since `since`
};

// Polls every process in `ranks` until each has exited or `limit` has passed since `since`;
// returns each one's exit code and when it exited.
std::vector<Exit> WaitForExits(std::vector<std::unique_ptr<Process>>& workers,
                               const std::vector<int>& ranks, absl::Time since,
                               absl::Duration limit) {
  std::vector<Exit> out(ranks.size());
  while (true) {
    bool running = false;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (out[i].code) continue;
      out[i].code = workers[ranks[i]]->Wait(absl::ZeroDuration());
      if (out[i].code) {
        out[i].after = absl::Now() - since;
      } else {
        running = true;
      }
    }
    if (!running || absl::Now() - since > limit) return out;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::vector<std::string> WorkerFlags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {
      absl::StrCat("--collective_timeout_ms=", absl::ToInt64Milliseconds(kCollective)),
      "--heartbeat_interval_ms=100", "--check_untouched"};
  for (auto& f : extra) flags.push_back(std::move(f));
  return flags;
}

// Every survivor exited 1 within [min_after, max_after] of the fault, with `code` and every
// `needles` in its one error line, its parameters untouched.
void ExpectSurvivorsFailed(std::vector<std::unique_ptr<Process>>& workers,
                           const std::vector<int>& survivors, absl::Time fault,
                           absl::Duration min_after, absl::Duration max_after,
                           const std::string& code, const std::vector<std::string>& needles) {
  const std::vector<Exit> exits = WaitForExits(workers, survivors, fault, max_after + kSlack);
  for (size_t i = 0; i < survivors.size(); ++i) {
    const int r = survivors[i];
    const std::string err = workers[r]->err();
    ASSERT_TRUE(exits[i].code.has_value())
        << "rank " << r << " still running " << max_after + kSlack << " after the fault";
    ::testing::Test::RecordProperty(absl::StrCat("rank", r, "_exit_ms"),
                                    absl::ToInt64Milliseconds(exits[i].after));
    EXPECT_EQ(*exits[i].code, 1) << "rank " << r << ": " << err;
    EXPECT_GE(exits[i].after, min_after) << "rank " << r << ": " << err;
    EXPECT_LE(exits[i].after, max_after) << "rank " << r << ": " << err;
    EXPECT_THAT(err, HasSubstr("error: " + code + ": ")) << "rank " << r;
    for (const std::string& n : needles) EXPECT_THAT(err, HasSubstr(n)) << "rank " << r;
    EXPECT_THAT(err, HasSubstr("[parameters untouched]")) << "rank " << r;
  }
}

// Two levels: pairs every step, all four every second step. Rank 2 stops between two calls (it
// sleeps 300 ms after each): rank 3, its pair, is waiting in a collective with it by the time
// the coordinator declares it dead, and ranks 0 and 1 at their next all-rank step: the
// generation change must release all three.
TEST(ClientFaultTest, WorkerStoppedBetweenCalls_SurvivorsFailedPreconditionNamingRank) {
  Cluster cluster("stop-between");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("stopb", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                                       absl::ToInt64Milliseconds(kHeartbeat)))
                  .ok());
  auto workers =
      cluster.StartWorkers("stopb", 4, WorkerFlags({"--steps=100000", "--step_sleep_ms=300"}));
  ASSERT_TRUE(WaitForLines(*workers[2], 4, absl::Seconds(60))) << workers[2]->err();
  workers[2]->Signal(SIGSTOP);  // within 10 ms of its 4th line: in its 300 ms pause
  const absl::Time stopped = absl::Now();
  ExpectSurvivorsFailed(workers, {0, 1, 3}, stopped, kEarliestDeath, kHeartbeat + kSlack,
                        "FAILED_PRECONDITION", {"rank 2 heartbeat timeout"});
}

// A large buffer (many Gloo segments) and no pause: the stop lands inside a collective of all
// three ranks. The generation change aborts it; the survivors restore their buffers and report
// the coordinator's cause.
TEST(ClientFaultTest, WorkerStoppedMidCollective_SurvivorsUntouchedFailedPreconditionNamingRank) {
  Cluster cluster("stop-mid");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("stopmid", 3, v1::PERIODIC, {{1, 3}}, 0,
                                       absl::ToInt64Milliseconds(kHeartbeat)))
                  .ok());
  auto workers =
      cluster.StartWorkers("stopmid", 3, WorkerFlags({"--steps=100000", "--layout=f32:3000000"}));
  ASSERT_TRUE(WaitForLines(*workers[1], 3, absl::Seconds(60))) << workers[1]->err();
  workers[1]->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  ExpectSurvivorsFailed(workers, {0, 2}, stopped, kEarliestDeath, kHeartbeat + kSlack,
                        "FAILED_PRECONDITION", {"rank 1 heartbeat timeout"});
}

TEST(ClientFaultTest, WorkerKilledMidRun_SurvivorsFailedPreconditionNamingRank) {
  Cluster cluster("kill-worker");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killw", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0,
                                       absl::ToInt64Milliseconds(kHeartbeat)))
                  .ok());
  auto workers =
      cluster.StartWorkers("killw", 4, WorkerFlags({"--steps=100000", "--step_sleep_ms=20"}));
  ASSERT_TRUE(WaitForLines(*workers[0], 5, absl::Seconds(60))) << workers[0]->err();
  workers[2]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  // Nobody waits out the collective timeout: the sockets close at once, and the coordinator
  // names the cause after one heartbeat timeout.
  ExpectSurvivorsFailed(workers, {0, 1, 3}, killed, absl::ZeroDuration(), kHeartbeat + kSlack,
                        "FAILED_PRECONDITION", {"rank 2 heartbeat timeout"});
}

// A large buffer and no pause between steps, so the kill lands inside a collective.
TEST(ClientFaultTest, WorkerKilledMidCollective_SurvivorsParametersUntouched) {
  Cluster cluster("kill-mid");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killmid", 2, v1::PERIODIC, {{1, 2}}, 0,
                                       absl::ToInt64Milliseconds(kHeartbeat)))
                  .ok());
  auto workers =
      cluster.StartWorkers("killmid", 2, WorkerFlags({"--steps=100000", "--layout=f32:3000000"}));
  ASSERT_TRUE(WaitForLines(*workers[0], 3, absl::Seconds(60))) << workers[0]->err();
  workers[1]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  ExpectSurvivorsFailed(workers, {0}, killed, absl::ZeroDuration(), kHeartbeat + kSlack,
                        "FAILED_PRECONDITION", {"rank 1 heartbeat timeout"});
}

// Without a coordinator the workers cannot learn of membership changes: they ride through an
// outage up to ClientOptions.coordinator_outage_timeout (here one heartbeat timeout), then stop,
// saying so.
TEST(ClientFaultTest, CoordinatorKilled_WorkersUnavailableNamingTheCoordinator) {
  Cluster cluster("kill-coordinator");
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  ASSERT_TRUE(cluster.admin()
                  ->CreateJob(MakeSpec("killc", 2, v1::PERIODIC, {{1, 2}}, 0,
                                       absl::ToInt64Milliseconds(kHeartbeat)))
                  .ok());
  auto workers =
      cluster.StartWorkers("killc", 2, WorkerFlags({"--steps=100000", "--step_sleep_ms=20",
                                                    absl::StrCat("--coordinator_outage_timeout_ms=",
                                                                 absl::ToInt64Milliseconds(
                                                                     kHeartbeat))}));
  ASSERT_TRUE(WaitForLines(*workers[0], 5, absl::Seconds(60))) << workers[0]->err();
  cluster.coordinator().process().Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  // The outage counts from the first failed heartbeat, at most a beat interval after the kill.
  ExpectSurvivorsFailed(workers, {0, 1}, killed, kHeartbeat / 2, kHeartbeat + kSlack,
                        "UNAVAILABLE",
                        {absl::StrCat("the coordinator at ", cluster.coordinator().address(),
                                      " has not answered for ")});
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
    EXPECT_THAT(workers[r]->err(), HasSubstr("error: INVALID_ARGUMENT: ")) << workers[r]->err();
    EXPECT_THAT(workers[r]->err(), HasSubstr("different parameter layouts"));
    EXPECT_THAT(workers[r]->err(), HasSubstr("range from 10 to 11"));
  }
}

// A stray connection takes a Gloo port while the mesh is set up (the worker's
// --testing_stray_connection, tests/testing/stray_connection_store.h: before the connecting member
// of a pair connects, a socket of the test's connects to the peer's port and stays, as a port
// scanner, a misdirected or a hostile client would): silent, writing random bytes, or sending
// back what it receives (the member's own handshake replayed). Every member with the flag meets
// one. The stray fails the pair's proof of membership, the pair is set up again between the
// members, and the job runs to its end: every member exits 0 with the values of the naive rule,
// no member counts as dead, in a strict job and in an elastic one (min_world_size below the
// world) alike.
struct StrayCase {
  const char* kind;
  bool elastic;
};

class ClientStrayTest : public ::testing::TestWithParam<StrayCase> {};

TEST_P(ClientStrayTest, StrayConnectionDuringSetUp_PairSetUpAgain_JobCompletesExactly) {
  const StrayCase c = GetParam();
  const std::string name = absl::StrCat("stray-", c.kind, c.elastic ? "-elastic" : "");
  const int world = c.elastic ? 4 : 2;
  Cluster cluster(name);
  ASSERT_TRUE(cluster.ok()) << cluster.dir();
  v1::JobSpec spec = MakeSpec(name, world, v1::PERIODIC, {{1, world}}, 0);
  if (c.elastic) spec.set_min_world_size(2);
  ASSERT_TRUE(cluster.admin()->CreateJob(spec).ok());
  constexpr int kSteps = 3;
  std::vector<std::string> flags = {absl::StrCat("--steps=", kSteps), "--layout=f32:64",
                                    "--testing_stray_connection",
                                    absl::StrCat("--testing_stray_kind=", c.kind),
                                   };
  for (std::string& f : WorkerFlags({})) flags.push_back(std::move(f));
  auto workers = cluster.StartWorkers(name, world, flags);
  for (int r = 0; r < world; ++r) {
    auto code = workers[r]->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.has_value()) << "rank " << r << " hung: " << workers[r]->err();
    ASSERT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
  }
  // The stray was seen and named, with the address it came from, by the member whose port it
  // took.
  bool logged = false;
  for (int r = 0; r < world; ++r) {
    const std::string& err = workers[r]->err();
    logged = logged || (err.find("did not prove membership") != std::string::npos &&
                        err.find("the connection from [127.0.0.1]:") != std::string::npos);
  }
  EXPECT_TRUE(logged) << workers[0]->err() << "\n---\n" << workers[1]->err();
  const auto expected = Simulate(spec, "f32:64", 0, kSteps);
  for (int r = 0; r < world; ++r) {
    const std::vector<std::string> lines = workers[r]->OutLines();
    ASSERT_EQ(lines.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int i = 0; i < kSteps; ++i) {
      StepLine got;
      ASSERT_TRUE(ParseStepLine(lines[i], &got)) << lines[i];
      EXPECT_EQ(got.action, expected[i][r].action) << "rank " << r << ": " << lines[i];
      ASSERT_EQ(got.values.size(), 1u) << lines[i];
      EXPECT_EQ(got.values[0], expected[i][r].values[0]) << "rank " << r << ": " << lines[i];
    }
  }
  absl::StatusOr<v1::Job> job = cluster.admin()->GetJob(name);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->deaths(), 0) << job->DebugString();
  EXPECT_EQ(job->state(), v1::FINISHED) << job->DebugString();
}

INSTANTIATE_TEST_SUITE_P(
    StrictAndElastic, ClientStrayTest,
    ::testing::Values(StrayCase{"silent", false}, StrayCase{"junk", false},
                      StrayCase{"echo", false}, StrayCase{"silent", true},
                      StrayCase{"junk", true}, StrayCase{"echo", true}),
    [](const auto& info) {
      return absl::StrCat(info.param.kind, info.param.elastic ? "_Elastic" : "_Strict");
    });

// Whether `pid` is gone (or a zombie waiting for its new parent to reap it).
bool Gone(pid_t pid) {
  const std::string stat = ReadWholeFile(absl::StrCat("/proc/", pid, "/stat"));
  if (stat.empty()) return true;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && stat.size() > paren + 2 && stat[paren + 2] == 'Z';
}

// The harness's own promise: a child's whole process group (what the child started too) is
// killed when the Process goes away, so a failing test leaves nothing running.
TEST(ProcessHarnessTest, Destroyed_KillsTheChildsWholeProcessGroup) {
  TempDir dir("harness");
  ASSERT_NE(dir.path(), "");
  pid_t grandchild = -1;
  {
    Process p({"/bin/sh", "-c", "sleep 300 & echo $!; wait"}, dir.path() + "/sh");
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (grandchild <= 0 && absl::Now() < deadline) {
      const std::vector<std::string> lines = p.OutLines();
      if (!lines.empty() && absl::SimpleAtoi(lines[0], &grandchild)) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_GT(grandchild, 0) << "the shell did not report its child";
    EXPECT_EQ(getpgid(grandchild), p.pid()) << "the grandchild is not in the child's group";
    EXPECT_FALSE(Gone(grandchild));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!Gone(grandchild) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(Gone(grandchild)) << "pid " << grandchild << " outlived its Process";
}

}  // namespace
}  // namespace modelavg::testing
