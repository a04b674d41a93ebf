#include "server/http/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/peer_address.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

std::string Lookup(const std::map<std::string, std::string>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? "" : it->second;
}

// One request being received: its fields, and the form parser of a POST.
struct RequestState {
  HttpRequest request;
  MHD_PostProcessor* post = nullptr;
  size_t body_bytes = 0;
  bool too_large = false;
  ~RequestState() {
    if (post != nullptr) MHD_destroy_post_processor(post);
  }
};

MHD_Result CollectValue(void* cls, MHD_ValueKind kind, const char* key, const char* value) {
  auto* request = static_cast<HttpRequest*>(cls);
  if (key == nullptr) return MHD_YES;
  const std::string v = value == nullptr ? "" : value;
  switch (kind) {
    case MHD_HEADER_KIND:
      request->headers[absl::AsciiStrToLower(key)] = v;
      break;
    case MHD_COOKIE_KIND:
      request->cookies[key] = v;
      break;
    case MHD_GET_ARGUMENT_KIND:
      request->query[key] = v;
      break;
    default:
      break;
  }
  return MHD_YES;
}

MHD_Result CollectFormField(void* cls, MHD_ValueKind, const char* key, const char*, const char*,
                            const char*, const char* data, uint64_t, size_t size) {
  auto* state = static_cast<RequestState*>(cls);
  if (key == nullptr) return MHD_YES;
  // A value may come in several pieces.
  state->request.form[key].append(data == nullptr ? "" : data, size);
  return MHD_YES;
}

MHD_Result Respond(MHD_Connection* connection, const HttpResponse& reply) {
  MHD_Response* response = MHD_create_response_from_buffer(
      reply.body.size(), const_cast<char*>(reply.body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, reply.content_type.c_str());
  for (const auto& [name, value] : reply.headers) {
    MHD_add_response_header(response, name.c_str(), value.c_str());
  }
  const MHD_Result queued =
      MHD_queue_response(connection, static_cast<unsigned int>(reply.status), response);
  MHD_destroy_response(response);
  return queued;
}

MHD_Result OnRequest(void* cls, MHD_Connection* connection, const char* url, const char* method,
                     const char*, const char* upload_data, size_t* upload_data_size,
                     void** con_cls) {
  const auto* server = static_cast<const HttpServer*>(cls);
  auto* state = static_cast<RequestState*>(*con_cls);
  if (state == nullptr) {
    // The headers are in; the body (if any) follows in later calls.
    state = new RequestState();
    *con_cls = state;
    state->request.method = method;
    state->request.path = url;
    MHD_get_connection_values(connection, MHD_HEADER_KIND, &CollectValue, &state->request);
    MHD_get_connection_values(connection, MHD_COOKIE_KIND, &CollectValue, &state->request);
    MHD_get_connection_values(connection, MHD_GET_ARGUMENT_KIND, &CollectValue,
                              &state->request);
    if (state->request.method == "POST") {
      // NULL for a body that is not a form: its bytes are then counted and dropped.
      state->post = MHD_create_post_processor(connection, 4096, &CollectFormField, state);
    }
    return MHD_YES;
  }
  if (*upload_data_size > 0) {
    state->body_bytes += *upload_data_size;
    if (state->body_bytes > server->options().max_body_bytes) {
      state->too_large = true;
    } else if (state->post != nullptr) {
      MHD_post_process(state->post, upload_data, *upload_data_size);
    }
    *upload_data_size = 0;
    return MHD_YES;
  }
  if (state->too_large) {
    HttpResponse reply;
    reply.status = 413;
    reply.body = absl::StrCat("request body larger than ", server->options().max_body_bytes,
                              " bytes\n");
    return Respond(connection, reply);
  }
  HttpResponse reply;
  try {
    reply = server->Handle(state->request);
  } catch (const std::exception& e) {
    spdlog::error("HTTP {} {}: {}", state->request.method, state->request.path, e.what());
    reply = HttpResponse{};
    reply.status = 500;
    reply.body = "internal error\n";
  }
  return Respond(connection, reply);
}

void OnCompleted(void* cls, MHD_Connection* connection, void** con_cls,
                 MHD_RequestTerminationCode) {
  delete static_cast<RequestState*>(*con_cls);
  *con_cls = nullptr;
  static_cast<HttpServer*>(cls)->RequestEnded(connection);
}

MHD_Result OnAccept(void* cls, const sockaddr* addr, socklen_t) {
  return static_cast<HttpServer*>(cls)->AdmitConnection(PeerAddress(addr)) ? MHD_YES : MHD_NO;
}

void OnConnection(void* cls, MHD_Connection* connection, void**,
                  MHD_ConnectionNotificationCode code) {
  auto* server = static_cast<HttpServer*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    const MHD_ConnectionInfo* from =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    server->ConnectionOpened(connection, info == nullptr ? -1 : info->connect_fd,
                             from == nullptr ? "?" : PeerAddress(from->client_addr));
  } else {
    server->ConnectionClosed(connection);
  }
}

void LogFromLibrary(void*, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  std::string text = line;
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  spdlog::debug("HTTP server: {}", text);
}

}  // namespace

std::string HttpRequest::Header(const std::string& name) const { return Lookup(headers, name); }
std::string HttpRequest::Cookie(const std::string& name) const { return Lookup(cookies, name); }
std::string HttpRequest::Query(const std::string& name) const { return Lookup(query, name); }
std::string HttpRequest::Form(const std::string& name) const { return Lookup(form, name); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen,
                                                               HttpHandler handler,
                                                               HttpServerOptions options) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "HTTP listen address \"", listen, "\" must be HOST:PORT with PORT in [0, 65535]"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "*") host = "0.0.0.0";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP listen address \"", listen,
                                                   "\": cannot resolve \"", host,
                                                   "\": ", gai_strerror(rc)));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, found->ai_addr, found->ai_addrlen);
  const int family = found->ai_family;
  freeaddrinfo(found);

  if (options.max_connections < 1 || options.max_connections_per_client < 1 ||
      options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the HTTP port needs at least one connection (", options.max_connections,
        "), one per client (", options.max_connections_per_client,
        ") and a request timeout above 0 (", absl::FormatDuration(options.request_timeout),
        ")"));
  }
  const bool tls = !options.tls_cert_pem.empty() || !options.tls_key_pem.empty();
  if (tls && (options.tls_cert_pem.empty() || options.tls_key_pem.empty())) {
    return absl::InvalidArgumentError("HTTPS needs both a certificate and a key");
  }
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(handler), std::move(options)));
  const HttpServerOptions& o = server->options_;
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ERROR_LOG;
  if (family == AF_INET6) flags |= MHD_USE_IPv6;
  // The TLS options (only with TLS), pointing at the options' strings, which outlive the daemon.
  std::vector<MHD_OptionItem> tls_options;
  if (tls) {
    flags |= MHD_USE_TLS;
    tls_options.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0, const_cast<char*>(o.tls_cert_pem.c_str())});
    tls_options.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(o.tls_key_pem.c_str())});
  }
  tls_options.push_back({MHD_OPTION_END, 0, nullptr});
  server->deadlines_ = std::thread([s = server.get()] { s->EnforceDeadlines(); });
  server->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(port), &OnAccept, server.get(), &OnRequest, server.get(),
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&addr),
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned int>(o.threads),
      MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(absl::ToInt64Seconds(o.idle_timeout)),
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(o.max_connections),
      MHD_OPTION_PER_IP_CONNECTION_LIMIT, static_cast<unsigned int>(o.max_connections_per_client),
      MHD_OPTION_NOTIFY_COMPLETED, &OnCompleted, server.get(),
      MHD_OPTION_NOTIFY_CONNECTION, &OnConnection, server.get(),
      MHD_OPTION_EXTERNAL_LOGGER, &LogFromLibrary, nullptr,
      MHD_OPTION_ARRAY, tls_options.data(),
      MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", listen,
                                               " (address in use or not local?)"));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  const int bound = info == nullptr ? port : info->port;
  std::string shown = listen.substr(0, colon);
  if (shown.empty() || shown == "*") shown = "0.0.0.0";
  server->address_ = absl::StrCat(shown, ":", bound);
  return server;
}

HttpServer::~HttpServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (deadlines_.joinable()) deadlines_.join();
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

int64_t HttpServer::requests_timed_out() const {
  absl::MutexLock lock(&mu_);
  return timed_out_;
}

void HttpServer::ConnectionOpened(MHD_Connection* connection, int fd,
                                  const std::string& client) {
  absl::MutexLock lock(&mu_);
  open_[connection] = Open{fd, absl::Now() + options_.request_timeout, false, client};
  ++per_client_[client];
}

void HttpServer::ConnectionClosed(MHD_Connection* connection) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(connection);
  if (it == open_.end()) return;
  auto held = per_client_.find(it->second.client);
  if (held != per_client_.end() && --held->second <= 0) per_client_.erase(held);
  open_.erase(it);
}

bool HttpServer::AdmitConnection(const std::string& client) {
  absl::MutexLock lock(&mu_);
  // The part of the port any address may fill; the rest is kept for addresses that hold none.
  const int shared = options_.max_connections - std::max(1, options_.max_connections / 4);
  const auto held = per_client_.find(client);
  if (held == per_client_.end() || static_cast<int>(open_.size()) < shared) return true;
  if (refused_for_new_++ % 1000 == 0) {
    spdlog::warn("HTTP port: {} connections open of {}; refused another from {}, which holds {} "
                 "(the last quarter is kept for addresses that hold none; {} refused so)",
                 open_.size(), options_.max_connections, client, held->second, refused_for_new_);
  }
  return false;
}

int64_t HttpServer::refused_for_new_clients() const {
  absl::MutexLock lock(&mu_);
  return refused_for_new_;
}

void HttpServer::RequestEnded(MHD_Connection* connection) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(connection);
  if (it != open_.end()) it->second.deadline = absl::Now() + options_.request_timeout;
}

void HttpServer::EnforceDeadlines() {
  const absl::Duration tick = std::clamp(options_.request_timeout / 10, absl::Milliseconds(10),
                                         absl::Milliseconds(500));
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), tick)) {
    const absl::Time now = absl::Now();
    for (auto& [connection, open] : open_) {
      if (open.shut || open.fd < 0 || now < open.deadline) continue;
      // The event loop sees the end of the stream and closes the connection; the socket is
      // still this connection's (ConnectionClosed waits for mu_ before it is closed).
      shutdown(open.fd, SHUT_RDWR);
      open.shut = true;
      ++timed_out_;
      spdlog::debug("HTTP port: closed a connection that took longer than {} over one request",
                    absl::FormatDuration(options_.request_timeout));
    }
  }
}

}  // namespace modelavg::server
