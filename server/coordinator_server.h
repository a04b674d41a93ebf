// The coordinator as an in-process server: the core (JobRegistry), the gRPC adapter, health,
// reflection, TLS, token auth and metrics, started and stopped as one object. The daemon's main
// and the tests and benchmarks all run it this way.
#ifndef MODELAVG_SERVER_COORDINATOR_SERVER_H_
#define MODELAVG_SERVER_COORDINATOR_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/job/job.h"
#include "server/rpc/service_auth.h"

namespace grpc {
class ResourceQuota;
class Server;
namespace experimental {
class ExternalConnectionAcceptor;
}  // namespace experimental
}  // namespace grpc

namespace modelavg::server {

class CoordinatorService;
class HttpServer;
class JobRegistry;
class LeaderTerms;
class RpcMetrics;
class StateStore;
class TcpListener;

struct ServerOptions {
  // "HOST:PORT"; port 0 picks a free port (see CoordinatorServer::address()).
  std::string listen = "127.0.0.1:0";
  JobDefaults defaults;
  // PEM files. Both set: TLS. With tls_client_ca_file also set: mutual TLS (clients must present
  // a certificate signed by that CA).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Non-empty: every Coordinator RPC needs "authorization: Bearer <auth_token>" (the operator
  // token) or, for the calls of a worker, the worker token. See AuthOptions.
  std::string auth_token;
  // Non-empty (needs auth_token): a worker role's token that may use every job.
  std::string worker_token;
  // More worker tokens (needs auth_token), each limited to the jobs it lists (none: every job);
  // --worker_token_file.
  std::vector<WorkerToken> worker_tokens;
  // Mutual TLS: client certificates whose subject common name or a subject alternative name is
  // listed here have the operator role; other verified client certificates the worker role.
  // Empty: every verified client certificate is an operator.
  std::vector<std::string> operator_cert_names;
  // "HOST:PORT" of the HTTP port: Prometheus' /metrics and the status page (/, /jobs/ID;
  // server/http/status_page.h); empty: neither.
  std::string metrics_listen;
  // The largest request message the gRPC port reads (gRPC's receive limit); each method takes
  // at most the smaller of this and its own bound (server/rpc/coordinator_service.h).
  size_t max_request_bytes = size_t{1} << 20;  // kDefaultMaxRequestBytes
  // gRPC's memory quota (its transport buffers and calls), bytes; 0: none. Near it gRPC reads
  // less per connection, and past it closes connections (GOAWAY) to stay under.
  int64_t rpc_memory_quota_bytes = int64_t{1} << 30;
  // The gRPC port's connections open at once, in all (0: as many as the limit on open files
  // leaves after the HTTP port's and a reserve; more than that is refused at start) and from
  // one client address (server/rpc/tcp_listener.h). Past either, a new connection is closed.
  int rpc_max_connections = 0;
  int rpc_max_connections_per_client = 512;
  // The most bytes of GetSchedule answers one client address may have in flight at once
  // (server/rpc/coordinator_service.h); at least 4 MiB.
  int64_t rpc_schedule_bytes_per_client = int64_t{64} << 20;
  // How often the gRPC port opens a connection to itself to check that a new client is taken
  // (health and metrics report NOT_SERVING / 0 while one is not).
  absl::Duration rpc_accept_probe_interval = absl::Seconds(5);
  // A connection to the gRPC port that has not finished its handshake (TLS, HTTP/2) in this long
  // is closed.
  absl::Duration rpc_handshake_timeout = absl::Seconds(10);
  // The HTTP port's bounds (server/http/http_server.h): connections at once, from one client
  // address, and the time a client has to send a whole request.
  int http_max_connections = 1024;
  int http_max_connections_per_client = 32;
  absl::Duration http_request_timeout = absl::Seconds(10);
  // /metrics: how long one exposition serves every scrape (0: made for each), and whether it
  // needs the operator token (auth_token) as "Authorization: Bearer".
  absl::Duration metrics_cache = absl::Seconds(1);
  bool metrics_need_token = false;
  // Serve the HTTP port over TLS with tls_cert_file/tls_key_file (login cookies are then Secure).
  bool http_tls = false;
  // How long a status page login (its session cookie) lasts.
  absl::Duration http_session_ttl = absl::Hours(12);
  // Jobs created before serving (e.g. from --jobs_file), merged with the stored ones
  // (JobRegistry::MergeJobs).
  std::vector<v1::JobSpec> jobs;
  // Non-empty: keep the jobs' hard state in SQLite under this directory (locked against a
  // second coordinator) and continue the stored jobs on start. Empty: in memory only.
  std::string state_dir;
  // With state_dir: refuse to start when the directory or its state file is missing (the
  // volume was not mounted, or was lost) instead of starting with no jobs.
  bool require_state = false;
  // After a restart, how long the members of a running job have to re-attach (their next
  // heartbeat) before one is declared dead; at least the job's heartbeat timeout.
  absl::Duration recovery_grace = absl::Seconds(10);
  // Non-empty ("host:port[,host:port...]"): keep the hard state in etcd under etcd_prefix and
  // serve only while elected leader among the coordinators on the same endpoints and prefix
  // (server/leader_terms.h); a standby answers UNAVAILABLE naming the leader. Excludes
  // state_dir.
  std::string etcd_endpoints;
  std::string etcd_prefix = "/modelavg/";
  absl::Duration leader_ttl = absl::Seconds(5);
  // The address standbys name (as clients dial it); empty: the bound address.
  std::string advertise;
  std::string etcd_tls_ca_file, etcd_tls_cert_file, etcd_tls_key_file;
  std::string etcd_user, etcd_password;
  // With etcd_endpoints: called once, on another thread, when etcd refuses this coordinator's
  // options for good before it ever campaigned (authentication, TLS: the status says what to
  // fix); it never serves then. Unset: only logged.
  std::function<void(const absl::Status& status)> on_fatal;
  Clock* clock = Clock::Real();
};

class CoordinatorServer {
 public:
  // Builds and starts the server. INVALID_ARGUMENT for bad options or an invalid job (naming it),
  // NOT_FOUND for unreadable TLS files, UNAVAILABLE if the address cannot be bound; with
  // state_dir: FAILED_PRECONDITION (another coordinator holds it; a stored job differs from
  // `jobs`), DATA_LOSS (a damaged state file, named).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const ServerOptions& options);
  ~CoordinatorServer();  // Shutdown()

  // The bound address, "HOST:PORT" (a wildcard host is shown as 127.0.0.1).
  std::string address() const { return address_; }
  int port() const { return port_; }
  // The metrics address actually bound, empty without metrics.
  std::string metrics_address() const;

  // Fails every pending wait with UNAVAILABLE, ends the streams, stops serving. Idempotent.
  void Shutdown();

  JobRegistry* registry() { return registry_.get(); }

 private:
  CoordinatorServer() = default;
  // The health service says SERVING while both hold: the leader's term (always, without etcd)
  // and the gRPC port's self-probe (a new connection is taken).
  enum class HealthPart { kLeading, kAccepting };
  void SetServing(HealthPart part, bool value);

  // Declared before the registry, which writes to it: destroyed after it.
  std::unique_ptr<StateStore> store_;
  // With etcd: the store and the leader's terms (stopped first in Shutdown).
  std::unique_ptr<LeaderTerms> terms_;
  std::unique_ptr<JobRegistry> registry_;
  std::unique_ptr<RpcMetrics> metrics_;
  // The HTTP port; reads registry_ and metrics_, so destroyed before them.
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::ResourceQuota> quota_;  // outlives the server
  std::unique_ptr<grpc::Server> server_;
  // Hands the connections the listener admits to server_ (with the port's credentials).
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::unique_ptr<TcpListener> listener_;
  std::string address_;
  int port_ = 0;
  int worker_tokens_ = 0;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  absl::Mutex health_mu_;
  bool leading_ ABSL_GUARDED_BY(health_mu_) = true;
  bool accepting_ ABSL_GUARDED_BY(health_mu_) = true;
  bool health_frozen_ ABSL_GUARDED_BY(health_mu_) = false;  // shutting down: NOT_SERVING
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_COORDINATOR_SERVER_H_
