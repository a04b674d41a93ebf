// The coordinator's HTTP port (--metrics_listen): a small embedded server (GNU libmicrohttpd)
// that hands each complete request to one handler function. It runs an event loop (epoll) on a
// few threads, so idle or slow connections cost a file descriptor each and never hold up other
// requests; a connection idle for `idle_timeout` is closed. Stopping it is prompt: it closes the
// listening socket and every connection, and joins its threads.
#ifndef MODELAVG_SERVER_HTTP_HTTP_SERVER_H_
#define MODELAVG_SERVER_HTTP_HTTP_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

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
  // Largest request body accepted (413 past it).
  size_t max_body_bytes = 16 * 1024;
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

  // Internal: runs the handler (called from the server's threads).
  HttpResponse Handle(const HttpRequest& request) const { return handler_(request); }
  const HttpServerOptions& options() const { return options_; }

 private:
  HttpServer(HttpHandler handler, HttpServerOptions options)
      : handler_(std::move(handler)), options_(options) {}

  const HttpHandler handler_;
  const HttpServerOptions options_;
  MHD_Daemon* daemon_ = nullptr;
  std::string address_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_HTTP_HTTP_SERVER_H_
