// The coordinator's HTTP port (--metrics_listen): a small embedded server (GNU libmicrohttpd)
// that hands each complete request to one handler function. It runs an event loop (epoll) on a
// few threads, so idle or slow connections cost a file descriptor each and never hold up other
// requests. What one client can hold is bounded: connections from one address
// (max_connections_per_client), and the time to send a whole request and take its reply
// (request_timeout, which trickling bytes does not extend); a connection idle for
// `idle_timeout` is closed as well. Stopping it is prompt: it closes the listening socket and
// every connection, and joins its threads.
#ifndef MODELAVG_SERVER_HTTP_HTTP_SERVER_H_
#define MODELAVG_SERVER_HTTP_HTTP_SERVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct MHD_Connection;
struct MHD_Daemon;

namespace modelavg::server {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // without the query string, percent-decoded
  // Header names lower-cased.
  std::map<std::string, std::string> headers;
  std::map<std::string, std::string> cookies;
  std::map<std::string, std::string> query;
  // Fields of an application/x-www-form-urlencoded POST body.
  std::map<std::string, std::string> form;

  // The header's value, or "" when absent. `name` in lower case.
  std::string Header(const std::string& name) const;
  std::string Cookie(const std::string& name) const;
  std::string Query(const std::string& name) const;
  std::string Form(const std::string& name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpServerOptions {
  // Threads, each with its own event loop; the handler may run on any of them at once.
  int threads = 2;
  // A connection that sends nothing for this long is closed.
  absl::Duration idle_timeout = absl::Seconds(30);
  // Most connections open at once; past that new ones are refused (closed at once).
  int max_connections = 1024;
  // Most connections open at once from one client address; past that its new ones are refused
  // (closed at once), so that one client cannot take the port. And a quarter of
  // max_connections is kept for addresses that hold none yet: once three quarters are open, an
  // address that holds one is refused another, so that a few dozen addresses dripping
  // connections cannot keep out Prometheus or an operator's browser.
  int max_connections_per_client = 32;
  // How long a client has to send a whole request (head and body) and take its reply, counted
  // from when it connected or got its previous reply; past it the connection is closed without
  // an answer, however steadily it trickles bytes (libmicrohttpd's own timeout counts from the
  // last byte). Whole seconds or not, checked about ten times per period.
  absl::Duration request_timeout = absl::Seconds(10);
  // Largest request body accepted (413 past it).
  size_t max_body_bytes = 16 * 1024;
  // Both set (PEM): serve HTTPS.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

class HttpServer {
 public:
  // Serves on `listen` ("HOST:PORT"; port 0: any free port; an empty host, "*" or "0.0.0.0":
  // every IPv4 address, "[::]": every address). INVALID_ARGUMENT for a malformed address,
  // UNAVAILABLE when it cannot bind (naming the address and the reason).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& listen,
                                                           HttpHandler handler,
                                                           HttpServerOptions options = {});
  // Stops serving: closes every connection and joins the threads.
  ~HttpServer();

  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // "HOST:PORT" actually bound.
  const std::string& address() const { return address_; }
  // Connections closed because their request took longer than request_timeout.
  int64_t requests_timed_out() const ABSL_LOCKS_EXCLUDED(mu_);

  // Internal: runs the handler (called from the server's threads).
  HttpResponse Handle(const HttpRequest& request) const { return handler_(request); }
  const HttpServerOptions& options() const { return options_; }
  // Internal, from the server's threads: a connection opened (with its socket) or closed; a
  // request on it ended (its reply sent, or it failed): the next one's time starts.
  void ConnectionOpened(MHD_Connection* connection, int fd, const std::string& client)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Internal, from the server's threads before a connection is made: whether `client` (its
  // address, without the port) may open one more (the room kept for new addresses).
  bool AdmitConnection(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  // Connections refused to keep room for addresses that hold none.
  int64_t refused_for_new_clients() const ABSL_LOCKS_EXCLUDED(mu_);
  void ConnectionClosed(MHD_Connection* connection) ABSL_LOCKS_EXCLUDED(mu_);
  void RequestEnded(MHD_Connection* connection) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  HttpServer(HttpHandler handler, HttpServerOptions options)
      : handler_(std::move(handler)), options_(std::move(options)) {}

  // The request deadline's thread: shuts down the socket of each connection past it (the
  // event loop then closes the connection). Runs until stopping_.
  void EnforceDeadlines() ABSL_LOCKS_EXCLUDED(mu_);

  const HttpHandler handler_;
  const HttpServerOptions options_;
  MHD_Daemon* daemon_ = nullptr;
  std::string address_;

  struct Open {
    int fd;
    absl::Time deadline;
    bool shut;  // its socket was shut down for the deadline
    std::string client;
  };
  mutable absl::Mutex mu_;
  // Every open connection. A connection's socket is closed only after ConnectionClosed, which
  // waits for mu_: a socket shut down under mu_ is still the connection's.
  absl::flat_hash_map<MHD_Connection*, Open> open_ ABSL_GUARDED_BY(mu_);
  int64_t timed_out_ ABSL_GUARDED_BY(mu_) = 0;
  // Open connections per client address.
  absl::flat_hash_map<std::string, int> per_client_ ABSL_GUARDED_BY(mu_);
  int64_t refused_for_new_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread deadlines_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_HTTP_HTTP_SERVER_H_
