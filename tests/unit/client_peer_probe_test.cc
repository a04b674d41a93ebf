// ProbeTcpPeers (client/comm/peer_probe.h): which peers' hosts answer a TCP connect. The peers are
// sockets of this process on the loopback: listening, refusing, and silent.
#include "client/comm/peer_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace modelavg::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A TCP socket bound to a free loopback port; listening when `listen` is set.
class LoopbackSocket {
 public:
  explicit LoopbackSocket(bool listen) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << std::strerror(errno);
    socklen_t len = sizeof(address_);
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&address_), &len), 0);
    if (listen) EXPECT_EQ(::listen(fd_, 4), 0);
  }
  ~LoopbackSocket() { ::close(fd_); }
  int fd() const { return fd_; }
  const sockaddr_storage& address() const { return address_; }

 private:
  int fd_ = -1;
  sockaddr_storage address_{};
};

// A listening socket whose accept queue is full (backlog 0, filled by connections nobody
// accepts): Linux drops further SYNs, so a connect to it gets no answer, as from a host cut off.
class SilentListener {
 public:
  SilentListener() : socket_(/*listen=*/false) {
    ::listen(socket_.fd(), 0);
    // Non-blocking: a filler past the queue's room would wait for minutes. The first one's
    // connection fills the queue once it is established.
    for (int& fd : fillers_) {
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      ::connect(fd, reinterpret_cast<const sockaddr*>(&socket_.address()), sizeof(sockaddr_in));
    }
    pollfd first{fillers_[0], POLLOUT, 0};
    EXPECT_EQ(::poll(&first, 1, 2000), 1) << "the filler connection was not established";
  }
  ~SilentListener() {
    for (int fd : fillers_) ::close(fd);
  }
  const sockaddr_storage& address() const { return socket_.address(); }

 private:
  LoopbackSocket socket_;
  int fillers_[2] = {-1, -1};
};

sockaddr_storage Ipv4(const char* host, int port) {
  sockaddr_storage ss{};
  auto* a = reinterpret_cast<sockaddr_in*>(&ss);
  a->sin_family = AF_INET;
  a->sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host, &a->sin_addr);
  return ss;
}

TEST(PeerProbeTest, ProbeTcpPeers_ListeningRefusingAndSilent_OnePerProbedMemberInOrder) {
  LoopbackSocket listening(/*listen=*/true);
  LoopbackSocket bound_only(/*listen=*/false);  // bound, not listening: the host refuses
  SilentListener silent;
  std::vector<sockaddr_storage> peers(5);
  peers[0] = listening.address();                // this member: skipped
  peers[1] = listening.address();
  peers[2] = bound_only.address();
  // peers[3] unset (not a TCP transport's address): skipped
  peers[4] = silent.address();
  const absl::Duration timeout = absl::Milliseconds(300);
  const absl::Time started = absl::Now();
  absl::StatusOr<std::vector<PeerReach>> reach = ProbeTcpPeers(peers, /*self=*/0, timeout);
  ASSERT_TRUE(reach.ok()) << reach.status();
  EXPECT_LT(absl::Now() - started, timeout + absl::Seconds(2));
  ASSERT_EQ(reach->size(), 3u);
  EXPECT_EQ((*reach)[0].member, 1);
  EXPECT_TRUE((*reach)[0].reachable);
  EXPECT_EQ((*reach)[0].detail, "connected");
  EXPECT_EQ((*reach)[1].member, 2);
  EXPECT_TRUE((*reach)[1].reachable) << (*reach)[1].detail;
  EXPECT_THAT((*reach)[1].detail, Not(HasSubstr("connected")));
  EXPECT_EQ((*reach)[2].member, 4);
  EXPECT_FALSE((*reach)[2].reachable) << (*reach)[2].detail;
  EXPECT_EQ((*reach)[2].detail, "no answer in 300ms");
}

TEST(PeerProbeTest, ProbeTcpPeers_OnlySelfOrUnset_NothingProbed) {
  std::vector<sockaddr_storage> peers(3);
  peers[1] = Ipv4("127.0.0.1", 1);
  absl::StatusOr<std::vector<PeerReach>> reach =
      ProbeTcpPeers(peers, /*self=*/1, absl::Milliseconds(100));
  ASSERT_TRUE(reach.ok()) << reach.status();
  EXPECT_TRUE(reach->empty());
  reach = ProbeTcpPeers({}, /*self=*/0, absl::Milliseconds(100));
  ASSERT_TRUE(reach.ok()) << reach.status();
  EXPECT_TRUE(reach->empty());
}

}  // namespace
}  // namespace modelavg::client
