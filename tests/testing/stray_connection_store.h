// A stray connection at a Gloo mesh's set-up, made from outside the library: one member's view of
// the rendezvous store that, before handing the member the address of a peer it connects to,
// connects a socket of its own to that address first and keeps it open — as a port scanner, a
// health check or a misdirected client would while the port is open. The peer's transport then
// takes the stray for the member's connection.
#ifndef MODELAVG_TESTS_TESTING_STRAY_CONNECTION_STORE_H_
#define MODELAVG_TESTS_TESTING_STRAY_CONNECTION_STORE_H_

#include <netinet/in.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gloo/rendezvous/store.h"

namespace modelavg::testing {

// What a stray does once connected.
enum class StrayKind {
  kSilent,  // holds the connection and sends nothing
  kJunk,    // writes 256 random bytes
  kEcho,    // sends back every byte it receives: the member's own handshake, replayed to it
};

// Stray sockets, held open until this goes; every byte each one receives is kept (a thread reads
// them). Thread-safe.
class StrayConnections {
 public:
  StrayConnections();
  StrayConnections(const StrayConnections&) = delete;
  StrayConnections& operator=(const StrayConnections&) = delete;
  ~StrayConnections();

  // Connects a socket to `peer` and holds it open, doing what `kind` says. Whether it connected.
  bool ConnectTo(const sockaddr_in& peer, StrayKind kind);
  bool ConnectTo(const sockaddr_in& peer, bool junk) {
    return ConnectTo(peer, junk ? StrayKind::kJunk : StrayKind::kSilent);
  }
  // How many are open.
  size_t count() const;
  // Every byte the strays received so far, in order per stray.
  std::string received() const;

 private:
  void Serve();

  mutable absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<StrayKind> kinds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> received_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> done_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Member `rank` of `size`'s view of `store` (Gloo's full-mesh rendezvous: key "<rank>" holds
// that member's pair addresses, one per other member in member order, itself left out). The
// first time the member reads the address of a peer it connects to (Gloo's rule: of the two
// ends of a pair, the greater address connects), a socket of `strays` connects to that address
// first, and the peer's transport is given 200 ms to take it. Once per store. IPv4 only (bind
// Gloo to 127.0.0.1).
class StrayConnectionStore : public gloo::rendezvous::Store {
 public:
  StrayConnectionStore(gloo::rendezvous::Store* store, int rank, int size,
                       StrayConnections* strays, StrayKind kind = StrayKind::kSilent)
      : store_(store), rank_(rank), size_(size), strays_(strays), kind_(kind) {}
  StrayConnectionStore(gloo::rendezvous::Store* store, int rank, int size,
                       StrayConnections* strays, bool junk)
      : StrayConnectionStore(store, rank, size, strays,
                             junk ? StrayKind::kJunk : StrayKind::kSilent) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, data);
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }
  std::vector<char> get(const std::string& key) override;

 private:
  gloo::rendezvous::Store* const store_;
  const int rank_;
  const int size_;
  StrayConnections* const strays_;
  const StrayKind kind_;
  bool strayed_ = false;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TESTING_STRAY_CONNECTION_STORE_H_
