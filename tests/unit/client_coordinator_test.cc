// The client against an in-process coordinator: Connect, the decision cache, generation
// tracking, the coordinator-backed Gloo store, and averagers with ranks as threads. The heartbeat
// transport (HeartbeatStream, and the fallback to unary calls) against a fake coordinator.
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/comm/gloo/coordinator_store.h"
#include "client/rpc/coordinator_client.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "server/coordinator_server.h"
#include "tests/testing/gloo_link_proxy.h"
#include "tests/tools/make_job_spec.h"
#include "tests/tools/time_scale.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;
using ::modelavg::testing::Scaled;

class ClientCoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerOptions opts;
    opts.listen = "127.0.0.1:0";
    // (Every timeout these tests grant is Scaled: a sanitizer build is far slower.)
    opts.defaults.heartbeat_timeout = Scaled(absl::Seconds(2));
    auto s = server::CoordinatorServer::Start(opts);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    ConnectionOptions copts;
    copts.coordinator = server_->address();
    auto c = CoordinatorClient::Create(copts);
    ASSERT_TRUE(c.ok());
    admin_ = *std::move(c);
  }

  void CreateJob(const std::string& id, int world, v1::Mode mode,
                 std::vector<std::pair<int64_t, int32_t>> levels, int64_t warmup = 0,
                 int64_t heartbeat_ms = 0) {
    const v1::JobSpec spec = testing::MakeSpec(id, world, mode, levels, warmup, heartbeat_ms);
    auto job = admin_->CreateJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
  }

  ClientOptions Options(const std::string& job, int rank) {
    ClientOptions o;
    o.coordinator = server_->address();
    o.job_id = job;
    o.rank = rank;
    o.join_timeout = Scaled(absl::Seconds(20));
    o.collective_timeout = Scaled(absl::Seconds(20));
    o.rpc_timeout = Scaled(o.rpc_timeout);
    o.heartbeat_interval = absl::Milliseconds(50);
    return o;
  }

  // Connects `world` clients concurrently.
  std::vector<std::unique_ptr<Client>> ConnectAll(const std::string& job, int world,
                                                  int64_t window = 4096) {
    std::vector<std::unique_ptr<Client>> clients(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        ClientOptions o = Options(job, r);
        o.schedule_window = window;
        auto c = Client::Connect(o);
        EXPECT_TRUE(c.ok()) << c.status();
        if (c.ok()) clients[r] = *std::move(c);
      });
    }
    for (auto& t : threads) t.join();
    return clients;
  }

  std::unique_ptr<server::CoordinatorServer> server_;
  std::unique_ptr<CoordinatorClient> admin_;
};

TEST_F(ClientCoordinatorTest, Connect_OneRankWorld_JoinsWithTheJobsSchedule) {
  CreateJob("solo", 1, v1::PERIODIC, {{2, 1}}, /*warmup=*/1);
  auto c = Client::Connect(Options("solo", 0));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->rank(), 0);
  EXPECT_EQ((*c)->world_size(), 1);
  EXPECT_EQ((*c)->generation(), 1);
  EXPECT_EQ((*c)->schedule().spec().warmup_steps, 1);
  auto avg = PeriodicModelAverager::Create(c->get());
  ASSERT_TRUE(avg.ok()) << avg.status();
  std::vector<float> v = {3, 4};
  TensorView t{v.data(), 2, DType::kFloat32};
  for (int s = 0; s < 5; ++s) {
    auto d = (*avg)->AverageParameters({t});
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->step, s);
    EXPECT_EQ(d->average, s >= 1 && (s - 1) % 2 == 0) << s;
  }
  EXPECT_EQ((*avg)->step(), 5);
  EXPECT_THAT(v, ::testing::ElementsAre(3, 4));
  EXPECT_TRUE((*c)->Leave("done").ok());
  EXPECT_TRUE((*c)->Leave("again").ok());
}

TEST_F(ClientCoordinatorTest, Connect_BadOptions_InvalidArgument) {
  ClientOptions o = Options("x", 0);
  o.coordinator = "";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("bad job id!", 0);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("x", -1);
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("x", 0);
  o.schedule_window = 0;
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientCoordinatorTest, Connect_UnknownJob_NotFound) {
  auto c = Client::Connect(Options("nope", 0));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound) << c.status();
}

TEST_F(ClientCoordinatorTest, Connect_NoCoordinator_Unavailable) {
  ClientOptions o = Options("x", 0);
  o.coordinator = "127.0.0.1:1";
  // The default join timeout, gone through at once: each retry's backoff moves the clock.
  o.join_timeout = absl::Minutes(5);
  FakeClock clock(absl::FromUnixSeconds(1'700'000'000), /*advance_on_wait=*/true);
  o.clock = &clock;
  auto c = Client::Connect(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("cannot reach the coordinator"));
  EXPECT_GE(clock.Now() - absl::FromUnixSeconds(1'700'000'000), absl::Minutes(4));
}

// ClientOptions::cancel ends a Join that waits for a world that never completes at once (not at
// join_timeout), and the coordinator frees the rank: another worker can take it.
TEST_F(ClientCoordinatorTest, Connect_CancelledWhileWaitingForTheWorld_CancelledAndRankFreed) {
  CreateJob("never", 2, v1::PERIODIC, {{2, 2}});
  ClientOptions o = Options("never", 0);
  o.join_timeout = absl::Minutes(5);
  o.cancel = std::make_shared<CancelToken>();
  absl::StatusOr<std::unique_ptr<Client>> c;
  std::thread joiner([&] { c = Client::Connect(o); });
  // Wait until rank 0 is in the round, then cancel.
  const absl::Time until = absl::Now() + Scaled(absl::Seconds(20));
  while (absl::Now() < until) {
    auto job = admin_->GetJob("never");
    ASSERT_TRUE(job.ok()) << job.status();
    if (job->members_size() == 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Time cancelled = absl::Now();
  o.cancel->Cancel();
  joiner.join();
  EXPECT_LT(absl::Now() - cancelled, Scaled(absl::Seconds(5)));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("cancelled"));
  // The coordinator saw the call end: the rank is free for another worker.
  absl::StatusOr<v1::Job> job;
  while (absl::Now() < until) {
    job = admin_->GetJob("never");
    ASSERT_TRUE(job.ok()) << job.status();
    if (job->members_size() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(job->members_size(), 0) << job->DebugString();
}

// Cancelled while retrying an unreachable coordinator (in the backoff): ends at once.
TEST_F(ClientCoordinatorTest, Connect_CancelledWhileCoordinatorUnreachable_Cancelled) {
  ClientOptions o = Options("x", 0);
  o.coordinator = "127.0.0.1:1";
  o.join_timeout = absl::Minutes(5);
  o.cancel = std::make_shared<CancelToken>();
  FakeClock clock;  // does not move: the backoff ends only by the cancel
  o.clock = &clock;
  absl::StatusOr<std::unique_ptr<Client>> c;
  std::thread joiner([&] { c = Client::Connect(o); });
  // The first Join failed; the worker waits before the next one.
  ASSERT_TRUE(clock.AwaitWaits(1, Scaled(absl::Seconds(20))));
  const absl::Time cancelled = absl::Now();
  o.cancel->Cancel();
  joiner.join();
  EXPECT_LT(absl::Now() - cancelled, Scaled(absl::Seconds(5)));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
}

// A coordinator slow to answer a new connection (busy with many workers re-attaching, a loaded
// machine) is waited for within the call's deadline: the HTTP/2 handshake is held for 600 ms by
// a proxy. gRPC gave the connection attempt only the 100 ms of the reconnect back-off before
// ("connection attempt timed out before receiving SETTINGS frame").
TEST_F(ClientCoordinatorTest, Call_CoordinatorSlowToHandshake_Answered) {
  const int listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listen_fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listen_fd, 16), 0);
  ASSERT_EQ(getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  target.sin_port = htons(server_->port());
  modelavg::testing::LinkProxy proxy(listen_fd, target);
  proxy.StallAfter(0);
  ConnectionOptions copts;
  copts.coordinator = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  auto slow = CoordinatorClient::Create(copts);
  ASSERT_TRUE(slow.ok()) << slow.status();
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(600));
    proxy.StallAfter(std::numeric_limits<int64_t>::max() / 2);
  });
  const absl::Time start = absl::Now();
  auto job = (*slow)->CreateJob(testing::MakeSpec("slow", 1, v1::PERIODIC, {{2, 1}}, 0));
  release.join();
  EXPECT_TRUE(job.ok()) << job.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));  // it did wait for the handshake
}

TEST_F(ClientCoordinatorTest, Connect_CoordinatorStartsLate_JoinsOnceItIsUp) {
  // Learn a free port, then free it: the worker starts before its coordinator does.
  ClientOptions o = Options("late", 0);
  o.coordinator = absl::StrCat("127.0.0.1:", server_->port());
  server_->Shutdown();
  server_.reset();
  absl::StatusOr<std::unique_ptr<Client>> client = absl::UnknownError("not run");
  std::thread worker([&] { client = Client::Connect(o); });
  absl::SleepFor(absl::Milliseconds(700));
  // The job exists before the coordinator serves (as from its --jobs_file): the worker's
  // retried Join may reach it at once, and a Join for a job not created yet is NOT_FOUND.
  server::ServerOptions opts;
  opts.listen = o.coordinator;
  opts.jobs.push_back(testing::MakeSpec("late", 1, v1::PERIODIC, {{2, 1}}, 0));
  auto s = server::CoordinatorServer::Start(opts);
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = *std::move(s);
  worker.join();
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->rank(), 0);
}

TEST_F(ClientCoordinatorTest, Create_AveragerOfTheWrongMode_FailedPrecondition) {
  CreateJob("hier", 1, v1::HIERARCHICAL, {{2, 1}});
  auto c = Client::Connect(Options("hier", 0));
  ASSERT_TRUE(c.ok()) << c.status();
  auto p = PeriodicModelAverager::Create(c->get());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("HierarchicalModelAverager"));
  EXPECT_TRUE(HierarchicalModelAverager::Create(c->get()).ok());
  EXPECT_EQ(HierarchicalModelAverager::Create(nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientCoordinatorTest, DecisionAt_WithinPrefetchedWindow_CostsNoRpc_PastItWaitsForIt) {
  CreateJob("cache", 1, v1::HIERARCHICAL, {{2, 1}, {3, 1}}, /*warmup=*/2);
  ClientOptions o = Options("cache", 0);
  o.schedule_window = 16;
  // The coordinator is shut down below: the destructor's Leave retries for leave_timeout on a
  // clock that each backoff moves at once.
  FakeClock clock(absl::FromUnixSeconds(1'700'000'000), /*advance_on_wait=*/true);
  o.clock = &clock;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->DecisionAt(0).ok());
  server_->Shutdown();  // Steps 0..15 are cached; step 16 would ask the coordinator.
  for (int s = 0; s < 16; ++s) {
    auto d = (*c)->DecisionAt(s);
    ASSERT_TRUE(d.ok()) << s << ": " << d.status();
    EXPECT_EQ(*d, (*c)->schedule().DecisionFor(s, 0)) << s;
  }
  // The coordinator is gone and step 16 was never handed to this rank: a plan update could
  // switch there (docs/plan-updates.md), so the rank waits for the coordinator, at most its
  // outage timeout (here on a clock that each wait moves at once), and then says why it stopped.
  auto d = (*c)->DecisionAt(16);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable) << d.status();
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("decide only through step 15"));
  EXPECT_EQ((*c)->DecisionAt(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientCoordinatorTest, DecisionAt_ManyWindows_MatchTheLocalSchedule) {
  CreateJob("windows", 4, v1::HIERARCHICAL, {{2, 2}, {5, 4}}, /*warmup=*/3);
  auto clients = ConnectAll("windows", 4, /*window=*/7);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  for (int r = 0; r < 4; ++r) {
    for (int s = 0; s < 40; ++s) {
      auto d = clients[r]->DecisionAt(s);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(*d, clients[r]->schedule().DecisionFor(s, r));
    }
  }
}

TEST_F(ClientCoordinatorTest, HierarchicalAverager_FourRanksAsThreads_ExactValues) {
  CreateJob("h4", 4, v1::HIERARCHICAL, {{1, 2}, {3, 4}}, /*warmup=*/1);
  auto clients = ConnectAll("h4", 4);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  std::vector<std::vector<double>> values(4);
  std::vector<absl::Status> status(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      auto avg = HierarchicalModelAverager::Create(clients[r].get());
      if (!avg.ok()) {
        status[r] = avg.status();
        return;
      }
      std::vector<double> v(10, r);
      for (int s = 0; s < 7; ++s) {
        for (double& x : v) x += (r + 1) * (s + 1) * 0.5;
        auto d = (*avg)->AverageParameters({TensorView{v.data(), 10, DType::kFloat64}});
        if (!d.ok()) {
          status[r] = d.status();
          return;
        }
        values[r].push_back(v[0]);
      }
    });
  }
  for (auto& t : threads) t.join();
  // Simulate.
  Schedule schedule = clients[0]->schedule();
  std::vector<double> sim = {0, 1, 2, 3};
  for (int s = 0; s < 7; ++s) {
    for (int r = 0; r < 4; ++r) sim[r] += (r + 1) * (s + 1) * 0.5;
    std::vector<double> next = sim;
    for (int r = 0; r < 4; ++r) {
      Decision d = schedule.DecisionFor(s, r);
      if (!d.average) continue;
      double sum = 0;
      for (int m : d.subgroup.Ranks()) sum += sim[m];
      next[r] = sum / d.subgroup.size;
    }
    sim = next;
    for (int r = 0; r < 4; ++r) {
      ASSERT_TRUE(status[r].ok()) << r << ": " << status[r];
      EXPECT_DOUBLE_EQ(values[r][s], sim[r]) << "rank " << r << " step " << s;
    }
  }
}

TEST_F(ClientCoordinatorTest, CoordinatorStore_LargeValue_SplitOverKeysAndReassembled) {
  CreateJob("store", 2, v1::PERIODIC, {{1, 2}});
  auto clients = ConnectAll("store", 2);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  auto setup = [&](int r) {
    CommunicatorSetup s;
    s.coordinator = clients[r]->coordinator();
    s.job_id = "store";
    s.generation = clients[r]->generation();
    s.level = 0;
    s.subgroup = clients[r]->schedule().SubgroupOf(0, r);
    s.rank = r;
    s.credential = clients[r]->credential();
    s.timeout = Scaled(absl::Seconds(5));
    return s;
  };
  CoordinatorStore writer(setup(0), "test/");
  CoordinatorStore reader(setup(1), "test/");
  std::vector<char> big(3 * CoordinatorStore::kMaxBlob + 17);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7);
  std::vector<char> small = {'a', 'b'};
  writer.set("big", big);
  writer.set("small", small);
  reader.wait({"big", "small"});
  EXPECT_EQ(reader.get("big"), big);
  EXPECT_EQ(reader.get("small"), small);
  // A key nobody writes: the wait ends with the coordinator's DEADLINE_EXCEEDED.
  EXPECT_THROW(reader.wait({"never"}, std::chrono::milliseconds(200)), std::exception);
  EXPECT_EQ(reader.last_error().code(), absl::StatusCode::kDeadlineExceeded)
      << reader.last_error();
}

TEST_F(ClientCoordinatorTest, GenerationChange_PeerLeaves_OnlyItsSubgroupsStop) {
  CreateJob("leave", 4, v1::HIERARCHICAL, {{1, 2}, {2, 4}});
  auto clients = ConnectAll("leave", 4);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  ASSERT_TRUE(clients[3]->Leave("finished").ok());
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  while (clients[0]->latest_generation() == clients[0]->generation() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(clients[0]->latest_generation(), 2);
  const Schedule& s = clients[0]->schedule();
  EXPECT_TRUE(clients[0]->CheckCanAverage(s.SubgroupOf(0, 0)).ok());
  absl::Status all = clients[0]->CheckCanAverage(s.SubgroupOf(1, 0));
  EXPECT_EQ(all.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(all.message()), HasSubstr("rank 3 left"));
  EXPECT_EQ(clients[0]->CheckUsable().code(), absl::StatusCode::kFailedPrecondition);
}

// A worker whose averaging failed (e.g. its Gloo set-up met a stray connection) does not leave
// in order: the coordinator counts it as a death, so an elastic job that falls below
// min_world_size stops (PENDING) instead of running on with too few ranks.
TEST_F(ClientCoordinatorTest, Leave_AfterAFailure_CountsAsADeathBelowMinWorldSize) {
  v1::JobSpec spec = testing::MakeSpec("fail", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, 0);
  spec.set_min_world_size(3);
  ASSERT_TRUE(admin_->CreateJob(spec).ok());
  auto clients = ConnectAll("fail", 4);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  for (int r : {2, 3}) {
    clients[r]->RecordFailure(absl::UnavailableError("connecting the Gloo mesh failed"));
    ASSERT_TRUE(clients[r]->Leave("exiting on an error").ok());
  }
  auto job = admin_->GetJob("fail");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::PENDING) << job->DebugString();
  for (const v1::Member& m : job->members()) {
    if (m.rank() >= 2) EXPECT_EQ(m.state(), v1::DEAD) << job->DebugString();
  }
  // The survivors learn that they cannot go on.
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  while (clients[0]->AdvanceGeneration().ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(clients[0]->AdvanceGeneration().ok());
}

TEST_F(ClientCoordinatorTest, Leave_WithoutAFailure_IsOrderly) {
  v1::JobSpec spec = testing::MakeSpec("done", 4, v1::HIERARCHICAL, {{2, 2}, {4, 4}}, 0, 0);
  spec.set_min_world_size(3);
  ASSERT_TRUE(admin_->CreateJob(spec).ok());
  auto clients = ConnectAll("done", 4);
  for (auto& c : clients) ASSERT_NE(c, nullptr);
  for (int r : {2, 3}) ASSERT_TRUE(clients[r]->Leave("finished").ok());
  auto job = admin_->GetJob("done");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::RUNNING) << job->DebugString();
  for (const v1::Member& m : job->members()) {
    if (m.rank() >= 2) EXPECT_EQ(m.state(), v1::LEFT) << job->DebugString();
  }
}

// The outage bound (the default five minutes) on a fake clock: each failed heartbeat finds the
// outage longer by the minute the clock moved since the last look.
TEST_F(ClientCoordinatorTest, GenerationChange_CoordinatorGone_Unavailable) {
  CreateJob("gone", 1, v1::PERIODIC, {{1, 1}}, 0, /*heartbeat_ms=*/500);
  ClientOptions options = Options("gone", 0);
  options.coordinator_outage_timeout = absl::Minutes(5);
  FakeClock clock;
  options.clock = &clock;
  auto c = Client::Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  server_->Shutdown();
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  while ((*c)->CheckUsable().ok() && absl::Now() < deadline) {
    clock.Advance(absl::Minutes(1));
    absl::SleepFor(options.heartbeat_interval);
  }
  EXPECT_EQ((*c)->CheckUsable().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string((*c)->CheckUsable().message()), HasSubstr("has not answered"));
  EXPECT_THAT(std::string((*c)->CheckUsable().message()),
              HasSubstr("coordinator_outage_timeout is 5m"));
}

TEST(ClientAuthTest, Connect_TokenRequired_RightTokenJoinsWrongOneUnauthenticated) {
  server::ServerOptions opts;
  opts.auth_token = "s3cret";
  auto s = server::CoordinatorServer::Start(opts);
  ASSERT_TRUE(s.ok()) << s.status();
  ConnectionOptions admin_opts;
  admin_opts.coordinator = (*s)->address();
  admin_opts.auth_token = "s3cret";
  auto admin = CoordinatorClient::Create(admin_opts);
  ASSERT_TRUE(admin.ok());
  v1::JobSpec spec;
  spec.set_job_id("auth");
  spec.set_world_size(1);
  spec.set_mode(v1::PERIODIC);
  spec.add_levels()->set_period(1);
  spec.mutable_levels(0)->set_group_size(1);
  ASSERT_TRUE((*admin)->CreateJob(spec).ok());

  ClientOptions o;
  o.coordinator = (*s)->address();
  o.job_id = "auth";
  o.auth_token = "wrong";
  EXPECT_EQ(Client::Connect(o).status().code(), absl::StatusCode::kUnauthenticated);
  o.auth_token = "s3cret";
  o.heartbeat_interval = absl::Milliseconds(20);
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->DecisionAt(7).ok());  // GetSchedule carries the token too
  // So does the HeartbeatStream: the step it reports arrives.
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  int64_t reported = -1;
  while (reported != 7 && absl::Now() < deadline) {
    auto job = (*admin)->GetJob("auth");
    ASSERT_TRUE(job.ok()) << job.status();
    reported = job->members(0).last_step();
    if (reported != 7) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(reported, 7);
}

TEST(ClientAuthTest, Create_TlsFilesWithoutTls_InvalidArgument) {
  ConnectionOptions o;
  o.coordinator = "127.0.0.1:1";
  o.tls_ca_file = "/nonexistent/ca.pem";
  EXPECT_EQ(CoordinatorClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.tls = true;
  auto c = CoordinatorClient::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("/nonexistent/ca.pem"));
}

// A one-rank coordinator that counts how the client heartbeats, and whose generation a test can
// move. HeartbeatStream answers like the real one with reply_interval_ms > 0 (first beat, on
// change, at least every reply_interval_ms); without `stream`, it is UNIMPLEMENTED, as on a
// coordinator that predates it.
class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  explicit FakeCoordinator(bool stream) : stream_(stream) {}

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*,
                    v1::JoinResponse* response) override {
    response->set_rank(0);
    response->set_world_size(1);
    response->set_generation(1);
    response->set_heartbeat_timeout_ms(2000);
    v1::JobSpec* spec = response->mutable_spec();
    spec->set_job_id("fake");
    spec->set_world_size(1);
    spec->set_mode(v1::PERIODIC);
    v1::Level* level = spec->add_levels();
    level->set_period(1);
    level->set_group_size(1);
    v1::Subgroup* group = response->add_subgroups();
    group->set_period(1);
    group->add_ranks(0);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    ++unary_beats_;
    Answer(*request, response);
    return grpc::Status::OK;
  }

  grpc::Status HeartbeatStream(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::HeartbeatResponse, v1::HeartbeatRequest>* stream) override {
    ++stream_calls_;
    if (!stream_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no HeartbeatStream here");
    v1::HeartbeatRequest beat;
    int64_t sent_generation = -1;
    absl::Time sent_at;
    absl::Duration interval;
    while (stream->Read(&beat)) {
      if (stream_beats_++ == 0) {
        reply_interval_ms_ = beat.reply_interval_ms();
        interval = absl::Milliseconds(beat.reply_interval_ms());
      }
      v1::HeartbeatResponse reply;
      Answer(beat, &reply);
      if (reply.generation() == sent_generation && absl::Now() - sent_at < interval) continue;
      sent_generation = reply.generation();
      sent_at = absl::Now();
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }

  grpc::Status Leave(grpc::ServerContext*, const v1::LeaveRequest*,
                     v1::LeaveResponse*) override {
    return grpc::Status::OK;
  }

  void set_generation(int64_t generation) { generation_ = generation; }
  int unary_beats() const { return unary_beats_; }
  int stream_calls() const { return stream_calls_; }
  int stream_beats() const { return stream_beats_; }
  int64_t reply_interval_ms() const { return reply_interval_ms_; }

 private:
  void Answer(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response) const {
    response->set_state(v1::RUNNING);
    response->set_generation(generation_);
    if (request.generation() != generation_) {
      response->mutable_last_change()->set_generation(generation_);
      response->mutable_last_change()->set_rank(-1);
      response->mutable_last_change()->set_reason("fake change");
    }
  }

  const bool stream_;
  std::atomic<int64_t> generation_{1};
  std::atomic<int> unary_beats_{0};
  std::atomic<int> stream_calls_{0};
  std::atomic<int> stream_beats_{0};
  std::atomic<int64_t> reply_interval_ms_{-1};
};

class ClientHeartbeatTest : public ::testing::Test {
 protected:
  void Start(bool stream) {
    fake_ = std::make_unique<FakeCoordinator>(stream);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(fake_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    }
  }

  void Connect(bool heartbeat_stream, bool share = false) {
    ClientOptions o;
    o.coordinator = address_;
    o.job_id = "fake";
    o.rank = 0;
    o.join_timeout = absl::Seconds(20);
    o.heartbeat_interval = absl::Milliseconds(20);
    o.heartbeat_stream = heartbeat_stream;
    o.share_heartbeat_stream = share;
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Waits (at most 10 s) until `done` holds.
  template <typename Pred>
  static bool WaitFor(Pred done) {
    const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
    while (!done()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  // Moves the fake to generation 2; the client must notice it through its heartbeat.
  void ExpectGenerationChangeNoticed() {
    fake_->set_generation(2);
    ASSERT_TRUE(WaitFor([&] { return !client_->CheckUsable().ok(); }));
    const absl::Status s = client_->CheckUsable();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("fake change"));
    EXPECT_EQ(client_->latest_generation(), 2);
  }

  std::unique_ptr<FakeCoordinator> fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientHeartbeatTest, Stream_GenerationChangeArrivesWithoutUnaryCalls) {
  Start(/*stream=*/true);
  Connect(/*heartbeat_stream=*/true);
  ASSERT_TRUE(WaitFor([&] { return fake_->stream_beats() >= 5; }));
  ExpectGenerationChangeNoticed();
  EXPECT_EQ(fake_->unary_beats(), 0);
  EXPECT_EQ(fake_->stream_calls(), 1);
  // A third of the 2 s heartbeat timeout the fake's Join announced.
  EXPECT_EQ(fake_->reply_interval_ms(), 666);
  // Leave ends the stream (no hang, no thread left behind).
  EXPECT_TRUE(client_->Leave("done").ok());
  client_.reset();
}

TEST_F(ClientHeartbeatTest, CoordinatorWithoutStream_FallsBackToUnaryCalls) {
  Start(/*stream=*/false);
  Connect(/*heartbeat_stream=*/true);
  ASSERT_TRUE(WaitFor([&] { return fake_->unary_beats() >= 3; }));
  EXPECT_EQ(fake_->stream_calls(), 1);  // tried once, then unary for good
  ExpectGenerationChangeNoticed();
  EXPECT_TRUE(client_->CheckUsable().code() != absl::StatusCode::kUnavailable);
}

// A shared stream asked of a coordinator without HostHeartbeatStream: the rank heartbeats on a
// HeartbeatStream of its own, and learns of changes as before.
TEST_F(ClientHeartbeatTest, SharedStream_CoordinatorWithoutIt_FallsBackToTheRanksOwnStream) {
  Start(/*stream=*/true);
  Connect(/*heartbeat_stream=*/true, /*share=*/true);
  ASSERT_TRUE(WaitFor([&] { return fake_->stream_beats() >= 5; }));
  EXPECT_EQ(fake_->stream_calls(), 1);
  EXPECT_EQ(fake_->unary_beats(), 0);
  ExpectGenerationChangeNoticed();
  EXPECT_TRUE(client_->Leave("done").ok());
  client_.reset();
}

TEST_F(ClientHeartbeatTest, StreamOff_UnaryCallsOnly) {
  Start(/*stream=*/true);
  Connect(/*heartbeat_stream=*/false);
  ASSERT_TRUE(WaitFor([&] { return fake_->unary_beats() >= 3; }));
  EXPECT_EQ(fake_->stream_calls(), 0);
  ExpectGenerationChangeNoticed();
}

}  // namespace
}  // namespace modelavg::client
