// The coordinator's status page, on its HTTP port beside /metrics: `/` lists the jobs, and
// `/jobs/<id>` shows one job's members (step, lag behind the leader, time since heartbeat), its
// generation history with the reasons, its recent events and the next averaging steps of its
// schedule drawn as an SVG timeline. Plain HTML that a small same-origin script refreshes every
// second (a <noscript> meta refresh without JavaScript); every value is HTML-escaped and the
// Content-Security-Policy allows no inline or remote script or style.
//
// With an operator token set, every page but /login and /static/ needs it: either
// "Authorization: Bearer <token>" or the cookie that the /login form sets: a random session id
// (never the token), valid until session_ttl passes, /logout ends it, or the coordinator
// restarts (sessions live in its memory only). After login the browser goes back to the page
// it came from, and only to a page of this server (`next`: "/" or "/jobs/<id>", anything else
// is replaced by "/"). Credentials and communicator ids are never shown.
#ifndef MODELAVG_SERVER_HTTP_STATUS_PAGE_H_
#define MODELAVG_SERVER_HTTP_STATUS_PAGE_H_

#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "server/core/job_registry.h"
#include "server/http/http_server.h"

namespace modelavg::server {

struct StatusPageOptions {
  // Empty: no authentication.
  std::string operator_token;
  // How many steps past the leader the timeline looks for averaging steps, and how many it draws.
  int64_t timeline_search_steps = 100000;
  int timeline_max_marks = 40;
  // Most members listed on a job's page (a note says how many more there are).
  int max_member_rows = 2000;
  // How often the page refreshes itself.
  int refresh_ms = 1000;
  // How long a login lasts; its cookie expires then too.
  absl::Duration session_ttl = absl::Hours(12);
  // Most logins held at once; past it a new one ends the one closest to its expiry.
  size_t max_sessions = 4096;
  // Mark the login cookie Secure (the HTTP port serves TLS).
  bool secure_cookie = false;
};

class StatusPage {
 public:
  // `registry` must outlive this object.
  StatusPage(const JobRegistry* registry, StatusPageOptions options);

  // Answers GET /, /jobs/<id>, /login (GET and POST), /logout and /static/*; 404 otherwise.
  // Thread-safe.
  HttpResponse Handle(const HttpRequest& request) const;

 private:
  bool Authorized(const HttpRequest& request) const;
  HttpResponse LoginPage(const HttpRequest& request, int status, const std::string& note) const;
  HttpResponse Login(const HttpRequest& request) const;
  HttpResponse Index() const;
  HttpResponse JobPage(const std::string& job_id) const;
  HttpResponse Page(int status, const std::string& title, const std::string& body) const;

  // A new login's session id (added to sessions_), and the end of one.
  std::string StartSession() const ABSL_LOCKS_EXCLUDED(mu_);
  void EndSession(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  bool ValidSession(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);

  const JobRegistry* const registry_;
  const StatusPageOptions options_;
  mutable absl::Mutex mu_;
  // The logins: SHA-256 of each session id (the id itself is kept only by the browser) to its
  // expiry.
  mutable absl::flat_hash_map<std::string, absl::Time> sessions_ ABSL_GUARDED_BY(mu_);
};

// The page a login goes back to: `next` when it is "/" or "/jobs/<job id>", else "/".
std::string LoginRedirect(const std::string& next);

// HTML-escapes & < > " ' (for text and attribute values alike).
std::string HtmlEscape(const std::string& text);
// Percent-encodes everything but unreserved characters (for a path segment of a link).
std::string UrlEncode(const std::string& text);

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_HTTP_STATUS_PAGE_H_
