// ClientOptions::heartbeat_relay_dir with one process per rank, as torchrun starts them: the
// processes of one host carry all their beats in one HostHeartbeatStream (the coordinator's
// modelavg_streams_open gauge), the process that serves the relay can be killed without the
// others being declared dead (one of them takes over), and a process that dies behind the relay
// is still declared dead at half the heartbeat timeout ("connection lost"), as without it.
#include <signal.h>
#include <sys/stat.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/tools/http_get.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

class HeartbeatRelayTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 4;

  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    metrics_file_ = tmp_.path() + "/metrics.port";
    relay_dir_ = tmp_.path() + "/relay";
    cluster_ = std::make_unique<Cluster>(
        "relay", std::vector<std::string>{"--metrics_listen=127.0.0.1:0",
                                          "--metrics_port_file=" + metrics_file_});
    ASSERT_TRUE(cluster_->ok()) << cluster_->dir();
  }

  // An elastic job: a death moves the generation and the job runs on.
  void CreateJob(const std::string& id, int64_t heartbeat_ms) {
    v1::JobSpec spec =
        MakeSpec(id, kWorld, v1::HIERARCHICAL, {{1, 2}, {2, 4}}, 0, heartbeat_ms);
    spec.set_min_world_size(2);
    ASSERT_TRUE(cluster_->admin()->CreateJob(spec).ok());
  }

  // One element per rank: after a death the world's rounds have three members, and a ring over
  // three reduces each chunk of a tensor in its own order (the elements of one tensor could
  // differ in their last bit, which the worker's check rejects).
  std::vector<std::unique_ptr<Process>> Start(const std::string& job, int64_t steps) {
    return cluster_->StartWorkers(
        job, kWorld,
        {absl::StrCat("--steps=", steps), "--layout=f32:1", "--step_sleep_ms=20",
         "--collective_timeout_ms=60000",
         "--heartbeat_interval_ms=100", "--heartbeat_relay_dir=" + relay_dir_});
  }

  // The value of the sample `name{labels}` on the coordinator's /metrics; -1 when absent.
  double Metric(const std::string& name, const std::string& labels) {
    const std::string addr(absl::StripAsciiWhitespace(ReadWholeFile(metrics_file_)));
    int port = 0;
    if (!absl::SimpleAtoi(addr.substr(addr.rfind(':') + 1), &port)) return -1;
    const std::string sample = absl::StrCat(name, "{", labels, "} ");
    for (absl::string_view line : absl::StrSplit(HttpGet(port, "/metrics"), '\n')) {
      if (!absl::StartsWith(line, sample)) continue;
      double v = -1;
      if (!absl::SimpleAtod(line.substr(sample.size()), &v)) return -1;
      return v;
    }
    return -1;
  }
  double OpenStreams(const std::string& method) {
    return Metric("modelavg_streams_open", absl::StrCat("method=\"", method, "\""));
  }

  // The pid the relay's lock names (the process that serves), 0 if none.
  int ServingPid() {
    std::vector<std::string> locks;
    for (const auto& e : std::filesystem::directory_iterator(relay_dir_)) {
      if (absl::EndsWith(e.path().string(), ".lock")) locks.push_back(e.path().string());
    }
    if (locks.size() != 1) return 0;
    int pid = 0;
    (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadWholeFile(locks[0])), &pid);
    return pid;
  }

  // Waits until one HostHeartbeatStream is open and none of a rank's own, the relay served by a
  // process of `pids`; returns that process's index in `pids` (-1 on timeout).
  int WaitForOneStream(const std::vector<int>& pids, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const int serving = ServingPid();
      for (size_t i = 0; i < pids.size(); ++i) {
        if (pids[i] == serving && OpenStreams("HostHeartbeatStream") == 1 &&
            OpenStreams("HeartbeatStream") == 0) {
          return static_cast<int>(i);
        }
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  // Starts the job's workers, waits until each has taken a few steps and one of them serves the
  // relay (one stream at the coordinator): its index, or -1.
  int StartAndFindServer(const std::string& job, int64_t steps,
                         std::vector<std::unique_ptr<Process>>* workers, std::vector<int>* pids) {
    *workers = Start(job, steps);
    for (auto& w : *workers) {
      if (!WaitForLines(*w, 5, absl::Seconds(60))) {
        ADD_FAILURE() << w->err();
        return -1;
      }
    }
    for (auto& w : *workers) pids->push_back(w->pid());
    return WaitForOneStream(*pids, absl::Seconds(10));
  }

  // Every worker but `gone` exits 0 after all `steps`; the job's DEAD ranks are only `gone`.
  void ExpectOthersFinishAndOnlyItDies(const std::string& job,
                                       std::vector<std::unique_ptr<Process>>& workers, int gone,
                                       int64_t steps) {
    for (int r = 0; r < kWorld; ++r) {
      if (r == gone) continue;
      auto code = workers[r]->Wait(absl::Seconds(90));
      ASSERT_TRUE(code.has_value()) << "rank " << r << " still running";
      EXPECT_EQ(*code, 0) << "rank " << r << ": " << workers[r]->err();
      EXPECT_EQ(workers[r]->OutLines().size(), static_cast<size_t>(steps)) << "rank " << r;
    }
    absl::StatusOr<v1::Job> j = cluster_->admin()->GetJob(job);
    ASSERT_TRUE(j.ok()) << j.status();
    std::vector<int> dead;
    for (const v1::Member& m : j->members()) {
      if (m.state() == v1::DEAD) dead.push_back(m.rank());
    }
    EXPECT_THAT(dead, ::testing::ElementsAre(gone)) << j->DebugString();
  }

  TempDir tmp_{"relay-test"};
  std::string metrics_file_, relay_dir_;
  std::unique_ptr<Cluster> cluster_;
};

// Four processes, one stream to the coordinator. The one that serves the relay is killed: the
// other three go on (one of them serves now, and again one stream carries them), none of them
// is declared dead, and they finish every step.
TEST_F(HeartbeatRelayTest, FourProcesses_OneStream_ServerKilled_AnotherTakesOver_NoneElseDies) {
  CreateJob("relay", /*heartbeat_ms=*/2000);
  constexpr int kSteps = 250;
  std::vector<std::unique_ptr<Process>> workers;
  std::vector<int> pids;
  const int serving = StartAndFindServer("relay", kSteps, &workers, &pids);
  ASSERT_GE(serving, 0) << "HostHeartbeatStreams open: " << OpenStreams("HostHeartbeatStream")
                        << ", HeartbeatStreams: " << OpenStreams("HeartbeatStream")
                        << ", lock names pid " << ServingPid();
  EXPECT_EQ(Metric("modelavg_rpcs_total", "code=\"OK\",method=\"Heartbeat\""), 0);

  workers[serving]->Signal(SIGKILL);
  ASSERT_TRUE(workers[serving]->Wait(absl::Seconds(10)).has_value());
  std::vector<int> survivors;
  for (int r = 0; r < kWorld; ++r) survivors.push_back(r == serving ? -1 : pids[r]);
  const int next = WaitForOneStream(survivors, absl::Seconds(10));
  EXPECT_GE(next, 0) << "no survivor serves the relay: lock names pid " << ServingPid()
                     << ", HostHeartbeatStreams open: " << OpenStreams("HostHeartbeatStream");

  ExpectOthersFinishAndOnlyItDies("relay", workers, serving, kSteps);
  // The last even step (level 1, the world) averaged the three survivors alike.
  std::set<std::string> last;
  for (int r = 0; r < kWorld; ++r) {
    if (r == serving) continue;
    const std::string line = workers[r]->OutLines()[kSteps - 2];
    EXPECT_THAT(line, HasSubstr("\"level\": 1")) << line;
    last.insert(line.substr(line.find("\"values\"")));
  }
  EXPECT_EQ(last.size(), 1u);
  EXPECT_EQ(OpenStreams("HeartbeatStream"), 0);
  EXPECT_EQ(Metric("modelavg_rpcs_total", "code=\"OK\",method=\"Heartbeat\""), 0);
}

// The process that serves the relay is stopped (SIGSTOP): it holds the lock but answers nothing.
// The others notice within half the heartbeat timeout and beat on streams of their own, so that
// only the stopped one is declared dead, and they finish every step.
TEST_F(HeartbeatRelayTest, ServerStopped_OthersBeatOnTheirOwn_OnlyItDies) {
  CreateJob("stopped", /*heartbeat_ms=*/3000);
  constexpr int kSteps = 300;
  std::vector<std::unique_ptr<Process>> workers;
  std::vector<int> pids;
  const int serving = StartAndFindServer("stopped", kSteps, &workers, &pids);
  ASSERT_GE(serving, 0);
  workers[serving]->Signal(SIGSTOP);
  ExpectOthersFinishAndOnlyItDies("stopped", workers, serving, kSteps);
  for (int r = 0; r < kWorld; ++r) {
    if (r != serving) EXPECT_THAT(workers[r]->err(), HasSubstr("went silent")) << "rank " << r;
  }
  workers[serving]->Signal(SIGKILL);
}

// A process that does not serve the relay dies: the relay forwards its rank as lost, and the
// coordinator declares it dead for "connection lost" at half the heartbeat timeout, before the
// timeout itself; the relay's stream stays the only one.
TEST_F(HeartbeatRelayTest, FollowerKilled_DeclaredDeadForConnectionLost_BeforeTheTimeout) {
  constexpr int64_t kHeartbeatMs = 8000;
  CreateJob("lost", kHeartbeatMs);
  std::vector<std::unique_ptr<Process>> workers;
  std::vector<int> pids;
  const int serving = StartAndFindServer("lost", 1000000, &workers, &pids);
  ASSERT_GE(serving, 0);
  const int victim = (serving + 1) % kWorld;
  workers[victim]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(workers[victim]->Wait(absl::Seconds(10)).has_value());
  v1::Job job;
  const absl::Time deadline = killed + absl::Milliseconds(2 * kHeartbeatMs);
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::Job> j = cluster_->admin()->GetJob("lost");
    ASSERT_TRUE(j.ok()) << j.status();
    job = *j;
    if (job.vacant_ranks_size() > 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration took = absl::Now() - killed;
  EXPECT_THAT(job.vacant_ranks(), ::testing::ElementsAre(victim)) << job.DebugString();
  EXPECT_LT(took, absl::Milliseconds(kHeartbeatMs)) << "declared dead only at the timeout";
  EXPECT_THAT(job.last_change().reason(), HasSubstr("connection lost")) << job.DebugString();
  EXPECT_EQ(job.state(), v1::RUNNING);
  EXPECT_EQ(ServingPid(), pids[serving]);
  EXPECT_EQ(OpenStreams("HostHeartbeatStream"), 1);
}

}  // namespace
}  // namespace modelavg::testing
