// A silent or broken link for Gloo tests with ranks as threads: the TCP connections of one rank go
// through a proxy that can stop forwarding (at once, or after a given number of bytes) while
// keeping every socket open, so the peers see neither a reset nor a close — only silence, as with
// a stopped process or a dropped route — or that closes them after a given number of bytes, as
// when a peer's process dies or its connection is reset mid-collective. Gloo's rendezvous is
// steered through the proxy by a store view that hands the connecting side of each of that rank's
// pairs the proxy's address.
#ifndef MODELAVG_TESTS_TESTING_GLOO_LINK_PROXY_H_
#define MODELAVG_TESTS_TESTING_GLOO_LINK_PROXY_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/rendezvous/store.h"

namespace modelavg::testing {

// Forwards every connection accepted on 127.0.0.1:<port()> to `target`, in both directions.
class LinkProxy {
 public:
  // `listen_fd` is a bound, listening socket (see DroppingStore::ProxyFor).
  LinkProxy(int listen_fd, sockaddr_in target) : listen_fd_(listen_fd), target_(target) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~LinkProxy() {
    stop_ = true;
    thread_.join();
    for (auto& [a, b] : conns_) {
      close(a);
      close(b);
    }
    close(listen_fd_);
  }
  LinkProxy(const LinkProxy&) = delete;
  LinkProxy& operator=(const LinkProxy&) = delete;

  // Stops forwarding once `bytes` more bytes (both directions together) have passed; 0: now.
  void StallAfter(int64_t bytes) {
    absl::MutexLock l(&mu_);
    stall_at_ = forwarded_ + bytes;
    drop_ = false;
  }
  // Forwards again, without limit (after StallAfter: the connections go on where they stopped).
  void Resume() {
    absl::MutexLock l(&mu_);
    stall_at_ = -1;
    drop_ = false;
  }
  // Closes both ends of every connection once `bytes` more bytes (both directions together)
  // have passed: the peers see their connection broken.
  void DropAfter(int64_t bytes) {
    absl::MutexLock l(&mu_);
    stall_at_ = forwarded_ + bytes;
    drop_ = true;
  }
  bool dropped() const {
    absl::MutexLock l(&mu_);
    return dropped_;
  }
  int64_t forwarded() const {
    absl::MutexLock l(&mu_);
    return forwarded_;
  }
  bool stalled() const {
    absl::MutexLock l(&mu_);
    return stall_at_ >= 0 && forwarded_ >= stall_at_;
  }

 private:
  // Bytes that may still pass before the stall (-1: no limit).
  int64_t Budget() const {
    absl::MutexLock l(&mu_);
    return stall_at_ < 0 ? -1 : stall_at_ - forwarded_;
  }

  // Whether the budget is spent on a link that is to break (then marked broken).
  bool DropDue() {
    absl::MutexLock l(&mu_);
    if (!drop_ || stall_at_ < 0 || forwarded_ < stall_at_) return false;
    dropped_ = true;
    return true;
  }

  void Loop() {
    std::vector<char> buf(1 << 16);
    while (!stop_) {
      if (DropDue()) {
        for (auto& [a, b] : conns_) {
          close(a);
          close(b);
        }
        conns_.clear();
      }
      const int64_t budget = Budget();
      std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}};
      if (budget != 0) {
        for (auto& [a, b] : conns_) {
          fds.push_back({a, POLLIN, 0});
          fds.push_back({b, POLLIN, 0});
        }
      }
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) Accept();
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const size_t conn = (i - 1) / 2;
        if (conn >= conns_.size() || conns_[conn].first < 0) continue;
        const int from = fds[i].fd;
        const int to = from == conns_[conn].first ? conns_[conn].second : conns_[conn].first;
        const int64_t left = Budget();
        if (left == 0) break;
        const size_t want = left < 0 ? buf.size() : std::min<size_t>(buf.size(), left);
        const ssize_t n = read(from, buf.data(), want);
        if (n <= 0) {
          // A real end closed (not the proxy's doing): pass the close on.
          close(conns_[conn].first);
          close(conns_[conn].second);
          conns_[conn] = {-1, -1};
          continue;
        }
        for (ssize_t done = 0; done < n;) {
          const ssize_t w = write(to, buf.data() + done, n - done);
          if (w <= 0 && errno != EINTR) break;
          if (w > 0) done += w;
        }
        absl::MutexLock l(&mu_);
        forwarded_ += n;
      }
      std::vector<std::pair<int, int>> open;
      for (auto& c : conns_) {
        if (c.first >= 0) open.push_back(c);
      }
      conns_ = std::move(open);
    }
  }

  void Accept() {
    const int in = accept(listen_fd_, nullptr, nullptr);
    if (in < 0) return;
    const int out = socket(AF_INET, SOCK_STREAM, 0);
    if (out < 0 || connect(out, reinterpret_cast<const sockaddr*>(&target_), sizeof(target_)) != 0) {
      close(in);
      if (out >= 0) close(out);
      return;
    }
    conns_.emplace_back(in, out);
  }

  const int listen_fd_;
  const sockaddr_in target_;
  std::atomic<bool> stop_{false};
  std::vector<std::pair<int, int>> conns_;  // (accepted, upstream); the loop thread's only
  mutable absl::Mutex mu_;
  int64_t forwarded_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t stall_at_ ABSL_GUARDED_BY(mu_) = -1;
  // Past stall_at_ the connections are closed rather than left silent.
  bool drop_ ABSL_GUARDED_BY(mu_) = false;
  bool dropped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// One rank's view of a shared in-memory rendezvous store. Gloo's full-mesh rendezvous stores,
// under key "<rank>", that rank's pair addresses (one per other rank, in rank order, itself left
// out); of the two ends of a pair, the one with the larger port connects. When the reader
// connects to `silent` (or is `silent` connecting to another rank), the address it reads is
// replaced by a LinkProxy's, chosen so that the same end still connects.
class DroppingStore : public gloo::rendezvous::Store {
 public:
  struct Shared {
    int size = 0;
    int silent = -1;
    gloo::rendezvous::HashStore store;
    absl::Mutex mu;
    std::vector<std::unique_ptr<LinkProxy>> proxies ABSL_GUARDED_BY(mu);
  };

  DroppingStore(Shared* shared, int reader) : shared_(shared), reader_(reader) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    shared_->store.set(key, data);
  }
  void wait(const std::vector<std::string>& keys) override { shared_->store.wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    shared_->store.wait(keys, timeout);
  }

  std::vector<char> get(const std::string& key) override {
    std::vector<char> value = shared_->store.get(key);
    int writer = -1;
    if (!absl::SimpleAtoi(key, &writer) || writer == reader_ ||
        (writer != shared_->silent && reader_ != shared_->silent)) {
      return value;
    }
    // The reader's own address for its pair with `writer`, and the writer's for the reader.
    std::vector<char> mine = shared_->store.get(std::to_string(reader_));
    sockaddr_in* own = Chunk(mine, writer > reader_ ? writer - 1 : writer);
    sockaddr_in* peer = Chunk(value, reader_ > writer ? reader_ - 1 : reader_);
    if (!Connects(*own, *peer)) return value;  // the reader listens: it reads nothing to steer
    *peer = ProxyFor(*peer, *own);
    return value;
  }

  // The proxies made so far (one per link of the silent rank), in creation order.
  std::vector<LinkProxy*> proxies() {
    absl::MutexLock l(&shared_->mu);
    std::vector<LinkProxy*> out;
    for (auto& p : shared_->proxies) out.push_back(p.get());
    return out;
  }

 private:
  // Gloo's rule (tcp::Pair::connect): compare the addresses, then the ports as stored.
  static bool Connects(const sockaddr_in& self, const sockaddr_in& peer) {
    const int rv = std::memcmp(&self.sin_addr, &peer.sin_addr, sizeof(in_addr));
    return rv != 0 ? rv > 0 : self.sin_port - peer.sin_port > 0;
  }

  sockaddr_in* Chunk(std::vector<char>& value, int index) const {
    const size_t n = value.size() / (shared_->size - 1);
    if (n < sizeof(sockaddr_in) || value.size() % (shared_->size - 1) != 0) {
      throw std::runtime_error(absl::StrCat("unexpected Gloo rendezvous value of ", value.size(),
                                            " bytes for ", shared_->size, " ranks"));
    }
    auto* sa = reinterpret_cast<sockaddr_in*>(value.data() + index * n);
    if (sa->sin_family != AF_INET) {
      throw std::runtime_error("Gloo rendezvous address is not IPv4 (bind Gloo to 127.0.0.1)");
    }
    return sa;
  }

  // A proxy to `target` listening on a port that keeps `self` the connecting end.
  sockaddr_in ProxyFor(const sockaddr_in& target, const sockaddr_in& self) {
    std::vector<int> rejected;
    sockaddr_in addr{};
    int fd = -1;
    for (int attempt = 0; attempt < 1000 && fd < 0; ++attempt) {
      const int s = socket(AF_INET, SOCK_STREAM, 0);
      addr = {};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof(addr);
      if (s < 0 || bind(s, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
          getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
        if (s >= 0) close(s);
        continue;
      }
      if (Connects(self, addr) && listen(s, 16) == 0) {
        fd = s;
      } else {
        rejected.push_back(s);  // held until done, so the kernel offers another port
      }
    }
    for (int s : rejected) close(s);
    if (fd < 0) throw std::runtime_error("no proxy port keeps Gloo's connect order");
    absl::MutexLock l(&shared_->mu);
    shared_->proxies.push_back(std::make_unique<LinkProxy>(fd, target));
    return addr;
  }

  Shared* const shared_;
  const int reader_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TESTING_GLOO_LINK_PROXY_H_
