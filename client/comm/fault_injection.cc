#include "client/comm/fault_injection.h"

#include <netinet/in.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

void FaultInjection::MaybeStrayConnectTo(const sockaddr_storage& peer) {
  {
    absl::MutexLock l(&mu_);
    if (!stray_first_) return;
    stray_first_ = false;
  }
  const socklen_t len = peer.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  const int fd = socket(peer.ss_family, SOCK_STREAM, 0);
  if (fd < 0) return;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), len) != 0) {
    close(fd);
    return;
  }
  spdlog::warn("test fault: a stray connection to the peer's Gloo port, ahead of this member");
  {
    absl::MutexLock l(&mu_);
    strays_.push_back(fd);
  }
  // Let the peer's transport accept the stray before this member connects.
  absl::SleepFor(absl::Milliseconds(200));
}

FaultInjection::~FaultInjection() {
  absl::MutexLock l(&mu_);
  for (int fd : strays_) close(fd);
}

}  // namespace modelavg::client
