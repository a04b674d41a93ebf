#include "server/coordinator_server.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "openssl/crypto.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/core/job_registry.h"
#include "server/http/http_server.h"
#include "server/http/status_page.h"
#include "server/jobs_file.h"
#include "server/leader_terms.h"
#include "server/membership/decisions.h"
#include "server/rpc/coordinator_service.h"
#include "server/rpc/rpc_metrics.h"
#include "server/rpc/tcp_listener.h"
#include "server/store/sqlite/sqlite_state_store.h"
#include "server/store/state_store.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

// The PEM certificate chain and private key of --tls_cert and --tls_key.
absl::StatusOr<std::pair<std::string, std::string>> ReadCertAndKey(const ServerOptions& options) {
  absl::StatusOr<std::string> cert = ReadFileToString(options.tls_cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFileToString(options.tls_key_file);
  if (!key.ok()) return key.status();
  return std::make_pair(*std::move(cert), *std::move(key));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const ServerOptions& options) {
  const bool tls = !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (!tls) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS plus client certs)");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  absl::StatusOr<std::pair<std::string, std::string>> cert_and_key = ReadCertAndKey(options);
  if (!cert_and_key.ok()) return cert_and_key.status();
  pair.cert_chain = std::move(cert_and_key->first);
  pair.private_key = std::move(cert_and_key->second);
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFileToString(options.tls_client_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// Whether an Authorization header's value is "Bearer <token>" (compared in constant time).
bool BearerMatches(const std::string& header, const std::string& token) {
  constexpr absl::string_view kBearer = "Bearer ";
  if (header.size() != kBearer.size() + token.size() || !absl::StartsWith(header, kBearer)) {
    return false;
  }
  return CRYPTO_memcmp(header.data() + kBearer.size(), token.data(), token.size()) == 0;
}

// "HOST:PORT" with the bound port; a wildcard host becomes 127.0.0.1 so the address is dialable.
std::string BoundAddress(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "*") {
    host = "127.0.0.1";
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const ServerOptions& options) {
  const size_t colon = options.listen.rfind(':');
  int requested_port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(options.listen.substr(colon + 1), &requested_port) ||
      requested_port < 0 || requested_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen address \"", options.listen, "\" must be HOST:PORT with PORT in [0, 65535]"));
  }
  std::vector<WorkerToken> worker_tokens = options.worker_tokens;
  if (!options.worker_token.empty()) worker_tokens.push_back({options.worker_token, {}});
  if (!worker_tokens.empty() && options.auth_token.empty()) {
    return absl::InvalidArgumentError(
        "a worker token needs an operator token too (--worker_token_file with "
        "--auth_token_file): someone must be able to create jobs");
  }
  for (const WorkerToken& w : worker_tokens) {
    if (w.token.empty()) return absl::InvalidArgumentError("a worker token is empty");
    if (w.token == options.auth_token) {
      return absl::InvalidArgumentError(
          "the worker token and the operator token are the same; give each role its own");
    }
    if (absl::Status s = ValidateJobPatterns(w.jobs); !s.ok()) return s;
  }
  if (options.max_request_bytes < 4096 || options.max_request_bytes > (size_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_request_bytes is ", options.max_request_bytes, "; it must be in [4096, 2^30]"));
  }
  if (options.rpc_memory_quota_bytes < 0 ||
      (options.rpc_memory_quota_bytes > 0 && options.rpc_memory_quota_bytes < (16 << 20))) {
    return absl::InvalidArgumentError(
        absl::StrCat("the gRPC memory quota is ", options.rpc_memory_quota_bytes,
                     " bytes; give at least 16 MiB (or 0 for none)"));
  }
  if (options.metrics_need_token && options.auth_token.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_need_token needs --auth_token_file (the token /metrics then asks for)");
  }
  if (options.http_tls && (options.tls_cert_file.empty() || options.tls_key_file.empty())) {
    return absl::InvalidArgumentError("--metrics_tls needs --tls_cert and --tls_key");
  }
  if (!options.operator_cert_names.empty() && options.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_operator_names needs mutual TLS (--tls_client_ca with --tls_cert, --tls_key)");
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeCredentials(options);
  if (!creds.ok()) return creds.status();

  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  if (options.require_state && options.state_dir.empty()) {
    return absl::InvalidArgumentError("--require_state needs --state_dir");
  }
  StateStore* store = nullptr;
  if (!options.etcd_endpoints.empty()) {
    if (!options.state_dir.empty()) {
      return absl::InvalidArgumentError(
          "--etcd_endpoints and --state_dir exclude each other: the state is in etcd");
    }
    LeaderTermsOptions terms;
    terms.endpoints = options.etcd_endpoints;
    terms.prefix = options.etcd_prefix;
    terms.leader_ttl = options.leader_ttl;
    terms.tls_ca_file = options.etcd_tls_ca_file;
    terms.tls_cert_file = options.etcd_tls_cert_file;
    terms.tls_key_file = options.etcd_tls_key_file;
    terms.user = options.etcd_user;
    terms.password = options.etcd_password;
    absl::StatusOr<std::unique_ptr<LeaderTerms>> made = LeaderTerms::Create(terms);
    if (!made.ok()) return made.status();
    server->terms_ = *std::move(made);
    store = server->terms_->store();
  } else if (options.state_dir.empty()) {
    server->store_ = std::make_unique<InMemoryStateStore>();
  } else {
    absl::StatusOr<std::unique_ptr<SqliteStateStore>> store =
        SqliteStateStore::Open(options.state_dir, options.require_state);
    if (!store.ok()) return store.status();
    server->store_ = *std::move(store);
  }
  if (store == nullptr) store = server->store_.get();
  JobRegistryOptions registry_options;
  registry_options.defaults = options.defaults;
  registry_options.clock = options.clock;
  registry_options.store = store;
  server->registry_ = std::make_unique<JobRegistry>(registry_options);
  spdlog::info("coordinator incarnation {}; state: {}", server->registry_->incarnation(),
               store->Describe());
  // With etcd the jobs are loaded at each election won, not here.
  absl::StatusOr<int> loaded = 0;
  if (server->terms_ == nullptr) {
    loaded = server->registry_->LoadFromStore(options.recovery_grace);
    if (!loaded.ok()) return loaded.status();
    if (absl::Status s = server->registry_->MergeJobs(options.jobs); !s.ok()) return s;
  }
  if (!options.metrics_listen.empty()) {
    server->metrics_ = RpcMetrics::Create(server->registry_.get());
    StatusPageOptions page_options;
    page_options.operator_token = options.auth_token;
    page_options.session_ttl = options.http_session_ttl;
    page_options.secure_cookie = options.http_tls;
    auto page = std::make_shared<StatusPage>(server->registry_.get(), page_options);
    HttpServerOptions http_options;
    http_options.max_connections = options.http_max_connections;
    http_options.max_connections_per_client = options.http_max_connections_per_client;
    http_options.request_timeout = options.http_request_timeout;
    if (options.http_tls) {
      absl::StatusOr<std::pair<std::string, std::string>> cert_and_key = ReadCertAndKey(options);
      if (!cert_and_key.ok()) return cert_and_key.status();
      http_options.tls_cert_pem = std::move(cert_and_key->first);
      http_options.tls_key_pem = std::move(cert_and_key->second);
    }
    absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
        options.metrics_listen,
        [metrics = server->metrics_.get(), page, cache = options.metrics_cache,
         token = options.metrics_need_token ? options.auth_token : std::string()](
            const HttpRequest& request) {
          if (request.path == "/metrics") {
            HttpResponse reply;
            if (!token.empty() && !BearerMatches(request.Header("authorization"), token)) {
              reply.status = 401;
              reply.headers.push_back({"WWW-Authenticate", "Bearer"});
              reply.body = "/metrics needs \"Authorization: Bearer <operator token>\" "
                           "(--metrics_need_token); Prometheus: authorization.credentials_file\n";
              return reply;
            }
            reply.content_type = "text/plain; version=0.0.4; charset=utf-8";
            reply.body = metrics->CachedTextExposition(cache);
            return reply;
          }
          return page->Handle(request);
        },
        std::move(http_options));
    if (!http.ok()) return http.status();
    server->http_ = *std::move(http);
  }
  AuthOptions auth;
  auth.operator_token = options.auth_token;
  server->worker_tokens_ = static_cast<int>(worker_tokens.size());
  auth.worker_tokens = std::move(worker_tokens);
  auth.client_certificates = !options.tls_client_ca_file.empty();
  auth.operator_cert_names = options.operator_cert_names;
  server->service_ = std::make_unique<CoordinatorService>(
      server->registry_.get(), std::move(auth), server->metrics_.get(),
      options.max_request_bytes);
  if (options.rpc_schedule_bytes_per_client < kMaxScheduleReplyBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rpc_schedule_bytes_per_client is ", options.rpc_schedule_bytes_per_client,
        "; it must be at least ", kMaxScheduleReplyBytes,
        " (the largest GetSchedule answer) so that one answer always fits"));
  }
  server->service_->set_schedule_bytes_per_client(options.rpc_schedule_bytes_per_client);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // channelz bookkeeping costs on every call and nothing here reads it.
  builder.AddChannelArgument(GRPC_ARG_ENABLE_CHANNELZ, 0);
  // Bounds on what a client costs before it is known: gRPC reads no message larger than the
  // largest legitimate request (each method checks its own bound as well), holds a connection
  // that has not finished its handshake for a bounded time, and keeps its memory within the
  // quota. (Calls from a client without a valid credential are refused before their request is
  // read: CoordinatorService.)
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_request_bytes));
  // Bandwidth-delay probing grows the window a client may send into ahead of any read to many
  // megabytes per stream, which lets even a refused call push that much at the coordinator;
  // every request here is small, so the fixed 64 KiB window costs nothing.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.rpc_handshake_timeout)));
  if (options.rpc_memory_quota_bytes > 0) {
    server->quota_ = std::make_unique<grpc::ResourceQuota>("modelavg-coordinator");
    server->quota_->Resize(static_cast<size_t>(options.rpc_memory_quota_bytes));
    builder.SetResourceQuota(*server->quota_);
  }
  // The port's listening socket and accept loop are the listener's, not gRPC's: gRPC 1.51's own
  // listener stops for good at the first EMFILE (server/rpc/tcp_listener.h). Each connection
  // the listener admits goes to gRPC here, with the port's credentials (TLS or plaintext).
  // Descriptors kept back from it: the HTTP port's connections, and a reserve for the stores,
  // etcd, logs and gRPC's own.
  constexpr int kReservedDescriptors = 64;
  absl::StatusOr<int> max_connections = ConnectionsUnderFileLimit(
      options.rpc_max_connections,
      kReservedDescriptors + (options.metrics_listen.empty() ? 0 : options.http_max_connections));
  if (!max_connections.ok()) return max_connections.status();
  if (options.rpc_max_connections_per_client < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rpc_max_connections_per_client is ",
                     options.rpc_max_connections_per_client, "; it must be at least 1"));
  }
  server->acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, *creds);
  TcpListenerOptions listen;
  listen.listen = options.listen;
  listen.max_connections = *max_connections;
  listen.max_connections_per_client =
      std::min(options.rpc_max_connections_per_client, *max_connections);
  listen.probe_interval = options.rpc_accept_probe_interval;
  listen.on_connection = [acceptor = server->acceptor_.get()](int fd, int listener_fd) {
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = listener_fd;
    p.fd = fd;
    acceptor->HandleNewConnection(&p);
  };
  listen.on_accepting_changed = [s = server.get()](bool accepting) {
    s->SetServing(HealthPart::kAccepting, accepting);
  };
  absl::StatusOr<std::unique_ptr<TcpListener>> listener = TcpListener::Bind(std::move(listen));
  if (!listener.ok()) return listener.status();
  server->listener_ = *std::move(listener);
  server->port_ = server->listener_->port();
  if (server->metrics_ != nullptr) server->metrics_->set_listener(server->listener_.get());
  if (server->terms_ != nullptr) {
    server->service_->set_gate([terms = server->terms_.get()](grpc::CallbackServerContext* ctx) {
      std::string leader;
      absl::Status s = terms->CheckServing(&leader);
      // Clients fail over to the address in this trailer (client/rpc/coordinator_client.h).
      if (!s.ok() && ctx != nullptr && !leader.empty()) {
        ctx->AddTrailingMetadata("modelavg-leader", leader);
      }
      return s;
    });
  }
  builder.RegisterService(server->service_.get());
  // Every method but the heartbeat streams (see CoordinatorService).
  builder.RegisterCallbackGenericService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot start the gRPC server on ",
                                               options.listen));
  }
  server->listener_->Start();
  server->address_ = BoundAddress(options.listen, server->port_);
  if (server->terms_ != nullptr) {
    LeaderTerms::Hooks hooks;
    hooks.jobs = options.jobs;
    hooks.recovery_grace = options.recovery_grace;
    hooks.set_serving = [s = server.get()](bool serving) { s->SetServing(HealthPart::kLeading, serving); };
    hooks.fatal = options.on_fatal;
    server->terms_->Start(server->registry_.get(),
                          options.advertise.empty() ? server->address_ : options.advertise,
                          std::move(hooks));
  }
  spdlog::info("coordinator serving on {} ({}{}), {} job(s) loaded from the state, {} in the "
               "jobs file{}; at most {} gRPC connections, {} from one client address",
               server->address_, options.tls_cert_file.empty() ? "plaintext" : "TLS",
               options.tls_client_ca_file.empty() ? "" : ", client certificates required",
               *loaded, options.jobs.size(),
               options.auth_token.empty()       ? ""
               : server->worker_tokens_ == 0 ? ", token auth on"
                                                : absl::StrCat(", token auth on (operator and ",
                                                               server->worker_tokens_,
                                                               " worker token(s))"),
               *max_connections, std::min(options.rpc_max_connections_per_client,
                                          *max_connections));
  if (server->metrics_ != nullptr) {
    const char* scheme = options.http_tls ? "https" : "http";
    spdlog::info("metrics on {}://{}/metrics, status page on {}://{}/", scheme,
                 server->http_->address(), scheme, server->http_->address());
  }
  return server;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::SetServing(HealthPart part, bool value) {
  absl::MutexLock lock(&health_mu_);
  (part == HealthPart::kLeading ? leading_ : accepting_) = value;
  if (health_frozen_ || server_ == nullptr || server_->GetHealthCheckService() == nullptr) return;
  server_->GetHealthCheckService()->SetServingStatus(leading_ && accepting_);
}

std::string CoordinatorServer::metrics_address() const {
  return http_ == nullptr ? "" : http_->address();
}

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ == nullptr && registry_ == nullptr) return;  // Start failed before anything ran
  spdlog::info("coordinator on {} shutting down", address_);
  // No new connection from here on (and no probe that could say SERVING again).
  if (listener_ != nullptr) listener_->Stop();
  {
    absl::MutexLock lock(&health_mu_);
    health_frozen_ = true;
  }
  // Fails pending waits (UNAVAILABLE) and ends the watch streams first, so that the gRPC
  // shutdown below has nothing left to wait for.
  if (server_ != nullptr && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  // Steps down and hands the leadership over before the core stops.
  if (terms_ != nullptr) terms_->Stop();
  if (registry_ != nullptr) registry_->Stop();
  if (server_ != nullptr) {
    // Every wait has already failed; what remains are short unary calls (and idle connections,
    // which gRPC would otherwise wait on until the deadline).
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    server_->Wait();
  }
  spdlog::debug("gRPC server stopped");
  http_.reset();
  spdlog::debug("HTTP server stopped");
  spdlog::info("coordinator stopped");
}

}  // namespace modelavg::server
