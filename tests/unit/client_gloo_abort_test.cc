// GlooCommunicator::Abort: a collective blocked on a member that never takes part (a stopped
// peer) is broken from another thread, promptly and with the parameters untouched.
#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/comm/gloo/gloo_mesh.h"
#include "client/comm/solo_communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "gloo/context.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/transport/unbound_buffer.h"
#include "tests/unit/gloo_test_mesh.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;


TEST(GlooAbortTest, BlockedOnAStoppedMember_AbortBreaksItPromptlyParametersUntouched) {
  // Member 2 never calls: the others block in the ring until the (long) timeout, unless aborted.
  auto mesh = MakeGlooMesh(3, absl::Seconds(60));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  constexpr int64_t kNumel = 1 << 20;  // many segments: the ring is mid-flight when aborted
  std::vector<std::vector<float>> params(2);
  std::vector<absl::Status> results(2);
  std::vector<absl::Time> returned(2);
  std::vector<std::thread> callers;
  for (int r = 0; r < 2; ++r) {
    params[r].assign(kNumel, static_cast<float>(r + 1));
    for (int64_t i = 0; i < kNumel; i += 1000) params[r][i] = static_cast<float>(i % 7 + r);
    callers.emplace_back([&, r] {
      TensorView t{params[r].data(), kNumel, DType::kFloat32};
      results[r] = mesh[r]->AllReduceAverage({t});
      returned[r] = absl::Now();
    });
  }
  const std::vector<std::vector<float>> before = params;
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Status why = absl::FailedPreconditionError("job moved to generation 2 (rank 2 died)");
  const absl::Time aborted = absl::Now();
  mesh[0]->Abort(why);
  mesh[1]->Abort(why);
  for (auto& t : callers) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r], why) << "member " << r;
    // Far below the 60 s timeout: the abort, not the timeout, ended it.
    EXPECT_LT(returned[r] - aborted, absl::Seconds(10)) << "member " << r;
    EXPECT_TRUE(params[r] == before[r]) << "member " << r << "'s parameters changed";
  }
  // Every later call fails at once with the same reason.
  std::vector<float> again(4, 1.0f);
  EXPECT_EQ(mesh[0]->AllReduceAverage({TensorView{again.data(), 4, DType::kFloat32}}), why);
  EXPECT_THAT(again, ::testing::Each(1.0f));
}

TEST(GlooAbortTest, AbortOfOneMember_PeersCollectivesFailToo) {
  // Only member 0 is aborted while all three average: the others see its connections close
  // and fail (with a transport error) instead of waiting for the timeout.
  auto mesh = MakeGlooMesh(3, absl::Seconds(60));
  for (const auto& c : mesh) ASSERT_NE(c, nullptr);
  mesh[0]->Abort(absl::AbortedError("generation changed"));
  std::vector<absl::Status> results(3);
  std::vector<std::thread> callers;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 3; ++r) {
    callers.emplace_back([&, r] {
      std::vector<float> v(1000, static_cast<float>(r));
      results[r] = mesh[r]->AllReduceAverage({TensorView{v.data(), 1000, DType::kFloat32}});
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_TRUE(absl::IsAborted(results[0])) << results[0];
  EXPECT_THAT(results[0].message(), HasSubstr("generation changed"));
  for (int r = 1; r < 3; ++r) EXPECT_FALSE(results[r].ok()) << "member " << r << results[r];
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// The cause of a strict job's survivor that ran on for the collective timeout after a peer's
// kill -9: a send waiting in a pair's transmit queue (the socket took it partly, or the write
// hit the dead peer's reset before the pair read the close) is not among the operations that
// failing the pairs wakes (Gloo's Pair::signalException), so neither a broken connection nor an
// abort ended its wait. Here a wait that no operation of any pair stands for plays that send:
// failing both pairs leaves it waiting; the mesh's AbortAll ends it at once.
TEST(GlooAbortTest, AWaitThePairsDoNotReach_EndsAtAbortAll) {
  gloo::rendezvous::HashStore store;
  std::vector<std::shared_ptr<gloo::Context>> contexts(2);
  std::vector<std::shared_ptr<MeshWaits>> waits = {std::make_shared<MeshWaits>(),
                                                   std::make_shared<MeshWaits>()};
  std::vector<std::thread> setup;
  for (int r = 0; r < 2; ++r) {
    setup.emplace_back([&, r] {
      auto dev = CreateGlooDevice("127.0.0.1");
      if (!dev.ok()) return;
      std::vector<sockaddr_storage> peers;
      auto mesh = ConnectMesh(store, *dev, r, 2, absl::Seconds(20),
                              absl::Now() + absl::Seconds(20),
                              std::make_shared<SetupCanceller>(), &peers, waits[r]);
      if (mesh.ok()) contexts[r] = *std::move(mesh);
    });
  }
  for (auto& t : setup) t.join();
  ASSERT_NE(contexts[0], nullptr);
  ASSERT_NE(contexts[1], nullptr);

  std::vector<float> data(1 << 16, 1.0f);
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer =
      contexts[0]->createUnboundBuffer(data.data(), data.size() * sizeof(float));
  absl::Notification returned;
  bool completed = true;
  std::thread waiter([&] {
    try {
      completed = buffer->waitSend(nullptr, std::chrono::seconds(20));
    } catch (const std::exception&) {
      completed = false;
    }
    returned.Notify();
  });
  // Both pairs of member 0 fail, as they do at an abort or when the peer dies: the wait goes on.
  FailPair(contexts[0]->getPair(1).get(), 1, "failed by the test");
  FailPair(contexts[1]->getPair(0).get(), 0, "failed by the test");
  EXPECT_FALSE(returned.WaitForNotificationWithTimeout(absl::Milliseconds(500)))
      << "failing the pairs ended the wait: the test no longer stands for the queued send";
  const absl::Time aborted = absl::Now();
  waits[0]->AbortAll();
  EXPECT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(5)))
      << "AbortAll did not end the wait";
  waiter.join();  // (without the abort: at the wait's own 20 s timeout)
  EXPECT_FALSE(completed);
  EXPECT_LT(absl::Now() - aborted, absl::Seconds(5));
  EXPECT_TRUE(waits[0]->aborted());
  // A buffer made after the abort does not wait either.
  std::unique_ptr<gloo::transport::UnboundBuffer> later =
      contexts[0]->createUnboundBuffer(data.data(), sizeof(float));
  const absl::Time start = absl::Now();
  EXPECT_FALSE(later->waitRecv(nullptr, std::chrono::seconds(20)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(GlooAbortTest, SoloCommunicator_AbortedFailsWithTheReason) {
  SoloCommunicator solo;
  std::vector<float> v(3, 2.0f);
  EXPECT_TRUE(solo.AllReduceAverage({TensorView{v.data(), 3, DType::kFloat32}}).ok());
  solo.Abort(absl::FailedPreconditionError("gone"));
  EXPECT_EQ(solo.AllReduceAverage({TensorView{v.data(), 3, DType::kFloat32}}),
            absl::FailedPreconditionError("gone"));
}

}  // namespace
}  // namespace modelavg::client
