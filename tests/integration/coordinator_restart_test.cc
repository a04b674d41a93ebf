// The coordinator is no single point of failure: real processes on loopback (a
// modelavg-coordinator with --state_dir, modelavg-trace-worker ranks over Gloo), the coordinator
// killed with SIGKILL mid-job and restarted on the same address.
//
//  * restarted after 2 s, and after twice the heartbeat timeout: every worker finishes every
//    step with exit 0, its values equal an undisturbed run's exactly, in generation 1 (nobody
//    re-joined, no communicator was rebuilt);
//  * the outage spans the first averaging of the top level (its communicator is bootstrapped
//    after the restart);
//  * a paced job killed between the planning of a round and the round: the restarted
//    coordinator has every round planned before the kill as it was, and the members' rounds and
//    values follow the weighted rule;
//  * an outage longer than coordinator_outage_timeout: a clear error, no hang;
//  * a worker killed during the outage: the survivors fail within the collective timeout;
//  * SIGKILL at random moments during CreateJob/Join/Leave/DeleteJob: every acknowledged change
//    is there after the restart, nothing half-written;
//  * a damaged state file, and a second coordinator on the same --state_dir: refused;
//  * a full disk (a 512 KiB tmpfs; needs root, so CI, which sets MODELAVG_REQUIRE_ROOT=1):
//    refused changes are not made, acknowledged ones survive kill -9;
//  * Joins refused at SIGTERM leave no member behind; a removed state directory is refused
//    (writes answer UNAVAILABLE); --require_state refuses an empty one.
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/client_test_processes.h"
#include "tests/integration/paced_trace_check.h"
#include "tests/integration/staged_job_storm.h"
#include "tests/reference/streaming_reference.h"
#include "tests/integration/trace_check.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kHeartbeatMs = 1500;
// Slack for process start-up and scheduling on a loaded 2-core machine.
constexpr absl::Duration kSlack = absl::Seconds(5);

// One state directory and one port across coordinator restarts.
class Coordinator {
 public:
  // Incarnations run in DIR/<name><n>; the state is in DIR/state.
  explicit Coordinator(std::string dir, std::string name = "run")
      : dir_(std::move(dir)), name_(std::move(name)) {}

  // Starts an incarnation (on the port of the first one); false if it did not come up.
  bool Start(std::vector<std::string> extra = {}) {
    const std::string run_dir = absl::StrCat(dir_, "/", name_, runs_++);
    std::filesystem::create_directories(run_dir);
    std::vector<std::string> flags = {"--log_level=info"};
    if (durable_) flags.push_back("--state_dir=" + state_dir());
    if (port_ != 0) flags.push_back(absl::StrCat("--listen=127.0.0.1:", port_));
    for (std::string& f : extra) flags.push_back(std::move(f));
    // The port of a killed incarnation can take a moment to be free again.
    for (int attempt = 0; attempt < 50; ++attempt) {
      process_ = std::make_unique<CoordinatorProcess>(MODELAVG_COORDINATOR_BIN, run_dir, flags);
      if (!process_->address().empty()) break;
      if (port_ == 0 || !absl::StrContains(process_->process().err(), "cannot listen")) {
        return false;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (process_->address().empty()) return false;
    address_ = process_->address();
    port_ = std::stoi(address_.substr(address_.rfind(':') + 1));
    return true;
  }
  void Kill() {
    process_->process().Signal(SIGKILL);
    process_->process().Wait(absl::Seconds(10));
  }
  std::string state_dir() const { return state_dir_.empty() ? dir_ + "/state" : state_dir_; }
  // Keeps the state elsewhere than DIR/state (the logs stay in DIR).
  void set_state_dir(std::string dir) { state_dir_ = std::move(dir); }
  // false: no --state_dir (the coordinator's state is in memory).
  void set_durable(bool durable) { durable_ = durable; }
  const std::string& address() const { return address_; }
  CoordinatorProcess& process() { return *process_; }
  std::string log() { return process_ ? process_->process().err() : ""; }

  std::unique_ptr<client::CoordinatorClient> Admin() {
    client::ConnectionOptions options;
    options.coordinator = address_;
    options.rpc_timeout = absl::Seconds(10);
    auto admin = client::CoordinatorClient::Create(options);
    return admin.ok() ? *std::move(admin) : nullptr;
  }

 private:
  std::string dir_;
  std::string name_;
  std::string state_dir_;
  bool durable_ = true;
  int runs_ = 0;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<CoordinatorProcess> process_;
};

class CoordinatorRestartTest : public ::testing::Test {
 protected:
  CoordinatorRestartTest() : dir_(MakeTempDir("modelavg_restart")), coordinator_(dir_) {}
  ~CoordinatorRestartTest() override {
    workers_.clear();  // killed if still running
    std::filesystem::remove_all(dir_);
  }

  // `per_rank[r]`: more flags for rank r only. `steps` <= 0: no --steps (the flags give the
  // length: --rounds of a paced job); `delay_ms` < 0: no --step_delay_ms (per_rank gives each
  // rank's).
  void StartWorkers(const std::string& job, int world, int64_t steps, int64_t delay_ms,
                    std::vector<std::string> extra = {},
                    std::map<int, std::vector<std::string>> per_rank = {}) {
    workers_.clear();
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = TraceWorkerArgv(
          MODELAVG_TRACE_WORKER_BIN, coordinator_.address(), job, r, world, 3, steps);
      argv.push_back("--log_level=warn");
      if (delay_ms >= 0) argv.push_back(absl::StrCat("--step_delay_ms=", delay_ms));
      for (const std::string& f : extra) argv.push_back(f);
      for (const std::string& f : per_rank[r]) argv.push_back(f);
      workers_.push_back(
          std::make_unique<Process>(argv, absl::StrCat(dir_, "/", job, "-rank", r)));
    }
  }

  // The highest step any worker has printed (-1: none).
  int64_t MaxStep() {
    int64_t max_step = -1;
    for (auto& w : workers_) {
      for (const std::string& line : w->OutLines()) max_step = std::max(max_step, StepOf(line));
    }
    return max_step;
  }
  static int64_t StepOf(const std::string& line) {
    int64_t step = -1;
    const size_t at = line.find("\"step\": ");
    if (at != std::string::npos) {
      const size_t end = line.find(',', at);
      (void)absl::SimpleAtoi(line.substr(at + 8, end - at - 8), &step);
    }
    return step;
  }

  bool WaitForStep(int64_t step, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (MaxStep() >= step) return true;
      for (auto& w : workers_) {
        if (w->Wait(absl::ZeroDuration()).has_value()) return false;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  // Waits for every worker; their exit codes (-1: still running at the deadline).
  std::vector<int> WaitAll(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<int> codes;
    for (auto& w : workers_) {
      std::optional<int> code = w->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now()));
      codes.push_back(code.value_or(-1));
    }
    return codes;
  }

  std::string Diagnostics() {
    std::string s = absl::StrCat("coordinator log:\n", coordinator_.log());
    for (size_t r = 0; r < workers_.size(); ++r) {
      absl::StrAppend(&s, "\nrank ", r, " stderr:\n", workers_[r]->err());
    }
    return s;
  }

  std::string dir_;
  Coordinator coordinator_;
  std::vector<std::unique_ptr<Process>> workers_;
};

// 8 ranks, three levels, warm-up: pairs every 2 steps, quads every 4, all eight every 16 (first
// at step 16, after the kill below).
v1::JobSpec EightRanks(const std::string& id) {
  return MakeSpec(id, 8, v1::HIERARCHICAL, {{2, 2}, {4, 4}, {16, 8}}, 4, kHeartbeatMs);
}
constexpr int64_t kSteps = 40;
constexpr int64_t kKillAtStep = 7;

// Runs the job on every rank; returns each rank's lines.
std::vector<std::vector<std::string>> Lines(const std::vector<std::unique_ptr<Process>>& ws) {
  std::vector<std::vector<std::string>> lines;
  for (const auto& w : ws) lines.push_back(w->OutLines());
  return lines;
}

TEST_F(CoordinatorRestartTest, KilledMidJob_RestartedAfter2sAndAfterTwiceHeartbeat_SameValues) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto admin = coordinator_.Admin();
  ASSERT_NE(admin, nullptr);

  // The undisturbed run.
  ASSERT_TRUE(admin->CreateJob(EightRanks("calm")).ok());
  StartWorkers("calm", 8, kSteps, 0);
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const std::vector<std::vector<std::string>> calm = Lines(workers_);
  ASSERT_EQ(calm[0].size(), static_cast<size_t>(kSteps));

  for (const absl::Duration outage :
       {absl::Seconds(2), 2 * absl::Milliseconds(kHeartbeatMs)}) {
    SCOPED_TRACE(absl::StrCat("outage ", absl::FormatDuration(outage)));
    const std::string job = absl::StrCat("storm", absl::ToInt64Milliseconds(outage));
    ASSERT_TRUE(coordinator_.Admin()->CreateJob(EightRanks(job)).ok());
    StartWorkers(job, 8, kSteps, 100);
    ASSERT_TRUE(WaitForStep(kKillAtStep, absl::Seconds(60))) << Diagnostics();
    coordinator_.Kill();
    const absl::Time killed = absl::Now();
    const int64_t step_at_kill = MaxStep();
    absl::SleepFor(outage);
    // The workers went on without the coordinator, up to the top level's first averaging.
    const int64_t step_at_restart = MaxStep();
    ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
    const absl::Time restarted = absl::Now();
    // The first top-level averaging (step 16) needs the coordinator: time it.
    ASSERT_TRUE(WaitForStep(16, absl::Seconds(60))) << Diagnostics();
    const absl::Time first_after = absl::Now();
    std::vector<int> codes = WaitAll(absl::Seconds(120));
    for (int code : codes) ASSERT_EQ(code, 0) << Diagnostics();
    const std::vector<std::vector<std::string>> lines = Lines(workers_);
    for (int r = 0; r < 8; ++r) {
      ASSERT_EQ(lines[r].size(), static_cast<size_t>(kSteps)) << Diagnostics();
      for (int64_t s = 0; s < kSteps; ++s) {
        // Same values, same actions, and still generation 1: nobody re-joined.
        EXPECT_EQ(lines[r][s], calm[r][s]) << "rank " << r << " step " << s;
      }
    }
    EXPECT_THAT(coordinator_.log(), HasSubstr(absl::StrCat("job ", job, ": loaded (RUNNING in "
                                                           "generation 1, 8 of 8 ranks")));
    std::cout << "[figures] outage " << absl::FormatDuration(outage) << ": steps " << step_at_kill
              << " at the kill, " << step_at_restart << " at the restart; kill -9 -> first "
              << "top-level averaging after the restart "
              << absl::FormatDuration(absl::Trunc(first_after - killed, absl::Milliseconds(1)))
              << " (restart -> it "
              << absl::FormatDuration(absl::Trunc(first_after - restarted, absl::Milliseconds(1)))
              << ")" << std::endl;
    EXPECT_LT(step_at_kill, 16);
    EXPECT_LE(step_at_restart, 16) << "the top level's first averaging needs the coordinator";
  }
}

// Streaming sync (docs/streaming.md): the coordinator is killed while a fragment's background
// all-reduce is in flight — ranks 0-2 started fragment 1's sync at step 12 and trained on, rank 3
// sleeps before its call at 12 — and restarted 2 s later. Nobody hangs, every worker exits 0, and
// every rank's every tensor at every step equals an undisturbed run's exactly, which follows the
// rule (streaming_reference.h), in generation 1.
TEST_F(CoordinatorRestartTest, StreamingJob_KilledDuringBackgroundAllReduce_SameValuesAsRule) {
  constexpr int kWorld = 4;
  constexpr int64_t kStreamSteps = 24;
  constexpr int64_t kSyncStep = 12;
  constexpr int kTensors = 8;
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto spec = [&](const std::string& id) {
    v1::JobSpec s = MakeSpec(id, kWorld, v1::PERIODIC, {{8, kWorld}}, 0, kHeartbeatMs);
    v1::Level* l = s.mutable_levels(0);
    l->mutable_outer()->set_lr(0.7);
    l->mutable_outer()->set_momentum(0.9);
    l->mutable_outer()->set_nesterov(true);
    l->set_fragments(2);
    l->set_sync_delay(3);
    l->set_mix(0.25);
    return s;
  };
  const std::vector<std::string> flags = {absl::StrCat("--tensors=", kTensors), "--numel=64"};
  ASSERT_TRUE(coordinator_.Admin()->CreateJob(spec("scalm")).ok());
  StartWorkers("scalm", kWorld, kStreamSteps, 0, flags);
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const std::vector<std::vector<std::string>> calm = Lines(workers_);
  // The undisturbed run follows the rule.
  const auto want = StreamingReference(spec("scalm"), kStreamSteps, kTensors);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(calm[r].size(), static_cast<size_t>(kStreamSteps)) << Diagnostics();
    for (int64_t s = 0; s < kStreamSteps; ++s) {
      const std::string& line = calm[r][s];
      const size_t at = line.find("\"values\": [");
      ASSERT_NE(at, std::string::npos) << line;
      const std::vector<std::string> parts =
          absl::StrSplit(line.substr(at + 11, line.find(']', at) - at - 11), ", ");
      ASSERT_EQ(parts.size(), static_cast<size_t>(kTensors)) << line;
      for (int t = 0; t < kTensors; ++t) {
        double v = 0;
        ASSERT_TRUE(absl::SimpleAtod(parts[t], &v)) << line;
        const double w = want[s][r].values[t];
        EXPECT_NEAR(v, w, std::max(1e-4, 2e-6 * std::fabs(w)))
            << "rank " << r << " step " << s << " tensor " << t << ": " << line;
      }
    }
  }

  ASSERT_TRUE(coordinator_.Admin()->CreateJob(spec("sstorm")).ok());
  StartWorkers("sstorm", kWorld, kStreamSteps, 50, flags,
               {{kWorld - 1, {absl::StrCat("--testing_sleep_at_step=", kSyncStep),
                              "--testing_sleep_ms=4000"}}});
  ASSERT_TRUE(WaitForStep(kSyncStep, absl::Seconds(60))) << Diagnostics();
  coordinator_.Kill();
  // The all-reduce of step 12 is in flight: started by the others, not yet by rank 3.
  int64_t sleeper_step = -1;
  for (const std::string& line : workers_[kWorld - 1]->OutLines()) {
    sleeper_step = std::max(sleeper_step, StepOf(line));
  }
  EXPECT_LT(sleeper_step, kSyncStep) << "rank 3 was not asleep before its sync step";
  absl::SleepFor(absl::Seconds(2));
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const std::vector<std::vector<std::string>> lines = Lines(workers_);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(lines[r].size(), static_cast<size_t>(kStreamSteps)) << Diagnostics();
    for (int64_t s = 0; s < kStreamSteps; ++s) {
      EXPECT_EQ(lines[r][s], calm[r][s]) << "rank " << r << " step " << s;
    }
  }
  EXPECT_THAT(coordinator_.log(),
              HasSubstr("job sstorm: loaded (RUNNING in generation 1, 4 of 4 ranks"));
}

// The issue's reproduction: without --state_dir, a restart with the same jobs file has the job
// afresh. The workers must not train on against a coordinator that does not know them.
TEST_F(CoordinatorRestartTest, RestartedWithoutStateDir_WorkersStopSayingWhy) {
  coordinator_.set_durable(false);
  const std::string jobs = dir_ + "/jobs.json";
  std::ofstream(jobs) << R"({"jobs": [{"job_id": "mem", "world_size": 4, "mode": "HIERARCHICAL",
      "heartbeat_timeout_ms": 1500, "levels": [{"period": 2, "group_size": 2},
      {"period": 4, "group_size": 4}]}]})";
  ASSERT_TRUE(coordinator_.Start({"--jobs_file=" + jobs})) << coordinator_.log();
  StartWorkers("mem", 4, 1000, 50);
  ASSERT_TRUE(WaitForStep(5, absl::Seconds(60))) << Diagnostics();
  coordinator_.Kill();
  absl::SleepFor(absl::Seconds(1));
  ASSERT_TRUE(coordinator_.Start({"--jobs_file=" + jobs})) << coordinator_.log();
  std::vector<int> codes = WaitAll(kSlack + absl::Seconds(5));
  for (size_t r = 0; r < codes.size(); ++r) {
    EXPECT_EQ(codes[r], 1) << Diagnostics();
    EXPECT_THAT(workers_[r]->err(), HasSubstr("restarted without the job's state"))
        << Diagnostics();
  }
}

TEST_F(CoordinatorRestartTest, OutageLongerThanTimeout_ClearErrorNoHang) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  ASSERT_TRUE(coordinator_.Admin()
                  ->CreateJob(MakeSpec("gone", 4, v1::HIERARCHICAL, {{2, 2}, {16, 4}}, 0,
                                       kHeartbeatMs))
                  .ok());
  StartWorkers("gone", 4, 1000, 50, {"--coordinator_outage_timeout_ms=2000"});
  ASSERT_TRUE(WaitForStep(5, absl::Seconds(60))) << Diagnostics();
  const std::string address = coordinator_.address();
  coordinator_.Kill();
  const absl::Time killed = absl::Now();
  std::vector<int> codes = WaitAll(absl::Seconds(2) + kSlack);
  const absl::Duration took = absl::Now() - killed;
  for (size_t r = 0; r < codes.size(); ++r) {
    EXPECT_EQ(codes[r], 1) << Diagnostics();
    EXPECT_THAT(workers_[r]->err(), HasSubstr("UNAVAILABLE")) << Diagnostics();
    EXPECT_THAT(workers_[r]->err(),
                HasSubstr(absl::StrCat("the coordinator at ", address, " has not answered for ")));
    EXPECT_THAT(workers_[r]->err(), HasSubstr("coordinator_outage_timeout is 2s"));
  }
  std::cout << "[figures] outage past the 2 s timeout: every worker failed "
            << absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1)))
            << " after the kill" << std::endl;
}

TEST_F(CoordinatorRestartTest, WorkerKilledDuringOutage_SurvivorsFailWithinCollectiveTimeout) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  ASSERT_TRUE(coordinator_.Admin()
                  ->CreateJob(MakeSpec("dead", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0,
                                       kHeartbeatMs))
                  .ok());
  StartWorkers("dead", 4, 1000, 50, {"--collective_timeout_ms=3000"});
  ASSERT_TRUE(WaitForStep(8, absl::Seconds(60))) << Diagnostics();
  coordinator_.Kill();
  workers_[3]->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  std::vector<int> codes = WaitAll(absl::Seconds(3) + kSlack);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(codes[r], 1) << Diagnostics();
    EXPECT_THAT(workers_[r]->err(), HasSubstr("AverageParameters")) << Diagnostics();
  }
  std::cout << "[figures] worker killed during the outage: survivors failed within "
            << absl::FormatDuration(absl::Trunc(absl::Now() - killed, absl::Milliseconds(1)))
            << std::endl;
}

// An elastic job: a worker dies while the coordinator is down. Nobody can declare the death
// until the coordinator is back (with its state), so the survivors' round waits for it instead of
// failing; once the restored coordinator has declared the death, they retry with each other and
// run to the end, every averaging the mean of its members (trace_check.h).
TEST_F(CoordinatorRestartTest, ElasticJob_WorkerKilledDuringOutage_SurvivorsGoOnAfterTheRestart) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  v1::JobSpec spec = MakeSpec("edead", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, kHeartbeatMs);
  spec.set_min_world_size(2);
  ASSERT_TRUE(coordinator_.Admin()->CreateJob(spec).ok());
  constexpr int64_t kRunSteps = 60;
  StartWorkers("edead", 4, kRunSteps, 50, {"--collective_timeout_ms=30000"});
  ASSERT_TRUE(WaitForStep(8, absl::Seconds(60))) << Diagnostics();
  coordinator_.Kill();
  workers_[3]->Signal(SIGKILL);
  absl::SleepFor(absl::Seconds(1));
  // The restored coordinator declares no death for 8 s (members re-attach meanwhile), longer
  // than a survivor waits for one otherwise (twice the heartbeat timeout plus 2 s): they learn
  // it from its heartbeat replies (recovery_grace_ms) and wait for it.
  ASSERT_TRUE(coordinator_.Start({"--recovery_grace_ms=8000"})) << coordinator_.log();
  std::vector<int> codes = WaitAll(absl::Seconds(60));
  std::vector<Trace> traces;
  for (int r = 0; r < 4; ++r) {
    if (r < 3) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << "\n" << Diagnostics();
      EXPECT_EQ(workers_[r]->OutLines().size(), static_cast<size_t>(kRunSteps)) << r;
    }
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    traces.push_back(*std::move(t));
  }
  TraceCheckResult check = CheckTraces(traces, {2, 4});
  EXPECT_TRUE(check.ok()) << check.Report();
  // Rank 3 is gone from the last world averaging.
  const std::string last = workers_[0]->OutLines()[kRunSteps - 4];  // step 56: the world
  EXPECT_THAT(last, HasSubstr("\"members\": [0, 1, 2]")) << last;
}

// Sharded replicas across a restart: 8 ranks in replicas of 2 (the levels of EightRanks: the
// pairs are groups of one replica, averaging nothing). The coordinator is killed at step 7 and
// restarted from its state 2 s later: every worker finishes with exactly the lines of an
// undisturbed run, which follow the rule, and the restarted coordinator has the replica size.
TEST_F(CoordinatorRestartTest, ShardedJob_KilledMidJob_Restarted_SameValuesFollowingTheRule) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto sharded = [](const std::string& id) {
    v1::JobSpec spec = EightRanks(id);
    spec.set_replica_size(2);
    return spec;
  };
  constexpr int64_t kShardedSteps = 24;
  ASSERT_TRUE(coordinator_.Admin()->CreateJob(sharded("sharded-calm")).ok());
  StartWorkers("sharded-calm", 8, kShardedSteps, 0);
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const std::vector<std::vector<std::string>> calm = Lines(workers_);

  ASSERT_TRUE(coordinator_.Admin()->CreateJob(sharded("sharded")).ok());
  StartWorkers("sharded", 8, kShardedSteps, 100);
  ASSERT_TRUE(WaitForStep(kKillAtStep, absl::Seconds(60))) << Diagnostics();
  coordinator_.Kill();
  absl::SleepFor(absl::Seconds(2));
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const std::vector<std::vector<std::string>> lines = Lines(workers_);
  std::vector<Trace> traces;
  for (int r = 0; r < 8; ++r) {
    ASSERT_EQ(lines[r].size(), static_cast<size_t>(kShardedSteps)) << Diagnostics();
    for (int64_t s = 0; s < kShardedSteps; ++s) {
      EXPECT_EQ(lines[r][s], calm[r][s]) << "rank " << r << " step " << s;
    }
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    traces.push_back(*std::move(t));
  }
  const TraceCheckResult check = CheckTracesFollowRule(traces, sharded("sharded"));
  EXPECT_TRUE(check.ok()) << check.Report();
  EXPECT_GT(check.averages, 0);
  EXPECT_THAT(coordinator_.log(), HasSubstr("job sharded: loaded (RUNNING in generation 1"));
  absl::StatusOr<v1::Job> job = coordinator_.Admin()->GetJob("sharded");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->spec().replica_size(), 2);
}

// Paced rounds (docs/paced.md) across a restart: a decision handed out never changes. Three
// ranks of unequal speed (10, 20 and 40 ms a step) in a PERIODIC job with a paced level; the
// coordinator is killed (SIGKILL) once it has planned 3 rounds, between the planning of its last
// round and that round (the member whose request planned it holds it; the others, unless they
// asked before the kill, ask the restarted coordinator, and their round is the one the first
// holds only if the coordinator kept it), and restarted 2 s later on the same state. The
// restarted coordinator restored every round planned before the kill exactly (GetJob right after
// the restart) and plans the next ones after them; every worker finishes its rounds with exit 0;
// every rank's value at every step and every round's weights follow the weighted rule
// (paced_trace_check.h); and the coordinator's rounds are the steps the members synced at, the
// rounds handed out before the kill included.
TEST_F(CoordinatorRestartTest, PacedJob_KilledBetweenPlanningAndARound_RestartedSameDecisions) {
  constexpr int kWorld = 3;
  // At most GetJob's last 8 rounds: it shows every round of the job.
  constexpr int64_t kPacedRounds = 8;
  const std::vector<double> delay_ms = {10, 20, 40};
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto admin = coordinator_.Admin();
  ASSERT_NE(admin, nullptr);
  v1::JobSpec spec = MakeSpec("paced", kWorld, v1::PERIODIC, {{6, kWorld}}, 0, kHeartbeatMs);
  spec.mutable_levels(0)->set_paced(true);
  ASSERT_TRUE(admin->CreateJob(spec).ok());
  std::map<int, std::vector<std::string>> per_rank;
  for (int r = 0; r < kWorld; ++r) per_rank[r] = {absl::StrCat("--step_delay_ms=", delay_ms[r])};
  StartWorkers("paced", kWorld, /*steps=*/0, /*delay_ms=*/-1,
               {absl::StrCat("--rounds=", kPacedRounds), "--unix_ms"}, per_rank);
  // Round 2 is planned as the first member leaves round 1: the first one planned with paces.
  v1::PacingStatus before_kill;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline && before_kill.rounds_planned() < 3) {
    absl::StatusOr<v1::Job> job = admin->GetJob("paced");
    if (job.ok()) before_kill = job->pacing();
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(before_kill.rounds_planned(), 3) << Diagnostics();
  coordinator_.Kill();
  absl::SleepFor(absl::Seconds(2));
  // The rounds the members ran on the killed coordinator's decisions.
  int64_t ran_before_restart = -1;
  for (auto& w : workers_) {
    absl::StatusOr<Trace> t = ParseTrace("before the restart", w->out());
    ASSERT_TRUE(t.ok()) << t.status();
    for (const TraceLine& l : t->lines) ran_before_restart = std::max(ran_before_restart, l.round);
  }

  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  admin = coordinator_.Admin();
  ASSERT_NE(admin, nullptr);
  // The first call on the port of the killed incarnation may meet its broken connection.
  absl::StatusOr<v1::Job> restored = admin->GetJob("paced");
  for (int attempt = 0; attempt < 50 && restored.status().code() == absl::StatusCode::kUnavailable;
       ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));
    restored = admin->GetJob("paced");
  }
  ASSERT_TRUE(restored.ok()) << restored.status() << "\n" << coordinator_.log();
  // Every round planned before the kill, as it was planned (the members may hold it), and every
  // round they ran.
  EXPECT_GE(restored->pacing().rounds_planned(), before_kill.rounds_planned());
  EXPECT_GT(restored->pacing().rounds_planned(), ran_before_restart);
  EXPECT_THAT(RoundsLostOrChanged(before_kill, restored->pacing()), ::testing::IsEmpty());
  EXPECT_THAT(coordinator_.log(), HasSubstr("job paced: paced rounds 0.."));
  EXPECT_THAT(coordinator_.log(),
              HasSubstr("job paced: loaded (RUNNING in generation 1, 3 of 3 ranks"));

  for (int code : WaitAll(absl::Seconds(60))) ASSERT_EQ(code, 0) << Diagnostics();
  absl::StatusOr<v1::Job> job = admin->GetJob("paced");
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::string> outs;
  for (int r = 0; r < kWorld; ++r) outs.push_back(workers_[r]->out());
  EXPECT_THAT(PacedJobProblems(outs, kPacedRounds, delay_ms, job->pacing()), ::testing::IsEmpty());
  // The restart happened mid-job: the restarted coordinator planned rounds of its own.
  EXPECT_LT(restored->pacing().rounds_planned(), kPacedRounds) << Diagnostics();
  std::cout << "[figures] paced job: killed with " << before_kill.rounds_planned()
            << " rounds planned (GetJob; the last one's inner steps "
            << absl::StrJoin(before_kill.last_rounds().rbegin()->inner_steps(), ",")
            << "), rounds 0.." << ran_before_restart << " run before the restart, "
            << restored->pacing().rounds_planned() << " restored" << std::endl;
}

// The end of a job inside an outage: the coordinator killed about 1 s before the last step and
// restarted 3 s later. The workers finish every step on their existing communicators, then their
// Leave waits for the coordinator (ClientOptions::leave_timeout): every worker exits 0, and the
// restored job is FINISHED with every member LEFT. A strict and an elastic job.
TEST_F(CoordinatorRestartTest, KilledJustBeforeTheLastStep_RestartedAfter3s_EveryWorkerExits0) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  for (const bool elastic : {false, true}) {
    SCOPED_TRACE(elastic ? "elastic job" : "strict job");
    const std::string job = elastic ? "end-elastic" : "end-strict";
    v1::JobSpec spec = MakeSpec(job, 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, kHeartbeatMs);
    if (elastic) spec.set_min_world_size(2);
    auto admin = coordinator_.Admin();
    ASSERT_NE(admin, nullptr);
    ASSERT_TRUE(admin->CreateJob(spec).ok());
    constexpr int64_t kLast = 39;
    // 100 ms a step: step 30 is about 1 s before the last one.
    StartWorkers(job, 4, kLast + 1, 100);
    ASSERT_TRUE(WaitForStep(kLast - 10, absl::Seconds(60))) << Diagnostics();
    coordinator_.Kill();
    absl::SleepFor(absl::Seconds(3));
    ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
    std::vector<int> codes = WaitAll(absl::Seconds(60));
    for (size_t r = 0; r < codes.size(); ++r) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << "\n" << Diagnostics();
      EXPECT_EQ(workers_[r]->OutLines().size(), static_cast<size_t>(kLast + 1)) << r;
    }
    // The record says what happened: every member left, and the job finished.
    absl::StatusOr<v1::Job> after = coordinator_.Admin()->GetJob(job);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->state(), v1::FINISHED) << after->DebugString();
    for (const v1::Member& m : after->members()) {
      EXPECT_EQ(m.state(), v1::LEFT) << "rank " << m.rank() << ": " << after->DebugString();
    }
    EXPECT_THAT(coordinator_.log(), HasSubstr("sent again after the coordinator was unreachable"))
        << Diagnostics();
  }
}

TEST_F(CoordinatorRestartTest, SigkillStorm_EveryAcknowledgedChangeSurvives) {
  std::mt19937 random(12345);
  StageLedger ledger;
  std::map<std::string, int>& acked = ledger.acked;
  std::map<std::string, int>& attempted = ledger.attempted;
  int next_job = 0;
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
    auto admin = coordinator_.Admin();
    ASSERT_NE(admin, nullptr);
    // Check what the previous incarnation acknowledged.
    absl::StatusOr<v1::ListJobsResponse> jobs = admin->ListJobs();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    std::map<std::string, v1::Job> found;
    for (const v1::Job& j : jobs->jobs()) found[j.spec().job_id()] = j;
    for (const auto& [id, want] : acked) {
      const int tried = attempted[id];
      auto it = found.find(id);
      if (it == found.end()) {
        EXPECT_TRUE(want == kAbsent || tried == kDeleted) << id << " acked stage " << want;
        continue;
      }
      const v1::Job& j = it->second;
      EXPECT_NE(want, kDeleted) << id << " was deleted (acknowledged) but is back";
      EXPECT_EQ(j.spec().world_size(), 1) << id;
      EXPECT_EQ(j.spec().levels_size(), 1) << id;
      EXPECT_EQ(j.generation(), 1) << id;
      int stage = kCreated;
      if (j.state() == v1::RUNNING) {
        ASSERT_EQ(j.members_size(), 1) << id;
        EXPECT_EQ(j.members(0).worker_id(), "w-" + id);
        EXPECT_EQ(j.members(0).state(), v1::ALIVE);
        stage = kJoined;
      } else if (j.state() == v1::FINISHED) {
        ASSERT_EQ(j.members_size(), 1) << id;
        EXPECT_EQ(j.members(0).state(), v1::LEFT);
        stage = kLeft;
      } else {
        EXPECT_EQ(j.members_size(), 0) << id << " is PENDING with members";
      }
      EXPECT_LE(want, stage) << id << ": an acknowledged change is missing";
      EXPECT_LE(stage, tried) << id << ": a change nobody asked for";
    }
    for (const auto& [id, j] : found) {
      EXPECT_TRUE(attempted.count(id)) << "unknown job " << id;
    }
    // Forget deleted jobs; jobs left half-way are deleted to keep the store small.
    acked.clear();
    attempted.clear();
    for (const auto& [id, j] : found) ASSERT_TRUE(admin->DeleteJob(id).ok());

    // The storm: a client thread drives jobs through their stages; the coordinator dies at a
    // random moment.
    std::atomic<bool> stop{false};
    std::thread storm([&] {
      while (!stop.load()) {
        const std::string id = absl::StrCat("s", next_job++);
        if (!DriveJobThroughStages(*admin, id, next_job % 2 == 0, &ledger)) return;
      }
    });
    // The kill comes at a random moment once this round has had a few changes acknowledged
    // (a slow disk makes each fsync'ed change slow: the storm still checks some every round).
    int64_t before;
    {
      absl::MutexLock l(&ledger.mu);
      before = ledger.acknowledged;
    }
    {
      auto some = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ledger.mu) {
        return ledger.acknowledged >= before + 3;
      };
      absl::MutexLock l(&ledger.mu);
      ledger.mu.AwaitWithTimeout(absl::Condition(&some), absl::Seconds(20));
    }
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(0, 350)(random)));
    coordinator_.Kill();
    stop = true;
    storm.join();
    for (const auto& [id, stage] : attempted) acked.emplace(id, kAbsent);
  }
  std::cout << "[figures] SIGKILL storm: 6 kills, " << ledger.acknowledged
            << " acknowledged changes checked" << std::endl;
  EXPECT_GE(ledger.acknowledged, 18);
}

TEST_F(CoordinatorRestartTest, DamagedStateFile_RefusesToStartNamingIt) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  absl::StatusOr<v1::Job> created =
      coordinator_.Admin()->CreateJob(MakeSpec("keep", 2, v1::PERIODIC, {{1, 2}}, 0));
  ASSERT_TRUE(created.ok()) << created.status() << "\n" << coordinator_.log();
  coordinator_.process().process().Signal(SIGTERM);
  ASSERT_EQ(coordinator_.process().process().Wait(absl::Seconds(10)), 0) << coordinator_.log();
  const std::string db = coordinator_.state_dir() + "/state.db";
  std::filesystem::resize_file(db, std::filesystem::file_size(db) / 2);
  EXPECT_FALSE(coordinator_.Start()) << coordinator_.log();
  EXPECT_EQ(coordinator_.process().process().Wait(absl::Seconds(10)), 2) << coordinator_.log();
  EXPECT_THAT(coordinator_.log(), HasSubstr(db));
  EXPECT_THAT(coordinator_.log(), HasSubstr("DATA_LOSS"));
}

TEST_F(CoordinatorRestartTest, SecondCoordinatorOnSameStateDir_Refused) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  const pid_t first = coordinator_.process().process().pid();
  Coordinator second(dir_, "second");
  EXPECT_FALSE(second.Start());
  EXPECT_EQ(second.process().process().Wait(absl::Seconds(10)), 2);
  EXPECT_THAT(second.log(), HasSubstr(absl::StrCat("in use by another coordinator (pid ", first)));
  // The first one still serves.
  EXPECT_TRUE(coordinator_.Admin()->ListJobs().ok());
}

// Writes `path` until the file system is full; false if it never filled up.
bool FillDisk(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  const std::string chunk(4096, 'x');
  bool full = false;
  for (int i = 0; i < 100000 && !full; ++i) {
    full = std::fwrite(chunk.data(), 1, chunk.size(), f) != chunk.size() || std::fflush(f) != 0;
  }
  std::fclose(f);
  return full;
}

// Issue 25: on a full disk a replacement's refused Join was admitted in memory anyway, and a
// Join to a world-1 job was answered OK and lost after kill -9. A refused change is not made; an
// acknowledged one survives kill -9.
TEST_F(CoordinatorRestartTest, FullDisk_RefusedChangesAreNotMade_AcknowledgedOnesSurviveKill9) {
  const bool required = std::getenv("MODELAVG_REQUIRE_ROOT") != nullptr;
  if (geteuid() != 0) {
    if (required) FAIL() << "MODELAVG_REQUIRE_ROOT is set but the test does not run as root";
    GTEST_SKIP() << "needs root to mount a 512 KiB tmpfs (CI runs it: MODELAVG_REQUIRE_ROOT=1)";
  }
  const std::string small = dir_ + "/small";
  std::filesystem::create_directories(small);
  if (mount("tmpfs", small.c_str(), "tmpfs", 0, "size=512k,mode=0700") != 0) {
    const std::string why = std::strerror(errno);
    if (required) FAIL() << "cannot mount a tmpfs on " << small << ": " << why;
    GTEST_SKIP() << "cannot mount a tmpfs (" << why << "): not allowed in this container";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{small};
  coordinator_.set_state_dir(small + "/state");
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto admin = coordinator_.Admin();
  ASSERT_TRUE(admin->CreateJob(MakeSpec("one", 1, v1::PERIODIC, {{1, 1}}, 0)).ok());
  // A refused write gives the log's space back; each check fills what is free again.
  int fillers = 0;
  auto fill = [&] { return FillDisk(absl::StrCat(small, "/filler", fillers++)); };
  ASSERT_TRUE(fill());

  v1::JoinRequest join;
  join.set_job_id("one");
  join.set_worker_id("w0");
  join.set_rank(0);
  absl::StatusOr<v1::JoinResponse> joined = admin->Join(join, absl::Seconds(10));
  ASSERT_EQ(joined.status().code(), absl::StatusCode::kUnavailable) << joined.status();
  EXPECT_THAT(std::string(joined.status().message()), HasSubstr("full"));
  absl::StatusOr<v1::Job> job = admin->GetJob("one");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::PENDING);
  EXPECT_EQ(job->members_size(), 0);
  const std::string wal = coordinator_.state_dir() + "/state.db-wal";
  const auto wal_after_error =
      std::filesystem::exists(wal) ? std::filesystem::file_size(wal) : 0;
  // Retried on the full disk: refused again, nothing changes.
  fill();
  EXPECT_EQ(admin->Join(join, absl::Seconds(10)).status().code(), absl::StatusCode::kUnavailable);
  fill();
  EXPECT_EQ(admin->CreateJob(MakeSpec("two", 1, v1::PERIODIC, {{1, 1}}, 0)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(admin->GetJob("two").status().code(), absl::StatusCode::kNotFound);
  job = admin->GetJob("one");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::PENDING);

  for (int i = 0; i < fillers; ++i) std::filesystem::remove(absl::StrCat(small, "/filler", i));
  joined = admin->Join(join, absl::Seconds(10));
  ASSERT_TRUE(joined.ok()) << joined.status() << "\n" << coordinator_.log();
  EXPECT_EQ(joined->generation(), 1);
  coordinator_.Kill();
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  admin = coordinator_.Admin();
  // The first call on the port of the killed incarnation may meet its broken connection.
  for (int attempt = 0; attempt < 50; ++attempt) {
    job = admin->GetJob("one");
    if (job.status().code() != absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(job.ok()) << job.status() << "\n" << coordinator_.log();
  EXPECT_EQ(job->state(), v1::RUNNING) << "an acknowledged Join was lost";
  ASSERT_EQ(job->members_size(), 1);
  EXPECT_EQ(job->members(0).state(), v1::ALIVE);
  EXPECT_EQ(job->generation(), 1);
  std::cout << "[figures] full disk: the write-ahead log was " << wal_after_error
            << " bytes after the refused writes (checkpointed and truncated)" << std::endl;
  EXPECT_EQ(wal_after_error, 0u) << "the write-ahead log kept the failed writes' space";
  coordinator_.Kill();
}

// Issue 25: Joins refused with "the coordinator is shutting down" were stored and reloaded as
// ALIVE members; a new worker asking for such a rank got ALREADY_EXISTS.
TEST_F(CoordinatorRestartTest, JoinsRefusedAtSigterm_LeaveNoMemberBehind) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  ASSERT_TRUE(coordinator_.Admin()
                  ->CreateJob(MakeSpec("ghost", 4, v1::PERIODIC, {{1, 4}}, 0, kHeartbeatMs))
                  .ok());
  std::vector<std::thread> joins;
  std::atomic<int> unavailable{0};
  for (int r = 0; r < 3; ++r) {
    joins.emplace_back([&, r] {
      auto admin = coordinator_.Admin();
      v1::JoinRequest join;
      join.set_job_id("ghost");
      join.set_worker_id(absl::StrCat("w", r));
      join.set_rank(r);
      if (admin->Join(join, absl::Seconds(30)).status().code() ==
          absl::StatusCode::kUnavailable) {
        ++unavailable;
      }
    });
  }
  auto admin = coordinator_.Admin();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::Job> job = admin->GetJob("ghost");
    if (job.ok() && job->live_world_size() == 3) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  coordinator_.process().process().Signal(SIGTERM);
  for (std::thread& t : joins) t.join();
  EXPECT_EQ(unavailable.load(), 3);
  ASSERT_EQ(coordinator_.process().process().Wait(absl::Seconds(10)), 0) << coordinator_.log();
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  admin = coordinator_.Admin();
  absl::StatusOr<v1::Job> job = admin->GetJob("ghost");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->members_size(), 0) << job->DebugString();
  v1::JoinRequest other;
  other.set_job_id("ghost");
  other.set_worker_id("someone-else");
  other.set_rank(0);
  // Waits for the round (until the call's deadline), not refused: the rank is free.
  absl::StatusOr<v1::JoinResponse> joined = admin->Join(other, absl::Milliseconds(500));
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kDeadlineExceeded) << joined.status();
}

// Issue 25: after rm -rf of --state_dir the coordinator answered OK while writing into deleted
// files. It refuses, saying why; a restart with --require_state refuses the empty directory.
TEST_F(CoordinatorRestartTest, StateDirRemoved_WritesRefused_RequireStateRefusesEmptyDir) {
  ASSERT_TRUE(coordinator_.Start()) << coordinator_.log();
  auto admin = coordinator_.Admin();
  ASSERT_TRUE(admin->CreateJob(MakeSpec("kept", 1, v1::PERIODIC, {{1, 1}}, 0)).ok());
  std::filesystem::remove_all(coordinator_.state_dir());
  absl::StatusOr<v1::Job> created = admin->CreateJob(MakeSpec("lost", 1, v1::PERIODIC, {{1, 1}}, 0));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kUnavailable) << created.status();
  EXPECT_THAT(std::string(created.status().message()),
              HasSubstr("was removed while the coordinator ran"));
  v1::JoinRequest join;
  join.set_job_id("kept");
  join.set_worker_id("w0");
  EXPECT_EQ(admin->Join(join, absl::Seconds(10)).status().code(), absl::StatusCode::kUnavailable);
  coordinator_.Kill();
  EXPECT_FALSE(coordinator_.Start({"--require_state"})) << coordinator_.log();
  EXPECT_EQ(coordinator_.process().process().Wait(absl::Seconds(10)), 2) << coordinator_.log();
  EXPECT_THAT(coordinator_.log(), HasSubstr("--require_state"));
  EXPECT_THAT(coordinator_.log(), HasSubstr(coordinator_.state_dir()));
}

}  // namespace
}  // namespace modelavg::testing
