// ClientOptions::share_heartbeat_stream against an in-process coordinator: the ranks of one
// process carry their beats in one HostHeartbeatStream (counted by the coordinator's metrics),
// every rank stays alive and its step is recorded, each learns of a generation change, and a
// process that dies (its stream broken) loses all its ranks at half the heartbeat timeout.
#include <sys/stat.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/rpc/coordinator_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "modelavg/client/client.h"
#include "modelavg/v1/coordinator.grpc.pb.h"
#include "server/coordinator_server.h"
#include "tests/tools/http_get.h"
#include "tests/tools/make_job_spec.h"
#include "tests/testing/in_process_coordinator.h"
#include "tests/tools/temp_dir.h"
#include "tests/tools/time_scale.h"

namespace modelavg::client {
namespace {

using ::modelavg::testing::Scaled;
using ::testing::HasSubstr;

class SharedHeartbeatTest : public ::testing::Test {
 protected:
  static constexpr int kWorld = 4;

  void SetUp() override {
    server::ServerOptions opts;
    opts.listen = "127.0.0.1:0";
    opts.metrics_listen = "127.0.0.1:0";
    auto served = testing::InProcessCoordinator::Start(opts);
    ASSERT_TRUE(served.ok()) << served.status();
    server_ = std::move(served->server);
    admin_ = std::move(served->admin);
  }

  // An elastic job of kWorld ranks (a departure moves the generation, the job runs on).
  void CreateJob(const std::string& id, absl::Duration heartbeat_timeout) {
    v1::JobSpec spec = testing::MakeSpec(id, kWorld, v1::PERIODIC, {{1, kWorld}}, 0,
                                         absl::ToInt64Milliseconds(heartbeat_timeout));
    spec.set_min_world_size(1);
    auto job = admin_->CreateJob(spec);
    ASSERT_TRUE(job.ok()) << job.status();
  }

  std::vector<std::unique_ptr<Client>> ConnectAll(const std::string& job) {
    std::vector<std::unique_ptr<Client>> clients(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        ClientOptions o;
        o.coordinator = server_->address();
        o.job_id = job;
        o.rank = r;
        o.join_timeout = Scaled(absl::Seconds(20));
        o.rpc_timeout = Scaled(o.rpc_timeout);
        o.heartbeat_interval = absl::Milliseconds(50);
        o.share_heartbeat_stream = true;
        auto c = Client::Connect(o);
        EXPECT_TRUE(c.ok()) << c.status();
        if (c.ok()) clients[r] = *std::move(c);
      });
    }
    for (auto& t : threads) t.join();
    return clients;
  }

  // Every rank joins at once: ranks for which `as_client` holds get a Client (options through
  // `configure`, if given), the others are joined raw (their answers in `raw`).
  struct Mixed {
    std::vector<std::unique_ptr<Client>> clients;
    std::vector<v1::JoinResponse> raw;
  };
  Mixed JoinMixed(const std::string& job, const std::function<bool(int)>& as_client,
                  const std::function<void(int, ClientOptions*)>& configure = nullptr) {
    Mixed out{std::vector<std::unique_ptr<Client>>(kWorld), std::vector<v1::JoinResponse>(kWorld)};
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        if (as_client(r)) {
          ClientOptions o;
          o.coordinator = server_->address();
          o.job_id = job;
          o.rank = r;
          o.join_timeout = Scaled(absl::Seconds(20));
          o.heartbeat_interval = absl::Milliseconds(50);
          if (configure) configure(r, &o);
          auto c = Client::Connect(o);
          EXPECT_TRUE(c.ok()) << c.status();
          if (c.ok()) out.clients[r] = *std::move(c);
          return;
        }
        v1::JoinRequest join;
        join.set_job_id(job);
        join.set_worker_id(absl::StrCat("raw-", r));
        join.set_rank(r);
        absl::StatusOr<v1::JoinResponse> j = admin_->Join(join, Scaled(absl::Seconds(20)));
        EXPECT_TRUE(j.ok()) << j.status();
        if (j.ok()) out.raw[r] = *j;
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  // modelavg_rpcs_total for `method` and `code` on the HTTP port; 0 when absent.
  double RpcCount(const std::string& method, const std::string& code) {
    const std::vector<std::string> parts = absl::StrSplit(server_->metrics_address(), ':');
    int port = 0;
    EXPECT_TRUE(absl::SimpleAtoi(parts.back(), &port));
    const std::string page = testing::HttpGet(port, "/metrics");
    EXPECT_FALSE(page.empty());
    for (absl::string_view line : absl::StrSplit(page, '\n')) {
      if (!absl::StartsWith(line, "modelavg_rpcs_total{")) continue;
      if (!absl::StrContains(line, absl::StrCat("method=\"", method, "\""))) continue;
      if (!absl::StrContains(line, absl::StrCat("code=\"", code, "\""))) continue;
      double v = 0;
      EXPECT_TRUE(absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) << line;
      return v;
    }
    return 0;
  }

  v1::Job GetJob(const std::string& id) {
    absl::StatusOr<v1::Job> job = admin_->GetJob(id);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  std::unique_ptr<server::CoordinatorServer> server_;
  std::unique_ptr<CoordinatorClient> admin_;
};

TEST_F(SharedHeartbeatTest, FourRanksOneStream_AllLive_StepsRecorded_ChangeSeenByEach) {
  const absl::Duration timeout = Scaled(absl::Seconds(1));
  CreateJob("shared", timeout);
  std::vector<std::unique_ptr<Client>> clients = ConnectAll("shared");
  for (const auto& c : clients) ASSERT_NE(c, nullptr);
  for (int r = 0; r < kWorld; ++r) clients[r]->ReportStep(10 + r);
  // Three heartbeat timeouts: every rank's beats arrive (none is declared dead), each with its
  // own step.
  absl::SleepFor(3 * timeout);
  v1::Job job = GetJob("shared");
  EXPECT_EQ(job.generation(), 1) << job.DebugString();
  ASSERT_EQ(job.members_size(), kWorld);
  for (const v1::Member& m : job.members()) {
    EXPECT_EQ(m.state(), v1::ALIVE) << m.DebugString();
    EXPECT_EQ(m.last_step(), 10 + m.rank()) << m.DebugString();
  }
  // Rank 3 leaves: the others learn the new generation through the shared stream.
  ASSERT_TRUE(clients[3]->Leave("done").ok());
  clients[3].reset();
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  for (int r = 0; r < 3; ++r) {
    while (clients[r]->latest_generation() < 2 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(clients[r]->latest_generation(), 2) << "rank " << r;
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(clients[r]->Leave("done").ok());
    clients[r].reset();
  }
  // One stream carried all four, and ended cleanly; no rank opened one of its own.
  EXPECT_EQ(RpcCount("HostHeartbeatStream", "OK"), 1);
  EXPECT_EQ(RpcCount("HeartbeatStream", "OK"), 0);
  EXPECT_EQ(RpcCount("Heartbeat", "OK"), 0);
}

// A process that dies breaks its shared stream without a closing beat: every rank it carried is
// declared dead for "connection lost" at half the heartbeat timeout, before the timeout itself.
TEST_F(SharedHeartbeatTest, BrokenStream_EveryRankItCarriedDeclaredDeadForConnectionLost) {
  const absl::Duration timeout = Scaled(absl::Seconds(6));
  CreateJob("lost", timeout);
  // Ranks 0 and 1 live on (their own clients); ranks 2 and 3 beat on one raw stream that is then
  // cancelled, as a process's death would.
  Mixed mixed = JoinMixed("lost", [](int r) { return r < 2; });
  const std::vector<v1::JoinResponse>& joined = mixed.raw;
  std::vector<std::unique_ptr<Client>>& live = mixed.clients;
  auto channel = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  const absl::Time broken_at = absl::Now();
  {
    grpc::ClientContext ctx;
    auto stream = stub->HostHeartbeatStream(&ctx);
    v1::HostHeartbeatRequest req;
    req.set_reply_interval_ms(1000);
    for (int r = 2; r < kWorld; ++r) {
      v1::HeartbeatRequest* b = req.add_beats();
      b->set_job_id("lost");
      b->set_rank(r);
      b->set_generation(1);
      b->set_credential(joined[r].credential());
    }
    ASSERT_TRUE(stream->Write(req));
    v1::HostHeartbeatResponse reply;
    ASSERT_TRUE(stream->Read(&reply));
    ASSERT_EQ(reply.members_size(), 2);
    ctx.TryCancel();
    stream->Finish();
  }
  v1::Job job;
  const absl::Time deadline = absl::Now() + 2 * timeout;
  while (absl::Now() < deadline) {
    job = GetJob("lost");
    if (job.vacant_ranks_size() >= 2) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration took = absl::Now() - broken_at;
  EXPECT_THAT(job.vacant_ranks(), ::testing::UnorderedElementsAre(2, 3)) << job.DebugString();
  EXPECT_LT(took, timeout) << "declared dead only at the heartbeat timeout";
  EXPECT_THAT(job.last_change().reason(), ::testing::HasSubstr("connection lost"));
  EXPECT_EQ(job.state(), v1::RUNNING);
  for (auto& c : live) {
    if (c != nullptr) EXPECT_TRUE(c->Leave("done").ok());
  }
}

// The host's relay from a follower's side, in one process: rank 0's Client serves the relay (its
// lock was free); a raw HostHeartbeatStream on the relay's socket carries ranks 1 and 2. Their
// first answers come back through the relay, then its keep-alives; a beat with `lost` set is
// refused (only the relay sets it); when the follower's stream breaks, both its ranks are
// declared dead for "connection lost" before the heartbeat timeout; when rank 0 leaves, the
// relay stops (its socket is gone).
TEST_F(SharedHeartbeatTest, Relay_FollowerStream_AnswersAndKeepAlives_LostOnBreak_StopsOnLeave) {
  const absl::Duration timeout = Scaled(absl::Seconds(6));
  CreateJob("relay", timeout);
  testing::TempDir dir("relay-unit");
  ASSERT_FALSE(dir.path().empty());
  const std::string relay_dir = dir.path() + "/relay";
  Mixed mixed = JoinMixed(
      "relay", [](int r) { return r == 0 || r == 3; },
      [&](int r, ClientOptions* o) {
        if (r == 0) o->heartbeat_relay_dir = relay_dir;
      });
  const std::vector<v1::JoinResponse>& joined = mixed.raw;
  std::unique_ptr<Client>& served = mixed.clients[0];
  std::unique_ptr<Client>& own = mixed.clients[3];
  ASSERT_NE(served, nullptr);
  ASSERT_NE(own, nullptr);
  struct stat st;
  ASSERT_EQ(::stat(relay_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  std::string socket;
  const absl::Time found_by = absl::Now() + Scaled(absl::Seconds(10));
  while (socket.empty() && absl::Now() < found_by) {
    for (const auto& e : std::filesystem::directory_iterator(relay_dir)) {
      if (absl::EndsWith(e.path().string(), ".sock")) socket = e.path().string();
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_FALSE(socket.empty()) << "rank 0 serves no relay in " << relay_dir;
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
  auto beats = [&](bool lost) {
    v1::HostHeartbeatRequest req;
    req.set_reply_interval_ms(300);
    req.set_beat_interval_ms(50);
    for (int r = 1; r <= 2; ++r) {
      v1::HeartbeatRequest* b = req.add_beats();
      b->set_job_id("relay");
      b->set_rank(r);
      b->set_generation(1);
      b->set_step(40 + r);
      b->set_credential(joined[r].credential());
      b->set_lost(lost && r == 2);
    }
    return req;
  };
  const absl::Time broken_at = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(30))));
    auto stream = stub->HostHeartbeatStream(&ctx);
    EXPECT_TRUE(stream->Write(beats(false)));
    std::vector<int> answered;
    int keepalives = 0;
    v1::HostHeartbeatResponse reply;
    // Both first answers, then two keep-alives (the relay's, about every 150 ms), beating on.
    while (keepalives < 2 && stream->Read(&reply)) {
      if (reply.members().empty()) ++keepalives;
      for (const v1::MemberHeartbeatReply& m : reply.members()) {
        EXPECT_EQ(m.error_code(), 0) << m.DebugString();
        EXPECT_EQ(m.reply().state(), v1::RUNNING) << m.DebugString();
        answered.push_back(m.rank());
      }
      stream->Write(beats(false));
    }
    EXPECT_THAT(answered, ::testing::UnorderedElementsAre(1, 2));
    EXPECT_EQ(keepalives, 2);
    v1::Job job = GetJob("relay");
    for (const v1::Member& m : job.members()) {
      if (m.rank() == 1 || m.rank() == 2) {
        EXPECT_EQ(m.last_step(), 40 + m.rank()) << m.DebugString();
      }
    }
    ctx.TryCancel();
    stream->Finish();
    return absl::Now();
  }();
  {
    grpc::ClientContext ctx;
    auto stream = stub->HostHeartbeatStream(&ctx);
    ASSERT_TRUE(stream->Write(beats(/*lost=*/true)));
    stream->WritesDone();
    const grpc::Status s = stream->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("only the relay sets it"));
  }
  v1::Job job;
  const absl::Time deadline = absl::Now() + 2 * timeout;
  while (absl::Now() < deadline) {
    job = GetJob("relay");
    if (job.vacant_ranks_size() >= 2) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_THAT(job.vacant_ranks(), ::testing::UnorderedElementsAre(1, 2)) << job.DebugString();
  EXPECT_LT(absl::Now() - broken_at, timeout) << "declared dead only at the heartbeat timeout";
  EXPECT_THAT(job.last_change().reason(), HasSubstr("connection lost"));
  // Rank 0 leaves: the relay goes with its process's last rank.
  EXPECT_TRUE(served->Leave("done").ok());
  served.reset();
  EXPECT_FALSE(std::filesystem::exists(socket));
  EXPECT_TRUE(own->Leave("done").ok());
}

// A relay directory that others could read (the ranks' credentials pass through its socket) is
// refused at Connect, saying what to do.
TEST_F(SharedHeartbeatTest, RelayDirOpenToOthers_ConnectRefusedSayingChmod) {
  CreateJob("open-dir", Scaled(absl::Seconds(6)));
  testing::TempDir dir("relay-open");
  ASSERT_FALSE(dir.path().empty());
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ClientOptions o;
  o.coordinator = server_->address();
  o.job_id = "open-dir";
  o.rank = 0;
  o.heartbeat_relay_dir = dir.path();
  auto c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("chmod 700")) << c.status();
  o.heartbeat_relay_dir = "relative/dir";
  c = Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("not an absolute path")) << c.status();
}

}  // namespace
}  // namespace modelavg::client
