#include "client/comm/peer_probe.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace modelavg::client {

absl::StatusOr<std::vector<PeerReach>> ProbeTcpPeers(const std::vector<sockaddr_storage>& peers,
                                                     int self, absl::Duration timeout) {
  struct Probe {
    int member;
    int fd = -1;
    bool done = false;
    PeerReach reach;
  };
  std::vector<Probe> probes;
  for (int i = 0; i < static_cast<int>(peers.size()); ++i) {
    if (i == self) continue;
    const sockaddr_storage& ss = peers[i];
    if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) continue;
    Probe p{i};
    p.reach.member = i;
    p.fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (p.fd < 0) {
      return absl::InternalError(absl::StrCat("probing member ", i, ": socket() failed: ",
                                              std::strerror(errno)));
    }
    const socklen_t len =
        ss.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    const int rv = ::connect(p.fd, reinterpret_cast<const sockaddr*>(&ss), len);
    const int err = rv == 0 ? 0 : errno;
    if (err != EINPROGRESS) {
      p.done = true;
      p.reach.reachable = err == 0 || err == ECONNREFUSED;
      p.reach.detail = err == 0 ? "connected" : std::strerror(err);
    }
    probes.push_back(std::move(p));
  }
  const absl::Cleanup close_all = [&probes] {
    for (Probe& p : probes) {
      if (p.fd >= 0) ::close(p.fd);
    }
  };
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Probe*> waiting;
    for (Probe& p : probes) {
      if (!p.done) {
        fds.push_back(pollfd{p.fd, POLLOUT, 0});
        waiting.push_back(&p);
      }
    }
    const absl::Duration left = deadline - absl::Now();
    if (fds.empty() || left <= absl::ZeroDuration()) break;
    const int n = ::poll(fds.data(), fds.size(),
                         static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
    if (n < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("probing the members: poll() failed: ",
                                              std::strerror(errno)));
    }
    for (size_t k = 0; n > 0 && k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      int err = 0;
      socklen_t err_len = sizeof(err);
      ::getsockopt(fds[k].fd, SOL_SOCKET, SO_ERROR, &err, &err_len);
      waiting[k]->done = true;
      // A refusal is the host's own answer: its network works.
      waiting[k]->reach.reachable = err == 0 || err == ECONNREFUSED;
      waiting[k]->reach.detail = err == 0 ? "connected" : std::strerror(err);
    }
  }
  std::vector<PeerReach> out;
  for (Probe& p : probes) {
    if (!p.done) p.reach.detail = absl::StrCat("no answer in ", absl::FormatDuration(timeout));
    out.push_back(p.reach);
  }
  return out;
}

}  // namespace modelavg::client
