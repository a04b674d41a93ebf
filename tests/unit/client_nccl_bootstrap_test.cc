// The NCCL bootstrap's id exchange (ExchangeNcclUniqueId) against an in-process coordinator:
// a failed bootstrap is retried in the same generation under a fresh key, where the leader's new
// id is accepted and the other members fetch that id, never the dead one. No GPU needed: the ids
// are opaque bytes here.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/nccl/nccl_bootstrap.h"
#include "client/rpc/coordinator_client.h"
#include "gtest/gtest.h"
#include "modelavg/client/client.h"
#include "server/coordinator_server.h"
#include "tests/tools/make_job_spec.h"
#include "tests/testing/in_process_coordinator.h"

namespace modelavg::client {
namespace {

class NcclBootstrapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto served = testing::InProcessCoordinator::Start();
    ASSERT_TRUE(served.ok()) << served.status();
    server_ = std::move(served->server);
    ASSERT_TRUE(
        served->admin->CreateJob(testing::MakeSpec("boot", 2, v1::PERIODIC, {{1, 2}}, 0)).ok());
    clients_.resize(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        ClientOptions o;
        o.coordinator = server_->address();
        o.job_id = "boot";
        o.rank = r;
        o.join_timeout = absl::Seconds(20);
        auto c = Client::Connect(o);
        EXPECT_TRUE(c.ok()) << c.status();
        if (c.ok()) clients_[r] = *std::move(c);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(clients_[0] && clients_[1]);
  }

  CommunicatorSetup Setup(int rank, int attempt) {
    Client* c = clients_[rank].get();
    CommunicatorSetup s;
    s.coordinator = c->coordinator();
    s.job_id = c->job_id();
    s.generation = c->generation();
    s.level = 0;
    s.subgroup = c->schedule().SubgroupOf(0, rank);
    s.rank = rank;
    s.credential = c->credential();
    s.timeout = absl::Seconds(5);
    s.bootstrap_attempt = attempt;
    return s;
  }

  // One attempt on both members: the leader draws `id`; returns what each member ends up with.
  std::vector<absl::StatusOr<std::string>> Exchange(int attempt, const std::string& id) {
    std::vector<absl::StatusOr<std::string>> out(2, absl::UnknownError("not run"));
    std::thread follower([&] {
      out[1] = ExchangeNcclUniqueId(Setup(1, attempt), [] {
        return absl::StatusOr<std::string>(absl::InternalError("only the leader draws"));
      });
    });
    out[0] = ExchangeNcclUniqueId(Setup(0, attempt),
                                  [&] { return absl::StatusOr<std::string>(id); });
    follower.join();
    return out;
  }

  std::unique_ptr<server::CoordinatorServer> server_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_F(NcclBootstrapTest, RetryInTheSameGeneration_LeaderPublishesAFreshId_FollowerFetchesIt) {
  const std::string first(128, 'A'), second(128, 'B');
  auto r = Exchange(0, first);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  ASSERT_TRUE(r[1].ok()) << r[1].status();
  EXPECT_EQ(*r[1], first);
  // That bootstrap failed (say a member's init timed out): its id is dead. The retry draws a
  // new one, which the coordinator must accept and the follower must receive.
  r = Exchange(1, second);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  ASSERT_TRUE(r[1].ok()) << r[1].status();
  EXPECT_EQ(*r[1], second) << "the follower fetched the failed attempt's id";
  // Why a key per attempt: one key holds one id per generation.
  r = Exchange(0, second);
  EXPECT_EQ(r[0].status().code(), absl::StatusCode::kAlreadyExists) << r[0].status();
}

TEST(NcclUniqueIdKeyTest, DistinctPerAttemptAndApartFromGloo) {
  EXPECT_NE(NcclUniqueIdKey(0), NcclUniqueIdKey(1));
  EXPECT_EQ(NcclUniqueIdKey(0).rfind("gloo/", 0), std::string::npos);
}

}  // namespace
}  // namespace modelavg::client
