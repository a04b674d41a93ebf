// The set-up of a Gloo mesh: every wait in it has a deadline and can be cancelled, and a
// connection that is not a member's (a stray connection to a pair's port as it opens) fails the
// pair's proof of membership and the pair is set up again with the real peer. Members are
// threads of this process, the rendezvous an in-memory store.
#include <netinet/in.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "common/status_util.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/rendezvous/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/stray_connection_store.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Publishes, under member 1's key, member 0's own pair address with the highest port: member 0
// then takes the listening side of the pair (Gloo's rule compares the addresses) and waits for a
// member 1 that never connects, as a survivor does for a peer that moved on to the next
// generation.
void PublishAPeerThatNeverConnects(gloo::rendezvous::HashStore& store) {
  store.wait({"0"}, std::chrono::seconds(10));
  std::vector<char> fake = store.get("0");
  ASSERT_GE(fake.size(), sizeof(sockaddr_in));
  auto* sa = reinterpret_cast<sockaddr_in*>(fake.data());
  ASSERT_EQ(sa->sin_family, AF_INET);
  sa->sin_port = 0xFFFF;  // compared as stored: above any port member 0 has
  store.set("1", fake);
}

TEST(GlooSetupTest, Create_CancelledWhileAPeerNeverConnects_ReturnsTheReasonAtOnce) {
  gloo::rendezvous::HashStore store;
  auto dev = CreateGlooDevice("127.0.0.1");
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto cancel = std::make_shared<SetupCanceller>();
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm = absl::UnknownError("not run");
  absl::Time returned;
  std::thread member([&] {
    comm = GlooCommunicator::Create(store, *dev, 0, 2, absl::Seconds(60), nullptr, false, cancel);
    returned = absl::Now();
  });
  PublishAPeerThatNeverConnects(store);
  absl::SleepFor(absl::Milliseconds(300));  // member 0 is waiting in the pair's connect now
  const absl::Status why = SetErrorKind(absl::AbortedError("generation 7 is over"),
                                        ErrorKind::kGenerationMoved);
  const absl::Time cancelled = absl::Now();
  cancel->Cancel(why);
  member.join();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status(), why);
  EXPECT_EQ(ErrorKindOf(comm.status()), ErrorKind::kGenerationMoved);
  // At once, not at the 60 s timeout (Gloo's own connect waits five times that).
  EXPECT_LT(returned - cancelled, absl::Seconds(10));
}

TEST(GlooSetupTest, Create_APeerNeverConnects_DeadlineExceededAtTheTimeout) {
  gloo::rendezvous::HashStore store;
  auto dev = CreateGlooDevice("127.0.0.1");
  ASSERT_TRUE(dev.ok()) << dev.status();
  constexpr absl::Duration kTimeout = absl::Seconds(1);
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm = absl::UnknownError("not run");
  const absl::Time start = absl::Now();
  absl::Time returned;
  std::thread member([&] {
    comm = GlooCommunicator::Create(store, *dev, 0, 2, kTimeout);
    returned = absl::Now();
  });
  PublishAPeerThatNeverConnects(store);
  member.join();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_EQ(ErrorKindOf(comm.status()), ErrorKind::kTimeout);
  // Bounded by the timeout (Gloo's connect alone would wait 5 s): a generous margin for load.
  EXPECT_LT(returned - start, kTimeout + absl::Seconds(3));
}

TEST(GlooSetupTest, Cancel_BeforeCreate_CreateReturnsTheReason) {
  gloo::rendezvous::HashStore store;
  auto dev = CreateGlooDevice("127.0.0.1");
  ASSERT_TRUE(dev.ok());
  auto cancel = std::make_shared<SetupCanceller>();
  cancel->Cancel(absl::AbortedError("over before it began"));
  auto comm = GlooCommunicator::Create(store, *dev, 0, 2, absl::Seconds(60), nullptr, false, cancel);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().message(), "over before it began");
}

class GlooStrayTest : public ::testing::TestWithParam<modelavg::testing::StrayKind> {};

// A stray connection (tests/testing/stray_connection_store.h: silent, writing random bytes, or
// sending back what it receives) takes the connecting member's place at its peer's port while
// the mesh is set up. The pair's proof of membership fails, the pair is set up again between the
// members, and the mesh works: the sum is right, and the stray received nothing of it.
TEST_P(GlooStrayTest, Create_StrayConnectionTakesThePort_PairSetUpAgain_NothingReachesIt) {
  gloo::rendezvous::HashStore shared;
  modelavg::testing::StrayConnections strays;
  constexpr absl::Duration kTimeout = absl::Seconds(4);
  constexpr int kNumel = 1024;
  std::vector<absl::Status> statuses(2);
  std::vector<std::vector<float>> data(2);
  std::vector<std::thread> members;
  for (int r = 0; r < 2; ++r) {
    members.emplace_back([&, r] {
      modelavg::testing::StrayConnectionStore store(&shared, r, 2, &strays, GetParam());
      auto dev = CreateGlooDevice("127.0.0.1");
      if (!dev.ok()) {
        statuses[r] = dev.status();
        return;
      }
      auto comm = GlooCommunicator::Create(store, *dev, r, 2, kTimeout);
      if (!comm.ok()) {
        statuses[r] = comm.status();
        return;
      }
      data[r].assign(kNumel, 1234.5f + static_cast<float>(r));
      statuses[r] = (*comm)->AllReduceSum(data[r].data(), kNumel, DType::kFloat32);
    });
  }
  for (auto& t : members) t.join();
  ASSERT_EQ(strays.count(), 1u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "member " << r << ": " << statuses[r];
    for (float v : data[r]) ASSERT_EQ(v, 2470.0f) << "member " << r;
  }
  // The stray got at most the member's half of the proof (a nonce in Gloo's framing), never a
  // parameter: neither member's value nor the sum.
  const std::string got = strays.received();
  EXPECT_LT(got.size(), 512u);
  for (float v : {1234.5f, 1235.5f, 2470.0f}) {
    const std::string bytes(reinterpret_cast<const char*>(&v), sizeof(v));
    EXPECT_EQ(got.find(bytes), std::string::npos) << "the stray received the value " << v;
  }
}

TEST(ErrorKindTest, SetErrorKind_KeptThroughAnnotate_ReadBack) {
  absl::Status s = SetErrorKind(absl::UnavailableError("x"), ErrorKind::kPeerFailure, 3);
  s = Annotate(Annotate(s, "inner"), "outer");
  EXPECT_EQ(s.message(), "outer: inner: x");
  EXPECT_EQ(ErrorKindOf(s), ErrorKind::kPeerFailure);
  EXPECT_EQ(ErrorPeerOf(s), 3);
  EXPECT_EQ(ErrorKindOf(absl::UnavailableError("no kind")), ErrorKind::kUnknown);
  EXPECT_EQ(ErrorPeerOf(absl::UnavailableError("no kind")), -1);
  EXPECT_EQ(ErrorKindOf(SetErrorKind(absl::OkStatus(), ErrorKind::kTimeout)), ErrorKind::kUnknown);
}

INSTANTIATE_TEST_SUITE_P(
    SilenceRandomBytesAndReplay, GlooStrayTest,
    ::testing::Values(modelavg::testing::StrayKind::kSilent, modelavg::testing::StrayKind::kJunk,
                      modelavg::testing::StrayKind::kEcho),
    [](const auto& info) {
      switch (info.param) {
        case modelavg::testing::StrayKind::kSilent: return "Silence";
        case modelavg::testing::StrayKind::kJunk: return "RandomBytes";
        case modelavg::testing::StrayKind::kEcho: return "ReplayedHandshake";
      }
      return "Unknown";
    });

}  // namespace
}  // namespace modelavg::client
