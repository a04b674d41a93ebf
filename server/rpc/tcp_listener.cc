#include "server/rpc/tcp_listener.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/peer_address.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

constexpr absl::Duration kSweepEvery = absl::Seconds(1);
// Before refusing a connection for a full table: the table is swept first, at most this often.
constexpr absl::Duration kSweepBeforeRefusal = absl::Milliseconds(20);
constexpr absl::Duration kRefusalLogEvery = absl::Seconds(10);
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMostBackoff = absl::Milliseconds(500);
// Accepts in one go before the loop looks at its other sockets and the clock again.
constexpr int kAcceptBatch = 256;

std::string ClientAddress(const sockaddr_storage& peer) {
  return PeerAddress(reinterpret_cast<const sockaddr*>(&peer));
}

// The client's address and port, as ClientAddress shows the address.
std::string ClientEndpoint(const sockaddr_storage& peer) {
  int port = 0;
  if (peer.ss_family == AF_INET) {
    port = ntohs(reinterpret_cast<const sockaddr_in*>(&peer)->sin_port);
  } else if (peer.ss_family == AF_INET6) {
    port = ntohs(reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_port);
  }
  return absl::StrCat(ClientAddress(peer), "#", port);
}

uint64_t InodeOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "*";
}

// A socket listening on `addr` (its port set); -1 and `error` set on failure.
int ListenOn(const sockaddr* addr, socklen_t len, bool dual_stack, std::string* error) {
  const int fd = socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = absl::StrCat("socket: ", std::strerror(errno));
    return -1;
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (addr->sa_family == AF_INET6) {
    const int v6only = dual_stack ? 0 : 1;
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
  }
  if (bind(fd, addr, len) != 0 || listen(fd, SOMAXCONN) != 0) {
    *error = std::strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

int PortOf(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  }
  return 0;
}

void SetPort(sockaddr_storage* addr, int port) {
  if (addr->ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(addr)->sin_port = htons(static_cast<uint16_t>(port));
  } else if (addr->ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(addr)->sin6_port = htons(static_cast<uint16_t>(port));
  }
}

// Where the probe dials a listening socket bound to `addr`: the address itself, or 127.0.0.1
// for a wildcard (a dual-stack socket takes IPv4 too, and a machine may lack ::1).
sockaddr_storage DialableAddress(const sockaddr_storage& addr, socklen_t* len) {
  sockaddr_storage out = addr;
  const bool any6 =
      addr.ss_family == AF_INET6 &&
      IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr);
  if (addr.ss_family == AF_INET || any6) {
    sockaddr_storage v4{};
    auto* in = reinterpret_cast<sockaddr_in*>(&v4);
    in->sin_family = AF_INET;
    in->sin_port = htons(static_cast<uint16_t>(PortOf(addr)));
    in->sin_addr = addr.ss_family == AF_INET
                       ? reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr
                       : in_addr{htonl(INADDR_ANY)};
    if (in->sin_addr.s_addr == htonl(INADDR_ANY)) in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    *len = sizeof(sockaddr_in);
    return v4;
  }
  *len = sizeof(sockaddr_in6);
  return out;
}

int OpenDescriptors() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n - 1;  // the directory's own descriptor
}

}  // namespace

absl::StatusOr<int> ConnectionsUnderFileLimit(int requested, int reserved) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  const int open = OpenDescriptors();
  const int64_t soft = limit.rlim_cur == RLIM_INFINITY ? (int64_t{1} << 20)
                                                        : static_cast<int64_t>(limit.rlim_cur);
  const int64_t fit = soft - std::max(open, 0) - reserved;
  constexpr int kLeast = 16;
  if (fit < kLeast || (requested > 0 && requested > fit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the limit on open files is ", soft, " and ", std::max(open, 0), " are open; keeping ",
        reserved, " for the HTTP port's connections and the rest, ", std::max<int64_t>(fit, 0),
        " are left for gRPC connections, ",
        requested > 0 ? absl::StrCat("fewer than --rpc_max_connections=", requested)
                      : absl::StrCat("fewer than ", kLeast),
        ": raise the limit (ulimit -n, LimitNOFILE=) or lower --rpc_max_connections or "
        "--http_max_connections"));
  }
  return requested > 0 ? requested : static_cast<int>(std::min<int64_t>(fit, 1 << 30));
}

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Bind(TcpListenerOptions options) {
  const size_t colon = options.listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address \"", options.listen, "\" must be HOST:PORT with PORT in [0, 65535]"));
  }
  if (options.max_connections < 1 || options.max_connections_per_client < 1 ||
      options.max_connections_per_client > options.max_connections) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the gRPC port's connection bounds are ", options.max_connections, " in all and ",
        options.max_connections_per_client, " per client; each must be at least 1 and the "
        "second at most the first"));
  }
  std::string host = options.listen.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  std::vector<std::pair<sockaddr_storage, socklen_t>> addrs;
  bool dual_stack = false;
  if (IsWildcardHost(host)) {
    // Both families where the machine has IPv6 (one dual-stack socket), IPv4 alone otherwise.
    sockaddr_storage any6{};
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&any6);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_any;
    const int probe = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0) {
      close(probe);
      addrs.push_back({any6, sizeof(sockaddr_in6)});
      dual_stack = true;
    } else {
      sockaddr_storage any4{};
      auto* in = reinterpret_cast<sockaddr_in*>(&any4);
      in->sin_family = AF_INET;
      in->sin_addr.s_addr = htonl(INADDR_ANY);
      addrs.push_back({any4, sizeof(sockaddr_in)});
    }
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, ": ",
                                                 gai_strerror(rc)));
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      sockaddr_storage s{};
      std::memcpy(&s, a->ai_addr, a->ai_addrlen);
      addrs.push_back({s, static_cast<socklen_t>(a->ai_addrlen)});
    }
    freeaddrinfo(found);
  }
  std::unique_ptr<TcpListener> listener(new TcpListener(std::move(options)));
  for (auto& [addr, len] : addrs) {
    // Every address on one port: the first's, when the port was 0.
    SetPort(&addr, listener->port_ != 0 ? listener->port_ : port);
    std::string error;
    const int fd = ListenOn(reinterpret_cast<const sockaddr*>(&addr), len, dual_stack, &error);
    if (fd < 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", listener->options_.listen,
                                                 " (", ClientEndpoint(addr), "): ", error));
    }
    Socket socket;
    socket.fd = fd;
    socket.addr_len = sizeof(socket.addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&socket.addr), &socket.addr_len);
    listener->port_ = PortOf(socket.addr);
    listener->sockets_.push_back(socket);
  }
  listener->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (listener->wake_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return listener;
}

TcpListener::~TcpListener() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void TcpListener::Start() {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  probe_thread_ = std::thread([this] { ProbeLoop(); });
}

void TcpListener::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void TcpListener::Stop() {
  if (stopping_.exchange(true)) return;
  Wake();
  {
    // A probe waiting on its verdict sees stopping_ once the mutex is released.
    absl::MutexLock lock(&probe_mu_);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (probe_thread_.joinable()) probe_thread_.join();
  for (Socket& s : sockets_) {
    if (s.fd >= 0) close(s.fd);
    s.fd = -1;
  }
}

TcpListenerStats TcpListener::Stats() const {
  TcpListenerStats stats;
  stats.open = open_.load();
  stats.max_connections = options_.max_connections;
  stats.accepted = accepted_.load();
  stats.refused_all = refused_all_.load();
  stats.refused_per_client = refused_per_client_.load();
  stats.accept_errors = accept_errors_.load();
  stats.accepting = accepting_.load();
  return stats;
}

void TcpListener::AcceptLoop() {
  absl::Duration backoff = absl::ZeroDuration();
  while (!stopping_.load()) {
    // While backing off after a resource error, only the wake-up is watched (the listening
    // sockets stay readable and would spin the loop).
    std::vector<pollfd> fds;
    fds.push_back({wake_fd_, POLLIN, 0});
    if (backoff == absl::ZeroDuration()) {
      for (const Socket& s : sockets_) fds.push_back({s.fd, POLLIN, 0});
    }
    const int timeout_ms = backoff > absl::ZeroDuration()
                               ? static_cast<int>(absl::ToInt64Milliseconds(backoff))
                               : static_cast<int>(absl::ToInt64Milliseconds(kSweepEvery));
    const int ready = poll(fds.data(), fds.size(), timeout_ms);
    if (stopping_.load()) break;
    if (ready < 0 && errno != EINTR) {
      spdlog::error("gRPC port: poll failed: {}; trying again", std::strerror(errno));
      absl::SleepFor(kMostBackoff);
      continue;
    }
    Sweep(/*force=*/false);
    bool resource_error = false;
    for (Socket& s : sockets_) {
      // After a back-off every socket is tried; otherwise the ready ones.
      bool try_it = backoff > absl::ZeroDuration();
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].fd == s.fd && (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
          try_it = true;
        }
      }
      if (!try_it) continue;
      Drained drained = Drained::kMore;
      while (drained == Drained::kMore && !stopping_.load()) drained = AcceptFrom(s);
      if (drained == Drained::kResourceError) resource_error = true;
      if (drained == Drained::kBroken && !Relisten(s)) resource_error = true;
    }
    backoff = resource_error ? std::min(kMostBackoff, std::max(kFirstBackoff, backoff * 2))
                             : absl::ZeroDuration();
  }
}

TcpListener::Drained TcpListener::AcceptFrom(Socket& listener) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    sockaddr_storage peer{};
    socklen_t peer_len = sizeof(peer);
    const int fd = accept4(listener.fd, reinterpret_cast<sockaddr*>(&peer), &peer_len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Admit(fd, listener.fd, peer, peer_len);
      continue;
    }
    switch (errno) {
      case EAGAIN:
#if EWOULDBLOCK != EAGAIN
      case EWOULDBLOCK:
#endif
        return Drained::kEmpty;
      // The connection's own trouble (Linux reports a pending network error here): the next.
      case EINTR:
      case ECONNABORTED:
      case EPROTO:
      case EPERM:
      case ENETDOWN:
      case ENOPROTOOPT:
      case EHOSTDOWN:
      case ENONET:
      case EHOSTUNREACH:
      case EOPNOTSUPP:
      case ENETUNREACH:
        continue;
      case EMFILE:
      case ENFILE:
      case ENOBUFS:
      case ENOMEM: {
        const int64_t errors = accept_errors_.fetch_add(1) + 1;
        // The first of a burst, then one in a thousand: the log stays readable.
        if (errors == 1 || errors % 1000 == 0) {
          spdlog::error("gRPC port: accept failed: {} ({} times since the start); {} "
                        "connections open; backing off and accepting again",
                        std::strerror(errno), errors, open_.load());
        }
        Sweep(/*force=*/true);
        return Drained::kResourceError;
      }
      default:
        spdlog::error("gRPC port: accept on {} failed: {}; listening anew",
                      ClientEndpoint(listener.addr), std::strerror(errno));
        return Drained::kBroken;
    }
  }
  return Drained::kMore;
}

void TcpListener::Admit(int fd, int listener_fd, const sockaddr_storage& peer,
                        socklen_t peer_len) {
  (void)peer_len;
  const std::string endpoint = ClientEndpoint(peer);
  {
    absl::MutexLock lock(&probe_mu_);
    if (!probe_peer_.empty() && endpoint == probe_peer_) {
      // The self-probe: it tells whether a new client would be taken now. Not handed on.
      if (open_.load() >= options_.max_connections) Sweep(/*force=*/false);
      probe_verdict_ = open_.load() < options_.max_connections ? 1 : -1;
      close(fd);
      return;
    }
  }
  std::string client = ClientAddress(peer);
  const bool all_full = open_.load() >= options_.max_connections;
  const auto it = per_client_.find(client);
  const bool client_full =
      it != per_client_.end() && it->second >= options_.max_connections_per_client;
  if (all_full || client_full) {
    Sweep(/*force=*/false);
    const bool still_all = open_.load() >= options_.max_connections;
    const auto again = per_client_.find(client);
    const bool still_client =
        again != per_client_.end() && again->second >= options_.max_connections_per_client;
    if (still_all || still_client) {
      close(fd);
      (still_all ? refused_all_ : refused_per_client_).fetch_add(1);
      ++refused_since_log_;
      const absl::Time now = absl::Now();
      if (now - last_refusal_log_ >= kRefusalLogEvery) {
        spdlog::warn("gRPC port: refused {} connection(s) {} (latest from {}: {}); bounds "
                     "--rpc_max_connections={}, --rpc_max_connections_per_client={}",
                     refused_since_log_,
                     last_refusal_log_ == absl::InfinitePast()
                         ? std::string("since the start")
                         : absl::StrCat("in the last ",
                                        absl::ToInt64Seconds(now - last_refusal_log_), " s"),
                     client, still_all ? "every slot taken" : "its address has its most open",
                     options_.max_connections, options_.max_connections_per_client);
        last_refusal_log_ = now;
        refused_since_log_ = 0;
      }
      return;
    }
  }
  // A descriptor number still in the table belongs to a connection since closed.
  Untrack(fd);
  tracked_[fd] = Tracked{InodeOf(fd), client};
  ++per_client_[client];
  open_.fetch_add(1);
  accepted_.fetch_add(1);
  options_.on_connection(fd, listener_fd);
}

void TcpListener::Untrack(int fd) {
  auto it = tracked_.find(fd);
  if (it == tracked_.end()) return;
  auto client = per_client_.find(it->second.client);
  if (client != per_client_.end() && --client->second <= 0) per_client_.erase(client);
  tracked_.erase(it);
  open_.fetch_sub(1);
}

void TcpListener::Sweep(bool force) {
  const absl::Time now = absl::Now();
  if (!force && now - last_sweep_ < kSweepBeforeRefusal) return;
  last_sweep_ = now;
  std::vector<int> closed;
  for (const auto& [fd, tracked] : tracked_) {
    // Closed (EBADF), or the number now names another socket or file.
    if (InodeOf(fd) != tracked.inode) closed.push_back(fd);
  }
  for (int fd : closed) Untrack(fd);
}

bool TcpListener::Relisten(Socket& listener) {
  close(listener.fd);
  listener.fd = -1;
  const bool dual_stack = listener.addr.ss_family == AF_INET6;
  std::string error;
  const int fd = ListenOn(reinterpret_cast<const sockaddr*>(&listener.addr), listener.addr_len,
                          dual_stack, &error);
  if (fd < 0) {
    spdlog::error("gRPC port: listening anew on {} failed: {}; trying again",
                  ClientEndpoint(listener.addr), error);
    // Poll skips a negative descriptor; the next back-off round tries again.
    return false;
  }
  listener.fd = fd;
  spdlog::warn("gRPC port: listening anew on {}", ClientEndpoint(listener.addr));
  return true;
}

void TcpListener::ProbeLoop() {
  while (!stopping_.load()) {
    pollfd wake{wake_fd_, POLLIN, 0};
    poll(&wake, 1, static_cast<int>(absl::ToInt64Milliseconds(options_.probe_interval)));
    if (stopping_.load()) break;
    const bool accepting = ProbeOnce();
    if (accepting != accepting_.exchange(accepting)) {
      if (accepting) {
        spdlog::info("gRPC port: a new connection is accepted again");
      } else {
        spdlog::error("gRPC port: a new connection to it was not accepted within {} ms ({} "
                      "open, at most {}); reporting NOT_SERVING until one is",
                      absl::ToInt64Milliseconds(options_.probe_timeout), open_.load(),
                      options_.max_connections);
      }
      if (options_.on_accepting_changed) options_.on_accepting_changed(accepting);
    }
  }
}

bool TcpListener::ProbeOnce() {
  // The first socket's address (the others share its port and loop). Only its address, which
  // never changes, is read here: its descriptor is the accept loop's.
  if (sockets_.empty()) return false;
  socklen_t len = 0;
  sockaddr_storage dial = DialableAddress(sockets_.front().addr, &len);
  // Out of descriptors here too: no new client would be taken either.
  const int fd = socket(dial.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  // Bound first, so that the accept loop knows the probe by its address and port.
  sockaddr_storage local = dial;
  SetPort(&local, 0);
  socklen_t local_len = len;
  if (bind(fd, reinterpret_cast<sockaddr*>(&local), len) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0) {
    close(fd);
    return false;
  }
  {
    absl::MutexLock lock(&probe_mu_);
    probe_peer_ = ClientEndpoint(local);
    probe_verdict_ = 0;
  }
  bool accepted = false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&dial), len) == 0 || errno == EINPROGRESS) {
    absl::MutexLock lock(&probe_mu_);
    auto decided = [this]() ABSL_SHARED_LOCKS_REQUIRED(probe_mu_) {
      return probe_verdict_ != 0 || stopping_.load();
    };
    probe_mu_.AwaitWithTimeout(absl::Condition(&decided), options_.probe_timeout);
    accepted = probe_verdict_ == 1 || stopping_.load();
  }
  {
    absl::MutexLock lock(&probe_mu_);
    probe_peer_.clear();
  }
  close(fd);
  return accepted;
}

}  // namespace modelavg::server
