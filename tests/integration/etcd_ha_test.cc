// Coordinator high availability on etcd: etcd-server members and modelavg-coordinator processes
// started here on loopback (each member with its own data dir in a temp folder), workers
// (modelavg-trace-worker over Gloo) given both coordinators' addresses.
//
//  * the store's writes are fenced: a store holding the fence of a term that has ended is
//    refused by etcd and nothing changes (in-process, deterministic);
//  * a paced job's planned rounds: kept in round order under jobs/<id>/r/, dropped from the
//    front by one range delete, gone with the job; a refused transition writes none of its
//    rounds, its member change or its drop (in-process);
//  * a standby answers UNAVAILABLE naming the leader and serves health NOT_SERVING;
//  * kill -9 of the leader mid-job (three etcd members, an 8-rank three-level job): every worker
//    finishes every step with exit 0 and values identical to an undisturbed run; the time from
//    the kill to the standby serving and to the first averaging after it is printed;
//  * kill -9 of the leader of a paced job between the planning of a round and the round: the
//    standby has every round planned before the kill as it was, and the members' rounds and
//    values follow the weighted rule;
//  * the leader SIGSTOPped past its lease, then resumed: the standby has taken over, the old
//    leader answers nothing but UNAVAILABLE naming the new one;
//  * two of three etcd members killed: the coordinator refuses writes with UNAVAILABLE, the
//    workers train on; the members restarted: everything resumes, nothing acknowledged is lost;
//  * a storm of CreateJob/Join/Leave/DeleteJob with leader kills: every acknowledged change is
//    there afterwards.
// Skipped (saying why) without etcd-server; failed instead when MODELAVG_REQUIRE_ETCD=1 (CI).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/rpc/coordinator_client.h"
#include "tests/reference/plan_reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/etcd/etcd_client.h"
#include "server/store/etcd/etcd_fence.h"
#include "server/store/etcd/etcd_state_store.h"
#include "server/store/etcd/leader_election.h"
#include "tests/integration/client_test_processes.h"
#include "tests/integration/etcd_cluster.h"
#include "tests/integration/paced_trace_check.h"
#include "tests/integration/staged_job_storm.h"
#include "tests/integration/trace_check.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/paced_rounds_store_cases.h"

namespace modelavg::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kHeartbeatMs = 1500;
constexpr int64_t kTtlMs = 2000;

#define MODELAVG_NEED_ETCD()                                                                    \
  do {                                                                                          \
    if (EtcdBinary().empty()) {                                                                 \
      if (EtcdRequired()) FAIL() << "MODELAVG_REQUIRE_ETCD=1 but there is no etcd binary "       \
                                    "(install etcd-server: bash deploy/install_deps.sh)";        \
      GTEST_SKIP() << "no etcd binary (/usr/bin/etcd or $MODELAVG_ETCD_BIN): install "          \
                      "etcd-server (bash deploy/install_deps.sh) to run the HA tests";          \
    }                                                                                           \
  } while (0)

// A fence that never moves: what a paused leader still believes.
class FixedFence final : public server::EtcdFence {
 public:
  FixedFence(std::string key, int64_t fence) : key_(std::move(key)), fence_(fence) {}
  const std::string& key() const override { return key_; }
  int64_t fence() const override { return fence_; }
  void LostLeadership(int64_t, const std::string& why) override { lost_ = why; }
  std::string lost_;

 private:
  std::string key_;
  int64_t fence_;
};

std::unique_ptr<server::EtcdClient> Etcd(const EtcdCluster& cluster) {
  server::EtcdOptions options;
  for (int i = 0; i < cluster.size(); ++i) options.endpoints.push_back(cluster.endpoint(i));
  auto client = server::EtcdClient::Create(options);
  return client.ok() ? *std::move(client) : nullptr;
}

// Every key and value under `prefix`, and the cluster's revision.
std::map<std::string, std::string> Dump(server::EtcdClient* etcd, const std::string& prefix) {
  etcdserverpb::RangeRequest range;
  range.set_key(prefix);
  range.set_range_end(server::EtcdPrefixEnd(prefix));
  std::map<std::string, std::string> out;
  auto reply = etcd->Range(range);
  if (!reply.ok()) return {{"error", std::string(reply.status().message())}};
  for (const auto& kv : reply->kvs()) out[kv.key()] = kv.value();
  return out;
}

bool WaitFor(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

TEST(EtcdStateStoreTest, StaleFence_WriteRefusedByEtcd_NothingChanges) {
  MODELAVG_NEED_ETCD();
  TempDir dir("etcd_fence");
  EtcdCluster cluster(dir.path(), 1);
  ASSERT_TRUE(cluster.Start()) << cluster.Logs();
  auto etcd = Etcd(cluster);
  ASSERT_NE(etcd, nullptr);
  const std::string prefix = "/fence-test/";
  std::atomic<int> deposed_a{0};
  server::LeaderElection a(etcd.get(), {prefix + "leader", absl::Seconds(6)},
                           {[](int64_t) { return absl::OkStatus(); },
                            [&](const std::string&) { ++deposed_a; }});
  server::EtcdStateStore store_a(etcd.get(), &a, prefix);
  a.Start("a:1");
  ASSERT_TRUE(WaitFor([&] { return a.CheckServing().ok(); }, absl::Seconds(20)));
  const int64_t fence_a = a.fence();

  // A job with a round, members in two buckets and an id, written by the leader.
  ASSERT_TRUE(store_a.CreateJob(MakeSpec("j", 300, v1::PERIODIC, {{2, 300}}, 0), 7).ok());
  server::JobDelta delta;
  delta.header = server::MembershipHeader{v1::RUNNING, 1, std::nullopt};
  for (int r : {0, 1, 299}) {
    server::Member m;
    m.rank = r;
    m.worker_id = absl::StrCat("w", r);
    m.state = v1::ALIVE;
    m.generation = 1;
    delta.members.push_back(m);
  }
  delta.comm_id = server::StoredCommId{0, 0, "k", "blob"};
  ASSERT_TRUE(store_a.Apply("j", delta).ok());

  // A second coordinator on the same prefix is a standby naming the leader.
  server::LeaderElection b(etcd.get(), {prefix + "leader", absl::Seconds(6)},
                           {[](int64_t) { return absl::OkStatus(); }, [](const std::string&) {}});
  b.Start("b:1");
  absl::SleepFor(absl::Milliseconds(600));
  std::string leader;
  absl::Status standby = b.CheckServing(&leader);
  EXPECT_EQ(standby.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(standby.message(), HasSubstr("the leader is at a:1"));
  EXPECT_EQ(leader, "a:1");

  // The leader's lease ends (as when it is paused past its TTL): b takes over.
  etcdserverpb::RangeRequest key;
  key.set_key(prefix + "leader");
  auto held = etcd->Range(key);
  ASSERT_TRUE(held.ok() && held->kvs_size() == 1);
  ASSERT_TRUE(etcd->LeaseRevoke(held->kvs(0).lease()).ok());
  ASSERT_TRUE(WaitFor([&] { return b.CheckServing().ok(); }, absl::Seconds(20)));
  ASSERT_NE(b.fence(), fence_a);

  // The old term's writes: refused by etcd, and nothing under the prefix changes.
  const auto before = Dump(etcd.get(), prefix);
  FixedFence stale(prefix + "leader", fence_a);
  server::EtcdStateStore store_stale(etcd.get(), &stale, prefix);
  ASSERT_TRUE(store_stale.LoadAll().ok());
  server::JobDelta death;
  death.header = server::MembershipHeader{v1::RUNNING, 2, std::nullopt};
  death.clear_comm_ids = true;
  absl::Status refused = store_stale.Apply("j", death);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("lost the leadership"));
  EXPECT_THAT(stale.lost_, HasSubstr("etcd refused a write"));
  EXPECT_EQ(store_stale.CreateJob(MakeSpec("k", 1, v1::PERIODIC, {{1, 1}}, 0), 1).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(store_stale.DeleteJob("j").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Dump(etcd.get(), prefix), before);

  // The new leader reads back exactly what the old one wrote while it led.
  server::EtcdStateStore store_b(etcd.get(), &b, prefix);
  auto jobs = store_b.LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  const server::StoredJob& j = (*jobs)[0];
  EXPECT_EQ(j.spec.job_id(), "j");
  EXPECT_EQ(j.created_unix_ms, 7);
  EXPECT_EQ(j.header.state, v1::RUNNING);
  ASSERT_EQ(j.members.size(), 3u);
  EXPECT_EQ(j.members[2].rank, 299);
  EXPECT_EQ(j.members[2].worker_id, "w299");
  ASSERT_EQ(j.comm_ids.size(), 1u);
  EXPECT_EQ(j.comm_ids[0].blob, "blob");
  // Its writes go through; a generation change drops the old ids.
  ASSERT_TRUE(store_b.Apply("j", death).ok());
  server::Member gone;
  gone.rank = 1;  // removed
  server::JobDelta leave;
  leave.members.push_back(gone);
  ASSERT_TRUE(store_b.Apply("j", leave).ok());
  jobs = store_b.LoadAll();
  ASSERT_TRUE(jobs.ok());
  EXPECT_EQ((*jobs)[0].header.generation, 2);
  EXPECT_TRUE((*jobs)[0].comm_ids.empty());
  EXPECT_EQ((*jobs)[0].members.size(), 2u);
  ASSERT_TRUE(store_b.DeleteJob("j").ok());
  EXPECT_TRUE(store_b.LoadAll()->empty());
  b.Stop();
  a.Stop();
}

// A coordinator process on a fixed port (kept across restarts) on the cluster's endpoints.
// A one-member etcd and a store leading on it, for the in-process store tests.
class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MODELAVG_NEED_ETCD();
    dir_ = std::make_unique<TempDir>("etcd_store");
    cluster_ = std::make_unique<EtcdCluster>(dir_->path(), 1);
    ASSERT_TRUE(cluster_->Start()) << cluster_->Logs();
    etcd_ = Etcd(*cluster_);
    ASSERT_NE(etcd_, nullptr);
    election_ = std::make_unique<server::LeaderElection>(
        etcd_.get(), server::LeaderElectionOptions{kPrefix + std::string("leader"),
                                                   absl::Seconds(6)},
        server::LeaderElection::Callbacks{[](int64_t) { return absl::OkStatus(); },
                                          [](const std::string&) {}});
    election_->Start("a:1");
    ASSERT_TRUE(WaitFor([&] { return election_->CheckServing().ok(); }, absl::Seconds(20)));
    store_ = std::make_unique<server::EtcdStateStore>(etcd_.get(), election_.get(), kPrefix);
  }
  void TearDown() override {
    store_.reset();
    if (election_ != nullptr) election_->Stop();
  }

  // The keys of paced rounds under the prefix.
  std::vector<std::string> RoundKeys() {
    std::vector<std::string> keys;
    for (const auto& [key, value] : Dump(etcd_.get(), kPrefix)) {
      if (absl::StrContains(key, "/r/")) keys.push_back(key);
    }
    return keys;
  }

  static constexpr const char* kPrefix = "/paced-test/";
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<EtcdCluster> cluster_;
  std::unique_ptr<server::EtcdClient> etcd_;
  std::unique_ptr<server::LeaderElection> election_;
  std::unique_ptr<server::EtcdStateStore> store_;
};

// The shared cases (tests/tools/paced_rounds_store_cases.h), each reopen a store of a restarted
// coordinator that loads what etcd holds; the keys are the documented ones
// (etcd_records.proto), and the deleted job left none.
TEST_F(EtcdStoreTest, PacedRounds_KeptInRoundOrder_DroppedFromTheFront_GoneWithTheJob) {
  ::modelavg::testing::RunPacedRoundsCases(store_.get(), [&]() -> server::StateStore* {
    store_ = std::make_unique<server::EtcdStateStore>(etcd_.get(), election_.get(), kPrefix);
    return store_->LoadAll().ok() ? store_.get() : nullptr;
  });
  EXPECT_THAT(RoundKeys(), ::testing::ElementsAre("/paced-test/jobs/other/r/000000000000"));
}

// A transition with rounds, a member change and a drop is one etcd transaction: refused (a store
// whose term is over), none of it is written; the leader's store then writes all of it.
TEST_F(EtcdStoreTest, PacedRounds_RefusedTransition_WritesNeitherRoundsNorMemberNorDrop) {
  ASSERT_TRUE(store_->CreateJob(MakeSpec("a", 4, v1::PERIODIC, {{2, 4}}, 0), 1).ok());
  server::JobDelta kept;
  for (int64_t r : {0, 1, 2}) kept.paced_rounds.push_back(MakePacedRound(r));
  ASSERT_TRUE(store_->Apply("a", kept).ok());
  server::JobDelta delta;
  server::Member m;
  m.rank = 0;
  m.worker_id = "w0";
  m.state = v1::ALIVE;
  m.generation = 1;
  delta.members.push_back(m);
  for (int64_t r : {3, 4}) delta.paced_rounds.push_back(MakePacedRound(r));
  delta.drop_paced_rounds_before = 2;

  const auto before = Dump(etcd_.get(), kPrefix);
  FixedFence stale(kPrefix + std::string("leader"), election_->fence() + 1000);
  server::EtcdStateStore store_stale(etcd_.get(), &stale, kPrefix);
  ASSERT_TRUE(store_stale.LoadAll().ok());
  absl::Status refused = store_stale.Apply("a", delta);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_EQ(Dump(etcd_.get(), kPrefix), before);
  server::StoredJob a = LoadPacedJob(*store_, "a");
  EXPECT_TRUE(a.members.empty());
  ExpectPacedRounds(a.paced_rounds, {0, 1, 2});

  ASSERT_TRUE(store_->Apply("a", delta).ok());
  server::EtcdStateStore reloaded(etcd_.get(), election_.get(), kPrefix);
  a = LoadPacedJob(reloaded, "a");
  ASSERT_EQ(a.members.size(), 1u);
  EXPECT_EQ(a.members[0].worker_id, "w0");
  ExpectPacedRounds(a.paced_rounds, {2, 3, 4});
  EXPECT_THAT(RoundKeys(), ::testing::ElementsAre("/paced-test/jobs/a/r/000000000002",
                                                  "/paced-test/jobs/a/r/000000000003",
                                                  "/paced-test/jobs/a/r/000000000004"));
}

// A round record that does not parse, or that holds another round than its key says, is refused
// naming the key, as a damaged plan is.
TEST_F(EtcdStoreTest, PacedRounds_DamagedRecord_LoadAllRefusesNamingTheKey) {
  ASSERT_TRUE(store_->CreateJob(MakeSpec("a", 4, v1::PERIODIC, {{2, 4}}, 0), 1).ok());
  const std::string key = "/paced-test/jobs/a/r/000000000003";
  for (const std::string& value :
       {std::string("\xff\xff\xff\xff", 4), MakePacedRound(4).SerializeAsString()}) {
    etcdserverpb::TxnRequest txn;
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    ASSERT_TRUE(etcd_->Txn(txn).ok());
    absl::StatusOr<std::vector<server::StoredJob>> jobs = store_->LoadAll();
    EXPECT_EQ(jobs.status().code(), absl::StatusCode::kDataLoss) << jobs.status();
    EXPECT_THAT(jobs.status().message(), HasSubstr(key));
  }
}

class HaCoordinator {
 public:
  HaCoordinator(std::string dir, std::string name, std::string endpoints,
                std::vector<std::string> extra_flags = {})
      : dir_(std::move(dir)), name_(std::move(name)), endpoints_(std::move(endpoints)),
        extra_flags_(std::move(extra_flags)), port_(FreePort()) {}
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  bool Start() {
    const std::string run = absl::StrCat(dir_, "/", name_, runs_++);
    std::filesystem::create_directories(run);
    for (int attempt = 0; attempt < 50; ++attempt) {
      std::vector<std::string> flags = {absl::StrCat("--listen=", address()),
                                        "--etcd_endpoints=" + endpoints_,
                                        absl::StrCat("--leader_ttl_ms=", kTtlMs),
                                        "--log_level=info"};
      flags.insert(flags.end(), extra_flags_.begin(), extra_flags_.end());
      process_ = std::make_unique<CoordinatorProcess>(MODELAVG_COORDINATOR_BIN, run,
                                                      std::move(flags));
      if (!process_->address().empty()) return true;
      if (!absl::StrContains(process_->process().err(), "cannot listen")) return false;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }
  void Kill() {
    if (process_ == nullptr) return;
    process_->process().Signal(SIGKILL);
    process_->process().Wait(absl::Seconds(10));
  }
  void Signal(int sig) { process_->process().Signal(sig); }
  // The exit code once it has exited, nullopt if it still runs after `timeout`.
  std::optional<int> Wait(absl::Duration timeout) { return process_->process().Wait(timeout); }
  std::string log() const { return process_ ? process_->process().err() : ""; }
  // Answers Ping: it leads.
  bool Leads() {
    client::ConnectionOptions options;
    options.coordinator = address();
    options.rpc_timeout = absl::Milliseconds(500);
    auto c = client::CoordinatorClient::Create(options);
    return c.ok() && (*c)->Ping().ok();
  }

 private:
  std::string dir_, name_, endpoints_;
  std::vector<std::string> extra_flags_;
  int port_;
  int runs_ = 0;
  std::unique_ptr<CoordinatorProcess> process_;
};

class EtcdHaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (EtcdBinary().empty()) {
      if (EtcdRequired()) {
        FAIL() << "MODELAVG_REQUIRE_ETCD=1 but there is no etcd binary (install etcd-server: "
                  "bash deploy/install_deps.sh)";
      }
      GTEST_SKIP() << "no etcd binary (/usr/bin/etcd or $MODELAVG_ETCD_BIN): install "
                      "etcd-server (bash deploy/install_deps.sh) to run the HA tests";
    }
    dir_ = MakeTempDir("etcd_ha");
  }
  ~EtcdHaTest() override {
    workers_.clear();
    coordinators_.clear();
    cluster_.reset();
    if (!dir_.empty() && std::getenv("MODELAVG_KEEP_TEST_DIRS") == nullptr) {
      std::filesystem::remove_all(dir_);
    }
  }

  // `members` etcd members and two coordinators; the first one started leads.
  void StartAll(int members) {
    cluster_ = std::make_unique<EtcdCluster>(dir_ + "/etcd", members);
    ASSERT_TRUE(cluster_->Start()) << cluster_->Logs();
    for (const char* name : {"a", "b"}) {
      coordinators_.push_back(std::make_unique<HaCoordinator>(dir_, name, cluster_->endpoints()));
      ASSERT_TRUE(coordinators_.back()->Start()) << coordinators_.back()->log();
      if (coordinators_.size() == 1) {
        ASSERT_TRUE(WaitFor([&] { return coordinators_[0]->Leads(); }, absl::Seconds(30)))
            << coordinators_[0]->log();
      }
    }
  }
  std::string Addresses() const {
    std::vector<std::string> all;
    for (const auto& c : coordinators_) all.push_back(c->address());
    return absl::StrJoin(all, ",");
  }
  // The index of the coordinator that leads, -1 if none within `timeout`.
  int Leader(absl::Duration timeout = absl::Seconds(30)) {
    int leader = -1;
    WaitFor(
        [&] {
          for (size_t i = 0; i < coordinators_.size(); ++i) {
            if (coordinators_[i]->Leads()) leader = static_cast<int>(i);
          }
          return leader >= 0;
        },
        timeout);
    return leader;
  }
  std::unique_ptr<client::CoordinatorClient> Admin() {
    client::ConnectionOptions options;
    options.coordinator = Addresses();
    options.rpc_timeout = absl::Seconds(5);
    auto admin = client::CoordinatorClient::Create(options);
    return admin.ok() ? *std::move(admin) : nullptr;
  }
  // Retries a call through a failover (UNAVAILABLE) for up to `timeout`.
  template <typename F>
  auto Retrying(F call, absl::Duration timeout = absl::Seconds(30)) -> decltype(call()) {
    const absl::Time deadline = absl::Now() + timeout;
    auto result = call();
    while (!StatusOf(result).ok() && StatusOf(result).code() == absl::StatusCode::kUnavailable &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(100));
      result = call();
    }
    return result;
  }
  static absl::Status StatusOf(const absl::Status& s) { return s; }
  template <typename T>
  static absl::Status StatusOf(const absl::StatusOr<T>& s) {
    return s.status();
  }

  // Rank r also gets rank_flags[r]. `steps` <= 0: no --steps (the flags give the length:
  // --rounds of a paced job); `delay_ms` < 0: no --step_delay_ms (rank_flags gives each rank's).
  void StartWorkers(const std::string& job, int world, int64_t steps, int64_t delay_ms,
                    const std::vector<std::vector<std::string>>& rank_flags = {}) {
    workers_.clear();
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv =
          TraceWorkerArgv(MODELAVG_TRACE_WORKER_BIN, Addresses(), job, r, world, 3, steps);
      argv.push_back("--log_level=warn");
      if (delay_ms >= 0) argv.push_back(absl::StrCat("--step_delay_ms=", delay_ms));
      if (static_cast<size_t>(r) < rank_flags.size()) {
        argv.insert(argv.end(), rank_flags[r].begin(), rank_flags[r].end());
      }
      workers_.push_back(std::make_unique<Process>(argv, absl::StrCat(dir_, "/", job, "-rank", r)));
    }
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
  int64_t MaxStep() {
    int64_t max_step = -1;
    for (auto& w : workers_) {
      for (const std::string& line : w->OutLines()) max_step = std::max(max_step, StepOf(line));
    }
    return max_step;
  }
  bool WaitForStep(int64_t step, absl::Duration timeout) {
    return WaitFor([&] { return MaxStep() >= step; }, timeout);
  }
  std::vector<int> WaitAll(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::vector<int> codes;
    for (auto& w : workers_) {
      codes.push_back(
          w->Wait(std::max(absl::ZeroDuration(), deadline - absl::Now())).value_or(-1));
    }
    return codes;
  }
  std::vector<std::vector<std::string>> Lines() {
    std::vector<std::vector<std::string>> lines;
    for (auto& w : workers_) lines.push_back(w->OutLines());
    return lines;
  }
  std::string Diagnostics() {
    std::string s;
    for (size_t i = 0; i < coordinators_.size(); ++i) {
      absl::StrAppend(&s, "coordinator ", i, " log:\n", coordinators_[i]->log(), "\n");
    }
    for (size_t r = 0; r < workers_.size(); ++r) {
      absl::StrAppend(&s, "rank ", r, " stderr:\n", workers_[r]->err(), "\n");
    }
    return s;
  }
  // Kills the leading coordinator (SIGKILL) and waits up to 30 s for the other one to lead: the
  // standby that took over, or null (a test failure) when there was no leader or none took over.
  HaCoordinator* FailOver() {
    const int leader = Leader();
    EXPECT_GE(leader, 0) << Diagnostics();
    if (leader < 0) return nullptr;
    coordinators_[leader]->Kill();
    HaCoordinator* standby = coordinators_[1 - leader].get();
    const bool took_over = WaitFor([&] { return standby->Leads(); }, absl::Seconds(30));
    EXPECT_TRUE(took_over) << Diagnostics();
    return took_over ? standby : nullptr;
  }
  // Runs `job` undisturbed and returns its lines.
  std::vector<std::vector<std::string>> Calm(const v1::JobSpec& spec, int64_t steps) {
    auto admin = Admin();
    EXPECT_TRUE(Retrying([&] { return admin->CreateJob(spec); }).ok());
    StartWorkers(spec.job_id(), spec.world_size(), steps, 0);
    for (int code : WaitAll(absl::Seconds(120))) EXPECT_EQ(code, 0) << Diagnostics();
    return Lines();
  }
  void ExpectSame(const std::vector<std::vector<std::string>>& calm, int64_t steps) {
    const auto lines = Lines();
    for (size_t r = 0; r < lines.size(); ++r) {
      ASSERT_EQ(lines[r].size(), static_cast<size_t>(steps)) << Diagnostics();
      for (int64_t s = 0; s < steps; ++s) {
        EXPECT_EQ(lines[r][s], calm[r][s]) << "rank " << r << " step " << s;
      }
    }
  }

  std::string dir_;
  std::unique_ptr<EtcdCluster> cluster_;
  std::vector<std::unique_ptr<HaCoordinator>> coordinators_;
  std::vector<std::unique_ptr<Process>> workers_;
};

// 8 ranks, three levels: pairs every 2 steps, quads every 4, all eight every 16.
v1::JobSpec EightRanks(const std::string& id) {
  return MakeSpec(id, 8, v1::HIERARCHICAL, {{2, 2}, {4, 4}, {16, 8}}, 4, kHeartbeatMs);
}
constexpr int64_t kSteps = 40;

TEST_F(EtcdHaTest, Standby_AnswersUnavailableNamingTheLeader_HealthNotServing) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  client::ConnectionOptions options;
  options.coordinator = coordinators_[1]->address();
  auto standby = client::CoordinatorClient::Create(options);
  ASSERT_TRUE(standby.ok());
  // (Once it has read the leader key: it campaigns within a moment of starting.)
  absl::Status s;
  ASSERT_TRUE(WaitFor(
      [&] {
        client::ConnectionOptions one;
        one.coordinator = coordinators_[1]->address();
        s = (*client::CoordinatorClient::Create(one))->Ping();
        return absl::StrContains(s.message(), "the leader is at");
      },
      absl::Seconds(20)))
      << s;
  s = (*standby)->CreateJob(MakeSpec("x", 1, v1::PERIODIC, {{1, 1}}, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("standby; the leader is at " + coordinators_[0]->address()));
  // The client followed the leader it named.
  EXPECT_EQ((*standby)->current_address(), coordinators_[0]->address());
  EXPECT_TRUE((*standby)->CreateJob(MakeSpec("x", 1, v1::PERIODIC, {{1, 1}}, 0)).ok());
  Process health_a({MODELAVG_HEALTH_BIN, "--coordinator=" + coordinators_[0]->address()},
                   dir_ + "/health-a");
  Process health_b({MODELAVG_HEALTH_BIN, "--coordinator=" + coordinators_[1]->address()},
                   dir_ + "/health-b");
  EXPECT_EQ(health_a.Wait(absl::Seconds(20)), 0) << health_a.out() << health_a.err();
  EXPECT_EQ(health_b.Wait(absl::Seconds(20)), 1) << health_b.out() << health_b.err();
  EXPECT_THAT(health_b.err() + health_b.out(), HasSubstr("NOT_SERVING"));
}

TEST_F(EtcdHaTest, LeaderKilledMidJob_StandbyTakesOver_EveryWorkerFinishesSameValues) {
  ASSERT_NO_FATAL_FAILURE(StartAll(3));
  const auto calm = Calm(EightRanks("calm"), kSteps);
  ASSERT_EQ(calm[0].size(), static_cast<size_t>(kSteps));

  auto admin = Admin();
  ASSERT_TRUE(admin->CreateJob(EightRanks("storm")).ok());
  StartWorkers("storm", 8, kSteps, 100);
  ASSERT_TRUE(WaitForStep(7, absl::Seconds(60))) << Diagnostics();
  const int leader = Leader();
  ASSERT_GE(leader, 0);
  coordinators_[leader]->Kill();
  const absl::Time killed = absl::Now();
  const int64_t step_at_kill = MaxStep();
  HaCoordinator& standby = *coordinators_[1 - leader];
  ASSERT_TRUE(WaitFor([&] { return standby.Leads(); }, absl::Seconds(30))) << Diagnostics();
  const absl::Time serving = absl::Now();
  ASSERT_TRUE(WaitForStep(16, absl::Seconds(60))) << Diagnostics();
  const absl::Time first_top = absl::Now();
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  ExpectSame(calm, kSteps);
  EXPECT_THAT(standby.log(), HasSubstr("job storm: loaded (RUNNING in generation 1, 8 of 8 ranks"));
  std::cout << "[figures] leader kill -9 at step " << step_at_kill << " (lease TTL " << kTtlMs
            << " ms): kill -> standby serving "
            << absl::FormatDuration(absl::Trunc(serving - killed, absl::Milliseconds(1)))
            << ", kill -> first top-level averaging (step 16) "
            << absl::FormatDuration(absl::Trunc(first_top - killed, absl::Milliseconds(1)))
            << std::endl;
}

// A plan update through a fail-over (docs/plan-updates.md): UpdateJob answered by the leader,
// which is killed (-9) at once, before the switch step. The standby loads the plan and its switch
// step from etcd; every member switches at that step, and every value of every rank at every step
// follows the rule of the plan in force (plan_reference.h).
TEST_F(EtcdHaTest, PlanUpdated_LeaderKilledBeforeTheSwitch_StandbyKeepsItEveryMemberSwitchesAtE) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  v1::JobSpec a = MakeSpec("plan", 4, v1::HIERARCHICAL, {{2, 2}, {8, 4}}, 0, kHeartbeatMs);
  v1::OuterOptimizer* o = a.mutable_levels(1)->mutable_outer();
  o->set_lr(0.7);
  o->set_momentum(0.9);
  o->set_nesterov(true);
  v1::JobSpec b = a;
  b.mutable_levels(0)->set_period(4);
  b.mutable_levels(1)->set_period(16);
  b.mutable_levels(1)->mutable_outer()->set_lr(0.35);
  auto admin = Admin();
  ASSERT_TRUE(admin->CreateJob(a).ok());
  constexpr int64_t kPlanSteps = 400;
  StartWorkers("plan", 4, kPlanSteps, 10);
  ASSERT_TRUE(WaitForStep(20, absl::Seconds(60))) << Diagnostics();
  absl::StatusOr<v1::UpdateJobResponse> updated = admin->UpdateJob(b);
  ASSERT_TRUE(updated.ok()) << updated.status() << Diagnostics();
  const int64_t e = updated->switch_step();
  const int leader = Leader();
  ASSERT_GE(leader, 0);
  coordinators_[leader]->Kill();
  const int64_t at_kill = MaxStep();
  HaCoordinator& standby = *coordinators_[1 - leader];
  ASSERT_TRUE(WaitFor([&] { return standby.Leads(); }, absl::Seconds(30))) << Diagnostics();
  // (The admin connection follows the leader: a failed call moves it to the next address.)
  absl::StatusOr<v1::Job> job = Retrying([&] { return admin->GetJob("plan"); });
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->plan_history_size(), 2);
  EXPECT_EQ(job->plan_history(1).switch_step(), e);
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  const auto want = PlanReference({{a, 0}, {b, e}}, kPlanSteps);
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->lines.size(), static_cast<size_t>(kPlanSteps));
    for (int64_t s = 0; s < kPlanSteps; ++s) {
      const TraceLine& l = t->lines[s];
      const std::string where = absl::StrCat("rank ", r, " step ", s, ": ", l.text);
      EXPECT_EQ(l.plan, want[s][r].plan) << where;
      EXPECT_EQ(l.level, want[s][r].level) << where;
      EXPECT_NEAR(l.value, want[s][r].value, std::max(1e-3, 1e-5 * std::fabs(want[s][r].value)))
          << where;
    }
  }
  std::cout << "[figures] plan version 1 accepted for step " << e << "; leader killed at step "
            << at_kill << std::endl;
}

// Paced rounds (docs/paced.md) through a fail-over: a decision handed out never changes. Three
// ranks of unequal speed (10, 20 and 40 ms a step) in a PERIODIC job with a paced level; the
// leader is killed (-9) once it has planned 3 rounds, between the planning of its last round and
// that round (the member whose request planned it holds it; the others, unless they asked
// before the kill, ask the standby, and their round is the one the first holds only if the
// standby kept it). The
// standby, once it leads, has every round planned before the kill exactly as GetJob showed it
// and plans the next ones after them; every worker finishes its rounds with exit 0; every rank's
// value at every step and every round's weights follow the weighted rule (paced_trace_check.h);
// and the coordinator's rounds are the steps the members synced at, the rounds handed out by the
// killed leader included.
TEST_F(EtcdHaTest, PacedJob_LeaderKilledBetweenPlanningAndARound_StandbyKeepsTheRounds) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  constexpr int kWorld = 3;
  // At most GetJob's last 8 rounds: it shows every round of the job.
  constexpr int64_t kPacedRounds = 8;
  const std::vector<double> delay_ms = {10, 20, 40};
  v1::JobSpec spec = MakeSpec("paced", kWorld, v1::PERIODIC, {{6, kWorld}}, 0, kHeartbeatMs);
  spec.mutable_levels(0)->set_paced(true);
  auto admin = Admin();
  ASSERT_TRUE(Retrying([&] { return admin->CreateJob(spec); }).ok());
  std::vector<std::vector<std::string>> rank_flags;
  for (int r = 0; r < kWorld; ++r) {
    rank_flags.push_back({absl::StrCat("--step_delay_ms=", delay_ms[r]),
                          absl::StrCat("--rounds=", kPacedRounds), "--unix_ms"});
  }
  StartWorkers("paced", kWorld, /*steps=*/0, /*delay_ms=*/-1, rank_flags);
  // Round 2 is planned as the first member leaves round 1: the first one planned with paces.
  v1::PacingStatus before_kill;
  ASSERT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::Job> job = admin->GetJob("paced");
        if (job.ok()) before_kill = job->pacing();
        return before_kill.rounds_planned() >= 3;
      },
      absl::Seconds(60)))
      << Diagnostics();
  HaCoordinator* taking_over = FailOver();
  ASSERT_NE(taking_over, nullptr);
  HaCoordinator& standby = *taking_over;
  // (The admin connection follows the leader: a failed call moves it to the next address.)
  absl::StatusOr<v1::Job> taken = Retrying([&] { return admin->GetJob("paced"); });
  ASSERT_TRUE(taken.ok()) << taken.status();
  // Every round planned before the kill, as it was planned (the members may hold it).
  EXPECT_GE(taken->pacing().rounds_planned(), before_kill.rounds_planned());
  EXPECT_THAT(RoundsLostOrChanged(before_kill, taken->pacing()), ::testing::IsEmpty());
  EXPECT_THAT(standby.log(), HasSubstr("job paced: paced rounds 0.."));
  EXPECT_THAT(standby.log(), HasSubstr("job paced: loaded (RUNNING in generation 1, 3 of 3 ranks"));

  for (int code : WaitAll(absl::Seconds(60))) ASSERT_EQ(code, 0) << Diagnostics();
  absl::StatusOr<v1::Job> job = Retrying([&] { return admin->GetJob("paced"); });
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<std::string> outs;
  for (int r = 0; r < kWorld; ++r) outs.push_back(workers_[r]->out());
  EXPECT_THAT(PacedJobProblems(outs, kPacedRounds, delay_ms, job->pacing()), ::testing::IsEmpty());
  // The fail-over happened mid-job: the standby planned rounds of its own.
  EXPECT_LT(taken->pacing().rounds_planned(), kPacedRounds) << Diagnostics();
  std::cout << "[figures] paced job: leader killed with " << before_kill.rounds_planned()
            << " rounds planned (GetJob; the last one's inner steps "
            << absl::StrJoin(before_kill.last_rounds().rbegin()->inner_steps(), ",")
            << "), the standby took over with " << taken->pacing().rounds_planned() << std::endl;
}

// Sharded replicas through a fail-over: 8 ranks in replicas of 2, elastic. Rank 5 is killed and
// its mate (rank 4) stopped, so that its record stays as the loss left it; once the replica is
// retired the leader is killed. The standby serves the job with its replica size and the retired
// replica (rank 4 RETIRED by rank 5, one generation change), and the other replicas finish with
// every line following the rule.
TEST_F(EtcdHaTest, ShardedJob_ReplicaRetired_LeaderKilled_StandbyKeepsIt) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  v1::JobSpec spec =
      MakeSpec("replicas", 8, v1::HIERARCHICAL, {{2, 4}, {4, 8}}, 0, kHeartbeatMs);
  spec.set_replica_size(2);
  spec.set_min_world_size(4);
  auto admin = Admin();
  ASSERT_TRUE(Retrying([&] { return admin->CreateJob(spec); }).ok());
  constexpr int64_t kRunSteps = 80;
  StartWorkers("replicas", 8, kRunSteps, 50);
  ASSERT_TRUE(WaitForStep(6, absl::Seconds(60))) << Diagnostics();
  workers_[5]->Signal(SIGKILL);
  workers_[4]->Signal(SIGSTOP);
  ASSERT_TRUE(WaitFor(
      [&] {
        absl::StatusOr<v1::Job> job = admin->GetJob("replicas");
        return job.ok() && job->members_size() == 8 && job->members(4).state() == v1::RETIRED;
      },
      absl::Seconds(20)))
      << Diagnostics();
  HaCoordinator* taking_over = FailOver();
  ASSERT_NE(taking_over, nullptr);
  HaCoordinator& standby = *taking_over;
  absl::StatusOr<v1::Job> job = Retrying([&] { return admin->GetJob("replicas"); });
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->spec().replica_size(), 2);
  EXPECT_EQ(job->generation(), 2);
  EXPECT_EQ(job->members(4).state(), v1::RETIRED);
  EXPECT_EQ(job->members(4).retired_by(), 5);
  EXPECT_EQ(job->members(5).state(), v1::DEAD);
  EXPECT_THAT(job->last_change().reason(), HasSubstr("replica 2 (ranks 4..5) retired"));
  workers_[4]->Signal(SIGKILL);  // (it is stopped: nothing else would end it)
  std::vector<int> codes = WaitAll(absl::Seconds(120));
  std::vector<Trace> traces;
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), workers_[r]->out());
    ASSERT_TRUE(t.ok()) << t.status();
    if (r != 4 && r != 5) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << "\n" << Diagnostics();
      EXPECT_EQ(t->lines.size(), static_cast<size_t>(kRunSteps)) << "rank " << r;
    }
    traces.push_back(*std::move(t));
  }
  const TraceCheckResult check = CheckTracesFollowRule(traces, spec, /*every_rank_lived=*/false);
  EXPECT_TRUE(check.ok()) << check.Report();
}

TEST_F(EtcdHaTest, LeaderPausedPastTtl_StandbyTakesOver_OldLeaderStopsServing) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  const auto calm = Calm(EightRanks("calm"), kSteps);
  auto admin = Admin();
  ASSERT_TRUE(admin->CreateJob(EightRanks("paused")).ok());
  StartWorkers("paused", 8, kSteps, 100);
  ASSERT_TRUE(WaitForStep(5, absl::Seconds(60))) << Diagnostics();
  coordinators_[0]->Signal(SIGSTOP);
  ASSERT_TRUE(WaitFor([&] { return coordinators_[1]->Leads(); }, absl::Seconds(30)))
      << Diagnostics();
  absl::SleepFor(absl::Milliseconds(500));
  coordinators_[0]->Signal(SIGCONT);
  // Its first answers after the pause: UNAVAILABLE naming the new leader, no write taken.
  client::ConnectionOptions options;
  options.coordinator = coordinators_[0]->address();
  auto old = client::CoordinatorClient::Create(options);
  ASSERT_TRUE(old.ok());
  absl::Status s = (*old)->CreateJob(MakeSpec("late", 1, v1::PERIODIC, {{1, 1}}, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_FALSE(coordinators_[0]->Leads());
  for (int code : WaitAll(absl::Seconds(120))) ASSERT_EQ(code, 0) << Diagnostics();
  ExpectSame(calm, kSteps);
  EXPECT_THAT(coordinators_[0]->log(), HasSubstr("stops leading"));
  // The write sent to the old leader never happened.
  absl::StatusOr<v1::Job> late = Retrying([&] { return admin->GetJob("late"); });
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound) << late.status();
  EXPECT_TRUE(coordinators_[1]->Leads());
}

TEST_F(EtcdHaTest, TwoOfThreeEtcdMembersKilled_WritesRefusedTrainingGoesOn_RestartResumes) {
  ASSERT_NO_FATAL_FAILURE(StartAll(3));
  // The world averages first at step 64: pairs and quads (their communicators made by step 6)
  // go on through the outage; the world's bootstrap waits for the coordinator.
  auto spec = [](const std::string& id) {
    return MakeSpec(id, 8, v1::HIERARCHICAL, {{2, 2}, {4, 4}, {64, 8}}, 4, kHeartbeatMs);
  };
  const int64_t steps = 80;
  const auto calm = Calm(spec("calm"), steps);
  auto admin = Admin();
  ASSERT_TRUE(admin->CreateJob(spec("quorum")).ok());
  ASSERT_TRUE(admin->CreateJob(MakeSpec("kept", 2, v1::PERIODIC, {{2, 2}}, 0)).ok());
  StartWorkers("quorum", 8, steps, 100);
  ASSERT_TRUE(WaitForStep(8, absl::Seconds(60))) << Diagnostics();
  cluster_->Kill(2);
  absl::SleepFor(absl::Seconds(1));
  cluster_->Kill(1);
  // With one member left, no write can be made; the coordinators say so.
  absl::SleepFor(absl::Milliseconds(kTtlMs + 1500));
  absl::Status refused = admin->CreateJob(MakeSpec("refused", 1, v1::PERIODIC, {{1, 1}}, 0))
                             .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("etcd"));
  // The workers train on the local schedule meanwhile.
  const int64_t before = MaxStep();
  absl::SleepFor(absl::Seconds(1));
  EXPECT_GT(MaxStep(), before) << "training stopped without quorum";
  EXPECT_LT(MaxStep(), 64) << "the world's first averaging needs the coordinator";
  cluster_->StartMember(1);
  cluster_->StartMember(2);
  ASSERT_TRUE(cluster_->WaitHealthy(absl::Seconds(60))) << cluster_->Logs();
  ASSERT_GE(Leader(), 0) << Diagnostics();
  for (int code : WaitAll(absl::Seconds(180))) ASSERT_EQ(code, 0) << Diagnostics();
  ExpectSame(calm, steps);
  // Nothing acknowledged was lost; nothing refused was made.
  EXPECT_TRUE(Retrying([&] { return admin->GetJob("kept"); }).ok());
  EXPECT_EQ(Retrying([&] { return admin->GetJob("refused"); }).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(EtcdHaTest, StormWithLeaderKills_EveryAcknowledgedChangeSurvives) {
  ASSERT_NO_FATAL_FAILURE(StartAll(1));
  std::mt19937 random(2222);
  StageLedger ledger;
  std::map<std::string, int>& acked = ledger.acked;
  std::map<std::string, int>& attempted = ledger.attempted;
  int next_job = 0;
  auto admin = Admin();
  constexpr int kKills = 5;
  for (int round = 0; round <= kKills; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    // Check what was acknowledged before the last kill.
    absl::StatusOr<v1::ListJobsResponse> jobs =
        Retrying([&] { return admin->ListJobs(); }, absl::Seconds(30));
    ASSERT_TRUE(jobs.ok()) << jobs.status() << Diagnostics();
    std::map<std::string, v1::Job> found;
    for (const v1::Job& j : jobs->jobs()) found[j.spec().job_id()] = j;
    for (const auto& [id, want] : acked) {
      const int tried = attempted[id];
      auto it = found.find(id);
      if (it == found.end()) {
        EXPECT_TRUE(want == kAbsent || want == kDeleted || tried == kDeleted)
            << id << " acked stage " << want;
        continue;
      }
      const v1::Job& j = it->second;
      EXPECT_NE(want, kDeleted) << id << " was deleted (acknowledged) but is back";
      int stage = kCreated;
      if (j.state() == v1::RUNNING) {
        stage = kJoined;
      } else if (j.state() == v1::FINISHED) {
        stage = kLeft;
      }
      EXPECT_LE(want, stage) << id << ": an acknowledged change is missing";
      EXPECT_LE(stage, tried) << id << ": a change nobody asked for";
    }
    for (const auto& [id, j] : found) EXPECT_TRUE(attempted.count(id)) << "unknown job " << id;
    for (const auto& entry : found) {
      // (Not a structured binding: a lambda may capture one only from C++20.)
      const std::string& id = entry.first;
      ASSERT_TRUE(Retrying([&] { return admin->DeleteJob(id); }).ok());
    }
    acked.clear();
    attempted.clear();
    if (round == kKills) break;
    ASSERT_GE(Leader(), 0) << Diagnostics();

    std::atomic<bool> stop{false};
    std::thread storm([&] {
      while (!stop.load()) {
        const std::string id = absl::StrCat("s", next_job++);
        if (!DriveJobThroughStages(*admin, id, next_job % 2 == 0, &ledger)) {
          absl::SleepFor(absl::Milliseconds(10));  // failing over: no busy loop
        }
      }
    });
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(300, 1500)(random)));
    const int leader = Leader();
    ASSERT_GE(leader, 0);
    coordinators_[leader]->Kill();
    stop = true;
    storm.join();
    for (const auto& [id, stage] : attempted) acked.emplace(id, kAbsent);
    // The killed one comes back as a standby.
    ASSERT_TRUE(coordinators_[leader]->Start()) << coordinators_[leader]->log();
  }
  std::cout << "[figures] etcd storm: 5 leader kills, " << ledger.acknowledged
            << " acknowledged changes checked" << std::endl;
  EXPECT_GT(ledger.acknowledged, 10);
}

// ---- etcd's TLS and authentication (--etcd_tls_*, --etcd_user/--etcd_password_file) ----

// Runs `command` with /bin/sh (openssl, etcdctl); true on exit 0. Its output goes to
// <prefix>.out/.err, which `log` gets on failure.
bool Shell(const std::string& command, const std::string& prefix, std::string* log) {
  Process p({"/bin/sh", "-c", command}, prefix);
  const std::optional<int> code = p.Wait(absl::Seconds(60));
  if (code == 0) return true;
  absl::StrAppend(log, "$ ", command, "\n", p.out(), p.err(), "\n");
  return false;
}

#define MODELAVG_NEED_PROGRAM(path, package)                                                   \
  do {                                                                                          \
    if (access(path, X_OK) != 0) {                                                              \
      if (EtcdRequired()) FAIL() << "MODELAVG_REQUIRE_ETCD=1 but there is no " path             \
                                    " (install " package ": bash deploy/install_deps.sh)";      \
      GTEST_SKIP() << "no " path " (install " package ")";                                      \
    }                                                                                           \
  } while (0)

// In `dir`: ca.pem (a CA), server.pem/server.key (127.0.0.1, signed by it), client.pem/
// client.key (signed by it), other-ca.pem (a CA that signed none of them). openssl's CLI.
bool MakeCertificates(const std::string& dir, std::string* log) {
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string cd = "cd '" + dir + "' && ";
  return Shell(cd + "openssl req -x509 " + ec + " -days 2 -subj /CN=modelavg-test-ca "
                    "-keyout ca.key -out ca.pem",
               dir + "/ca", log) &&
         Shell(cd + "openssl req -x509 " + ec + " -days 2 -subj /CN=modelavg-other-ca "
                    "-keyout other-ca.key -out other-ca.pem",
               dir + "/other-ca", log) &&
         Shell(cd + "openssl req " + ec + " -subj /CN=etcd -keyout server.key -out server.csr && "
                    "printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' "
                    "> server.ext && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
                    "-CAcreateserial -days 2 -extfile server.ext -out server.pem",
               dir + "/server", log) &&
         Shell(cd + "openssl req " + ec + " -subj /CN=coordinator -keyout client.key "
                    "-out client.csr && printf 'extendedKeyUsage=clientAuth\\n' > client.ext && "
                    "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
                    "-days 2 -extfile client.ext -out client.pem",
               dir + "/client", log);
}

// A coordinator that etcd refuses exits with 2 within `timeout`, never having served, and says
// why on stderr.
void ExpectRefused(HaCoordinator& c, const std::string& what, absl::Duration timeout,
                   const std::vector<std::string>& words) {
  const std::optional<int> code = c.Wait(timeout);
  ASSERT_TRUE(code.has_value()) << what << ": still running after " << timeout << ":\n"
                                << c.log();
  EXPECT_EQ(*code, 2) << what << ":\n" << c.log();
  EXPECT_THAT(c.log(), Not(HasSubstr("leads and serves"))) << what;
  for (const std::string& w : words) EXPECT_THAT(c.log(), HasSubstr(w)) << what;
}

TEST_F(EtcdHaTest, EtcdTls_RightCertificatesServeAJob_WrongOnesExitNamingTls) {
  MODELAVG_NEED_PROGRAM("/usr/bin/openssl", "openssl");
  const std::string certs = dir_ + "/certs";
  std::filesystem::create_directories(certs);
  std::string log;
  ASSERT_TRUE(MakeCertificates(certs, &log)) << log;
  EtcdClientTls tls;
  tls.ca_file = certs + "/ca.pem";
  tls.cert_file = certs + "/server.pem";
  tls.key_file = certs + "/server.key";
  tls.client_cert_auth = true;
  tls.client_cert_file = certs + "/client.pem";
  tls.client_key_file = certs + "/client.key";
  cluster_ = std::make_unique<EtcdCluster>(dir_ + "/etcd", 1, tls);
  ASSERT_TRUE(cluster_->Start()) << cluster_->Logs();

  // Wrong options, all at once: each exits 2 naming the TLS problem.
  HaCoordinator plaintext(dir_, "plaintext", cluster_->endpoints());
  HaCoordinator no_client_cert(dir_, "no-client-cert", cluster_->endpoints(),
                               {"--etcd_tls_ca=" + certs + "/ca.pem"});
  HaCoordinator wrong_ca(dir_, "wrong-ca", cluster_->endpoints(),
                         {"--etcd_tls_ca=" + certs + "/other-ca.pem",
                          "--etcd_tls_cert=" + certs + "/client.pem",
                          "--etcd_tls_key=" + certs + "/client.key"});
  for (HaCoordinator* c : {&plaintext, &no_client_cert, &wrong_ca}) {
    ASSERT_TRUE(c->Start()) << c->log();
  }
  // (A plaintext client, or a missing client certificate, only sees its connections closed:
  // refused after LeaderElection::kFatalAfter.)
  const absl::Duration timeout = server::LeaderElection::kFatalAfter + absl::Seconds(20);
  ExpectRefused(wrong_ca, "a CA that did not sign etcd's certificate", timeout,
                {"the TLS connection to etcd failed", "certificate verify failed",
                 "--etcd_tls_ca"});
  ExpectRefused(plaintext, "plaintext against TLS", timeout, {"TLS", "--etcd_tls_ca"});
  ExpectRefused(no_client_cert, "no client certificate", timeout, {"TLS", "--etcd_tls_cert"});

  // The right ones: it leads, and a 2-rank job runs to the end through it.
  coordinators_.push_back(std::make_unique<HaCoordinator>(
      dir_, "tls", cluster_->endpoints(),
      std::vector<std::string>{"--etcd_tls_ca=" + certs + "/ca.pem",
                               "--etcd_tls_cert=" + certs + "/client.pem",
                               "--etcd_tls_key=" + certs + "/client.key"}));
  ASSERT_TRUE(coordinators_[0]->Start()) << coordinators_[0]->log();
  ASSERT_TRUE(WaitFor([&] { return coordinators_[0]->Leads(); }, absl::Seconds(30)))
      << coordinators_[0]->log();
  auto admin = Admin();
  ASSERT_TRUE(Retrying([&] {
                return admin->CreateJob(MakeSpec("tls", 2, v1::PERIODIC, {{2, 2}}, 0));
              }).ok());
  StartWorkers("tls", 2, 12, 0);
  for (int code : WaitAll(absl::Seconds(120))) EXPECT_EQ(code, 0) << Diagnostics();
  for (const auto& lines : Lines()) EXPECT_EQ(lines.size(), 12u) << Diagnostics();
  // The job is in etcd, read back over TLS with the client certificate.
  server::EtcdOptions options;
  options.endpoints = {cluster_->endpoint(0)};
  options.tls_ca_file = tls.ca_file;
  options.tls_cert_file = tls.client_cert_file;
  options.tls_key_file = tls.client_key_file;
  auto etcd = server::EtcdClient::Create(options);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const auto keys = Dump(etcd->get(), "/modelavg/jobs/tls/");
  EXPECT_EQ(keys.count("/modelavg/jobs/tls/h"), 1u) << ::testing::PrintToString(keys);
}

TEST_F(EtcdHaTest, EtcdAuth_RightPasswordServes_WrongMissingOrUnauthorizedExitNamingAuth) {
  MODELAVG_NEED_PROGRAM("/usr/bin/etcdctl", "etcd-client");
  cluster_ = std::make_unique<EtcdCluster>(dir_ + "/etcd", 1);
  ASSERT_TRUE(cluster_->Start()) << cluster_->Logs();
  // etcd's own users and roles: root (required by `auth enable`), and modelavg, which may read
  // and write under /modelavg/ only.
  const std::string ctl = "ETCDCTL_API=3 etcdctl --endpoints=" + cluster_->endpoints() + " ";
  std::string log;
  for (const std::string& command :
       {ctl + "user add root:root-pw", ctl + "user grant-role root root",
        ctl + "user add modelavg:s3cret", ctl + "role add modelavg",
        ctl + "role grant-permission modelavg --prefix=true readwrite /modelavg/",
        ctl + "user grant-role modelavg modelavg", ctl + "auth enable"}) {
    ASSERT_TRUE(Shell(command, dir_ + "/etcdctl", &log)) << log;
  }
  const std::string right = dir_ + "/right.pw", wrong = dir_ + "/wrong.pw";
  ASSERT_TRUE(Shell("printf s3cret > '" + right + "' && printf guess > '" + wrong + "'",
                    dir_ + "/pw", &log))
      << log;

  HaCoordinator missing(dir_, "missing", cluster_->endpoints());
  HaCoordinator bad_password(dir_, "bad-password", cluster_->endpoints(),
                             {"--etcd_user=modelavg", "--etcd_password_file=" + wrong});
  HaCoordinator other_prefix(dir_, "other-prefix", cluster_->endpoints(),
                             {"--etcd_user=modelavg", "--etcd_password_file=" + right,
                              "--etcd_prefix=/elsewhere/"});
  for (HaCoordinator* c : {&missing, &bad_password, &other_prefix}) {
    ASSERT_TRUE(c->Start()) << c->log();
  }
  const absl::Duration timeout = absl::Seconds(30);
  ExpectRefused(bad_password, "a wrong password", timeout,
                {"etcd refused this coordinator's credentials", "authentication failed",
                 "--etcd_password_file"});
  ExpectRefused(missing, "no user where etcd's auth is on", timeout,
                {"etcd refused this coordinator's credentials", "--etcd_user"});
  ExpectRefused(other_prefix, "a user without permission on the prefix", timeout,
                {"etcd refused this coordinator's credentials", "permission denied",
                 "--etcd_prefix"});

  coordinators_.push_back(std::make_unique<HaCoordinator>(
      dir_, "auth", cluster_->endpoints(),
      std::vector<std::string>{"--etcd_user=modelavg", "--etcd_password_file=" + right}));
  ASSERT_TRUE(coordinators_[0]->Start()) << coordinators_[0]->log();
  ASSERT_TRUE(WaitFor([&] { return coordinators_[0]->Leads(); }, absl::Seconds(30)))
      << coordinators_[0]->log();
  // The password goes over plaintext here: said at start.
  EXPECT_THAT(coordinators_[0]->log(), HasSubstr("etcd auth without TLS"));
  auto admin = Admin();
  ASSERT_TRUE(Retrying([&] {
                return admin->CreateJob(MakeSpec("auth", 2, v1::PERIODIC, {{2, 2}}, 0));
              }).ok());
  StartWorkers("auth", 2, 12, 0);
  for (int code : WaitAll(absl::Seconds(120))) EXPECT_EQ(code, 0) << Diagnostics();
  for (const auto& lines : Lines()) EXPECT_EQ(lines.size(), 12u) << Diagnostics();
  // The job is in etcd (read as root); without credentials etcd refuses to show it.
  server::EtcdOptions options;
  options.endpoints = {cluster_->endpoint(0)};
  options.user = "root";
  options.password = "root-pw";
  auto etcd = server::EtcdClient::Create(options);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const auto keys = Dump(etcd->get(), "/modelavg/jobs/auth/");
  EXPECT_EQ(keys.count("/modelavg/jobs/auth/h"), 1u) << ::testing::PrintToString(keys);
  EXPECT_EQ(Dump(Etcd(*cluster_).get(), "/modelavg/").count("error"), 1u);
}

}  // namespace
}  // namespace modelavg::testing
