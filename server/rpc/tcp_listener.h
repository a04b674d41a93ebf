// The gRPC port's listening sockets and accept loop, owned here rather than by gRPC.
//
// gRPC 1.51's own listener (iomgr's tcp_server_posix) stops accepting for good on any accept4
// error but EAGAIN and ECONNABORTED: a process that once reached its limit on open files
// (EMFILE, which about 20,000 bare connections cause) never accepted another connection, even
// after every one had closed. This loop never gives up: on a resource error it backs off and
// tries again, and a listening socket that breaks is bound anew on the same port. It bounds the
// connections open at once, in all and per client address, below the open-file limit, so that
// it rarely meets the error at all; and it probes itself, opening a new connection to its own
// address, so that a port that cannot take a new client is seen (health, metrics) while
// connections made earlier still answer.
//
// Each admitted connection is handed to `on_connection`, which owns it from then on (the
// coordinator hands it to gRPC with the port's credentials, TLS or plaintext). The listener
// learns that a connection has closed by finding its descriptor closed or holding another
// socket (checked by inode) when it sweeps: once a second, and before refusing one.
#ifndef MODELAVG_SERVER_RPC_TCP_LISTENER_H_
#define MODELAVG_SERVER_RPC_TCP_LISTENER_H_

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace modelavg::server {

struct TcpListenerOptions {
  // "HOST:PORT" (port 0: any free port). A wildcard host (0.0.0.0, ::, [::], empty) listens on
  // every address, IPv6 and IPv4 where the machine has both.
  std::string listen;
  // Connections open at once, in all and from one client address; past either a new
  // connection is closed as soon as it is accepted.
  int max_connections = 1;
  int max_connections_per_client = 1;
  // How often the listener opens a connection to itself, and how long it waits for its own
  // accept loop to take it.
  absl::Duration probe_interval = absl::Seconds(5);
  absl::Duration probe_timeout = absl::Seconds(2);
  // Takes an admitted connection (non-blocking, close-on-exec) and owns it; called on the
  // accept loop's thread. `listener_fd` is the listening socket it came from.
  std::function<void(int fd, int listener_fd)> on_connection;
  // Called on the probe's thread when the probe's verdict changes: false when a new connection
  // to the port was not accepted in time (or refused: every slot taken), true again once one is.
  std::function<void(bool accepting)> on_accepting_changed;
};

struct TcpListenerStats {
  int64_t open = 0;                 // connections handed on and not yet seen closed
  int64_t max_connections = 0;      // the bound on `open`
  int64_t accepted = 0;             // connections handed on since the start
  int64_t refused_all = 0;          // closed at once: max_connections open
  int64_t refused_per_client = 0;   // closed at once: max_connections_per_client from its address
  int64_t accept_errors = 0;        // accept failed for want of a resource (EMFILE, ENFILE, ...)
  bool accepting = true;            // the last probe's verdict
};

class TcpListener {
 public:
  // Binds and listens (nothing is accepted before Start). INVALID_ARGUMENT for a bad address or
  // bounds, UNAVAILABLE if it cannot be bound (naming the address and the error).
  static absl::StatusOr<std::unique_ptr<TcpListener>> Bind(TcpListenerOptions options);
  ~TcpListener();  // Stop()

  // The bound port.
  int port() const { return port_; }
  // Starts the accept loop and the probe.
  void Start();
  // Stops both and closes the listening sockets (connections handed on are not touched).
  // Idempotent.
  void Stop();
  TcpListenerStats Stats() const;

 private:
  struct Socket {
    int fd = -1;
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
  };
  struct Tracked {
    uint64_t inode = 0;
    std::string client;
  };
  enum class Drained { kEmpty, kMore, kResourceError, kBroken };

  explicit TcpListener(TcpListenerOptions options) : options_(std::move(options)) {}
  void AcceptLoop();
  Drained AcceptFrom(Socket& listener);
  void Admit(int fd, int listener_fd, const sockaddr_storage& peer, socklen_t peer_len);
  void Sweep(bool force);
  void Untrack(int fd);
  bool Relisten(Socket& listener);
  void ProbeLoop();
  bool ProbeOnce();
  void Wake();

  const TcpListenerOptions options_;
  std::vector<Socket> sockets_;
  int port_ = 0;
  int wake_fd_ = -1;  // an eventfd: Stop wakes the loop and the probe with it
  std::thread accept_thread_;
  std::thread probe_thread_;
  std::atomic<bool> stopping_{false};

  // The accept loop's own (no lock).
  absl::flat_hash_map<int, Tracked> tracked_;
  absl::flat_hash_map<std::string, int> per_client_;
  absl::Time last_sweep_ = absl::InfinitePast();
  absl::Time last_refusal_log_ = absl::InfinitePast();
  int64_t refused_since_log_ = 0;

  std::atomic<int64_t> open_{0}, accepted_{0}, refused_all_{0}, refused_per_client_{0},
      accept_errors_{0};
  std::atomic<bool> accepting_{true};

  // The probe's connection, as the accept loop sees its peer, while one is under way.
  mutable absl::Mutex probe_mu_;
  std::string probe_peer_ ABSL_GUARDED_BY(probe_mu_);
  int probe_verdict_ ABSL_GUARDED_BY(probe_mu_) = 0;  // 0: none yet, 1: accepted, -1: refused
};

// The connections the gRPC port may hold under this process's limit on open files (its soft
// limit), keeping `reserved` descriptors and those already open for everything else (the HTTP
// port's connections, the state store, etcd, logs). With `requested` > 0, that many if they fit
// (INVALID_ARGUMENT saying what to raise or lower if not); 0: as many as fit. At least 16 must
// fit.
absl::StatusOr<int> ConnectionsUnderFileLimit(int requested, int reserved);

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_RPC_TCP_LISTENER_H_
