#include "tests/testing/stray_connection_store.h"

#include <sys/socket.h>
#include <unistd.h>

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

StrayConnections::~StrayConnections() {
  absl::MutexLock l(&mu_);
  for (int fd : fds_) close(fd);
}

bool StrayConnections::ConnectTo(const sockaddr_in& peer, bool junk) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof(peer)) != 0) {
    close(fd);
    return false;
  }
  if (junk) {
    std::mt19937 gen(42);
    std::vector<char> bytes(256);
    for (char& c : bytes) c = static_cast<char>(gen());
    (void)!write(fd, bytes.data(), bytes.size());
  }
  absl::MutexLock l(&mu_);
  fds_.push_back(fd);
  return true;
}

size_t StrayConnections::count() const {
  absl::MutexLock l(&mu_);
  return fds_.size();
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
  strays_->ConnectTo(*peer, junk_);
  // Let the listening member's transport accept the stray before this member connects.
  absl::SleepFor(absl::Milliseconds(200));
  return value;
}

}  // namespace modelavg::testing
