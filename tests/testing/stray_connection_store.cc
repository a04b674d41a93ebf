#include "tests/testing/stray_connection_store.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace modelavg::testing {
namespace {

// Member `owner`'s address for its pair with `other` in `value` (what `owner` published), or
// null when it is not an IPv4 address of a mesh of `size`.
const sockaddr_in* PairAddress(const std::vector<char>& value, int owner, int other, int size) {
  if (size < 2 || value.size() % (size - 1) != 0) return nullptr;
  const size_t each = value.size() / (size - 1);
  const int index = other > owner ? other - 1 : other;
  if (each < sizeof(sockaddr_in)) return nullptr;
  const auto* sa = reinterpret_cast<const sockaddr_in*>(value.data() + index * each);
  return sa->sin_family == AF_INET ? sa : nullptr;
}

// Gloo's rule (tcp::Pair::connect): compare the addresses, then the ports as stored.
bool Connects(const sockaddr_in& self, const sockaddr_in& peer) {
  const int rv = std::memcmp(&self.sin_addr, &peer.sin_addr, sizeof(in_addr));
  return rv != 0 ? rv > 0 : self.sin_port - peer.sin_port > 0;
}

}  // namespace

StrayConnections::StrayConnections() : thread_([this] { Serve(); }) {}

StrayConnections::~StrayConnections() {
  stop_ = true;
  thread_.join();
  absl::MutexLock l(&mu_);
  for (int fd : fds_) close(fd);
}

void StrayConnections::Serve() {
  while (!stop_) {
    std::vector<pollfd> polled;
    std::vector<size_t> which;
    {
      absl::MutexLock l(&mu_);
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (done_[i]) continue;
        polled.push_back({fds_[i], POLLIN, 0});
        which.push_back(i);
      }
    }
    if (polled.empty()) {
      absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (poll(polled.data(), polled.size(), 20) <= 0) continue;
    for (size_t p = 0; p < polled.size(); ++p) {
      if ((polled[p].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const size_t i = which[p];
      char buf[4096];
      const ssize_t n = recv(polled[p].fd, buf, sizeof(buf), MSG_DONTWAIT);
      absl::MutexLock l(&mu_);
      if (n <= 0) {
        // Closed by the member (or failed): held open, no longer read.
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) done_[i] = true;
        continue;
      }
      received_[i].append(buf, static_cast<size_t>(n));
      if (kinds_[i] == StrayKind::kEcho) (void)!send(polled[p].fd, buf, n, MSG_NOSIGNAL);
    }
  }
}

bool StrayConnections::ConnectTo(const sockaddr_in& peer, StrayKind kind) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof(peer)) != 0) {
    close(fd);
    return false;
  }
  if (kind == StrayKind::kJunk) {
    std::mt19937 gen(42);
    std::vector<char> bytes(256);
    for (char& c : bytes) c = static_cast<char>(gen());
    (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  absl::MutexLock l(&mu_);
  fds_.push_back(fd);
  kinds_.push_back(kind);
  received_.emplace_back();
  done_.push_back(false);
  return true;
}

size_t StrayConnections::count() const {
  absl::MutexLock l(&mu_);
  return fds_.size();
}

std::string StrayConnections::received() const {
  absl::MutexLock l(&mu_);
  std::string all;
  for (const std::string& r : received_) all += r;
  return all;
}

std::vector<char> StrayConnectionStore::get(const std::string& key) {
  std::vector<char> value = store_->get(key);
  int writer = -1;
  if (strayed_ || !absl::SimpleAtoi(key, &writer) || writer == rank_) return value;
  const std::vector<char> mine = store_->get(std::to_string(rank_));
  const sockaddr_in* own = PairAddress(mine, rank_, writer, size_);
  const sockaddr_in* peer = PairAddress(value, writer, rank_, size_);
  if (own == nullptr || peer == nullptr || !Connects(*own, *peer)) return value;
  strayed_ = true;
  strays_->ConnectTo(*peer, kind_);
  // Let the listening member's transport accept the stray before this member connects.
  absl::SleepFor(absl::Milliseconds(200));
  return value;
}

}  // namespace modelavg::testing
