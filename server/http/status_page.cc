#include "server/http/status_page.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/job_spec.h"
#include "modelavg/common/schedule.h"

namespace modelavg::server {
namespace {

constexpr char kCookieName[] = "modelavg_status";

constexpr char kStyle[] = R"css(
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 10px 20px; display: flex; gap: 20px;
         align-items: baseline; }
header a { color: #fff; text-decoration: none; font-weight: 600; }
header .right { margin-left: auto; font-size: 12px; opacity: .8; }
main { padding: 12px 20px 40px; }
h1 { font-size: 20px; margin: 8px 0; }
h2 { font-size: 15px; margin: 22px 0 6px; }
table { border-collapse: collapse; background: #fff; min-width: 40%; }
th, td { border: 1px solid #d8dce3; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eceff4; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; padding: 1px 6px; border-radius: 3px; }
.RUNNING, .ALIVE { background: #d7f5dd; color: #135c22; }
.PENDING { background: #fff2c7; color: #6b5200; }
.FINISHED, .LEFT { background: #e3e6ec; color: #3b4252; }
.DEAD, .VACANT { background: #fbd9d9; color: #8a1111; }
.RETIRED { background: #fde6c8; color: #7a4100; }
tr.replica th { background: #f6f7fa; font-weight: 500; }
.lagging { color: #8a1111; font-weight: 600; }
.kv { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; }
.kv dt { color: #5c6577; } .kv dd { margin: 0; }
.note { color: #5c6577; font-size: 12px; }
.banner { background: #fbd9d9; color: #8a1111; padding: 6px 20px; display: none; }
.banner.shown { display: block; }
svg { background: #fff; border: 1px solid #d8dce3; }
svg text { font: 11px system-ui, sans-serif; fill: #1d2330; }
form.login { background: #fff; padding: 16px; border: 1px solid #d8dce3; width: 360px; }
form.login input[type=password] { width: 100%; box-sizing: border-box; margin: 6px 0 10px; }
)css";

// Refreshes the page's #content in place (no reload: scroll position and selection stay), and
// shows a banner while the coordinator does not answer.
constexpr char kScript[] = R"js(
(function () {
  var period = Number(document.body.getAttribute('data-refresh-ms')) || 1000;
  var banner = document.getElementById('unreachable');
  function tick() {
    fetch(window.location.href, {credentials: 'same-origin', cache: 'no-store'})
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); return null; }
        return r.text();
      })
      .then(function (text) {
        if (text === null) return;
        var doc = new DOMParser().parseFromString(text, 'text/html');
        var fresh = doc.getElementById('content');
        var current = document.getElementById('content');
        if (fresh && current) current.replaceWith(document.importNode(fresh, true));
        banner.className = 'banner';
      })
      .catch(function () { banner.className = 'banner shown'; })
      .then(function () { window.setTimeout(tick, period); });
  }
  window.setTimeout(tick, period);
})();
)js";

const char* const kLevelColors[] = {"#3b6fd6", "#d6793b", "#2f9e5a", "#9b3bd6",
                                    "#d63b6a", "#3bb5d6", "#8c8c2f", "#5a5a5a"};

std::string Td(const std::string& text) { return absl::StrCat("<td>", HtmlEscape(text), "</td>"); }
std::string TdNum(int64_t v) { return absl::StrCat("<td class=\"num\">", v, "</td>"); }
// -1 (nothing reported yet) as a dash.
std::string TdStep(int64_t v) {
  return v < 0 ? std::string("<td class=\"num\">&ndash;</td>") : TdNum(v);
}
std::string StateSpan(const std::string& state) {
  return absl::StrCat("<span class=\"state ", HtmlEscape(state), "\">", HtmlEscape(state),
                      "</span>");
}
std::string TimeText(int64_t unix_ms) {
  if (unix_ms <= 0) return "";
  return absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

// "none", or the count and the latest report: "2; last: rank 3, NaN in tensor 0 of its
// parameters at step 30, level 1 (retired)", escaped.
std::string NonFiniteText(const v1::Job& j) {
  if (j.nonfinite_reports() == 0) return "none";
  const v1::NonFiniteReport& r = j.last_nonfinite();
  return HtmlEscape(absl::StrCat(
      j.nonfinite_reports(), "; last: rank ", r.rank(), ", ", r.value(), " in tensor ",
      r.tensor(), " of its ", r.payload(), " at step ", r.step(), ", level ", r.level(),
      r.retired() ? " (retired)" : " (not retired)", ", ", TimeText(r.unix_ms())));
}

// One plan's levels on a line: "every P steps in groups of G" each, with an outer level's
// optimizer and a compressed payload.
std::string LevelsText(const v1::JobSpec& spec) {
  std::vector<std::string> levels;
  for (const v1::Level& l : spec.levels()) {
    std::string text =
        absl::StrCat("every ", l.period(), " steps in groups of ", l.group_size());
    // How an outer level's pseudo-gradient travels, when it is compressed.
    if (l.payload() != v1::FP32) {
      absl::StrAppend(&text, ", payload ", v1::Payload_Name(l.payload()));
    }
    if (l.topk_density() != 0) absl::StrAppend(&text, " (density ", l.topk_density(), ")");
    if (l.error_feedback() != 0) absl::StrAppend(&text, ", error feedback ", l.error_feedback());
    if (l.fragments() > 1) absl::StrAppend(&text, ", ", l.fragments(), " fragments");
    if (l.has_outer()) {
      absl::StrAppend(&text, ", outer lr ", l.outer().lr(), " momentum ", l.outer().momentum(),
                      l.outer().nesterov() ? " nesterov" : "");
    }
    levels.push_back(std::move(text));
  }
  return absl::StrJoin(levels, "; ");
}

// A paced job's pacing (docs/paced.md) as <dt>/<dd> pairs; empty for another job.
std::string PacingText(const v1::Job& j) {
  if (!j.has_pacing()) return "";
  std::string out;
  for (const auto& [name, text] : PacingRows(j.pacing())) {
    absl::StrAppend(&out, "<dt class=\"pacing\">", HtmlEscape(name), "</dt><dd>",
                    HtmlEscape(text), "</dd>");
  }
  return out;
}

std::string PlanText(const v1::JobSpec& spec) {
  return absl::StrCat(spec.mode() == v1::PERIODIC ? "periodic" : "hierarchical", ", warm-up ",
                      spec.warmup_steps(), " steps; ", LevelsText(spec));
}

std::string EventKindName(v1::JobEvent::Kind kind) {
  switch (kind) {
    case v1::JobEvent::MEMBER_JOINED: return "member joined";
    case v1::JobEvent::WORLD_COMPLETE: return "world complete";
    case v1::JobEvent::GENERATION_CHANGED: return "generation changed";
    case v1::JobEvent::JOB_FINISHED: return "job finished";
    case v1::JobEvent::JOB_DELETED: return "job deleted";
    case v1::JobEvent::MEMBER_ADMITTED: return "member admitted";
    case v1::JobEvent::MEMBER_NON_FINITE: return "member non-finite";
    case v1::JobEvent::PLAN_UPDATED: return "plan updated";
    default: return v1::JobEvent::Kind_Name(kind);
  }
}

std::string Hex(const unsigned char* data, size_t n) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(data), n));
}

// 256 random bits, hex.
std::string NewSessionId() {
  unsigned char bytes[32];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) return "";
  return Hex(bytes, sizeof(bytes));
}

std::string Sha256Hex(const std::string& text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return Hex(digest, sizeof(digest));
}

bool SameSecret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && !a.empty() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// The timeline: the next averaging steps of `schedule` in [from, min(from + search, until)),
// one row per level.
std::string Timeline(const Schedule& schedule, int64_t from, int64_t search, int64_t until,
                     int max_marks, std::string* listing) {
  struct Mark {
    int64_t step;
    int level;
  };
  std::vector<Mark> marks;
  const int64_t end = std::min(from + search, until);
  for (int64_t s = from; s < end && static_cast<int>(marks.size()) < max_marks; ++s) {
    const int level = schedule.LevelAt(s);
    if (level >= 0) marks.push_back({s, level});
  }
  const int levels = schedule.num_levels();
  const ScheduleSpec& spec = schedule.spec();
  if (marks.empty()) {
    *listing = absl::StrCat("<p>No averaging step in the ", std::max<int64_t>(end - from, 0),
                            " steps from step ", from, ".</p>");
    return "";
  }
  const int64_t first = from;
  const int64_t last = std::max(marks.back().step, from + 1);
  const int left = 200, right = 20, top = 14, row = 26, width = 960;
  const int height = top + row * levels + 34;
  const double scale = static_cast<double>(width - left - right) / static_cast<double>(last - first);
  auto x_of = [&](int64_t step) { return left + static_cast<double>(step - first) * scale; };
  std::string svg = absl::StrCat(
      "<svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"", width,
      "\" height=\"", height, "\" viewBox=\"0 0 ", width, " ", height,
      "\" role=\"img\" aria-label=\"next averaging steps\">");
  for (int l = 0; l < levels; ++l) {
    const int y = top + row * l + row / 2;
    absl::StrAppend(&svg, "<text x=\"6\" y=\"", y + 4, "\">level ", l, ": every ",
                    spec.levels[l].period, ", groups of ", spec.levels[l].group_size, "</text>",
                    "<line x1=\"", left, "\" y1=\"", y, "\" x2=\"", width - right, "\" y2=\"", y,
                    "\" stroke=\"#d8dce3\"/>");
  }
  const int axis = top + row * levels + 6;
  absl::StrAppend(&svg, "<line x1=\"", left, "\" y1=\"", axis, "\" x2=\"", width - right,
                  "\" y2=\"", axis, "\" stroke=\"#5c6577\"/>");
  double last_label_x = -1e9;
  for (const Mark& m : marks) {
    const double x = x_of(m.step);
    const int y = top + row * m.level + row / 2;
    const char* color = kLevelColors[m.level % (sizeof(kLevelColors) / sizeof(kLevelColors[0]))];
    absl::StrAppendFormat(&svg,
                          "<g class=\"mark\"><title>step %d: level %d</title>"
                          "<rect x=\"%.1f\" y=\"%d\" width=\"6\" height=\"16\" rx=\"2\" "
                          "fill=\"%s\"/></g>",
                          m.step, m.level, x - 3, y - 8, color);
    if (x - last_label_x > 42) {
      absl::StrAppendFormat(&svg,
                            "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" "
                            "stroke=\"#5c6577\"/><text x=\"%.1f\" y=\"%d\" "
                            "text-anchor=\"middle\">%d</text>",
                            x, axis, x, axis + 4, x, axis + 16, m.step);
      last_label_x = x;
    }
  }
  absl::StrAppend(&svg, "</svg>");
  std::vector<std::string> items;
  constexpr size_t kListed = 12;
  for (const Mark& m : marks) {
    if (items.size() == kListed) break;
    // Sharded replicas: S groups per block, one per shard, of g / S ranks each.
    const int32_t g = spec.levels[m.level].group_size;
    const int32_t groups = schedule.NumSubgroups(m.level);
    const int32_t size = g / spec.replica_size;
    items.push_back(absl::StrCat(m.step, " (level ", m.level, ", ", groups,
                                 groups == 1 ? " group" : " groups", " of ", size,
                                 spec.replica_size > 1 ? " ranks, one shard each" : "", ")"));
  }
  *listing = absl::StrCat("<p class=\"note\" id=\"next-steps\">Next averaging steps: ",
                          HtmlEscape(absl::StrJoin(items, ", ")),
                          marks.size() > items.size() ? ", &hellip;" : "", "</p>");
  return svg;
}

}  // namespace

std::string HtmlEscape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

std::string LoginRedirect(const std::string& next) {
  if (next == "/") return next;
  // The only pages behind the login; a job id is [A-Za-z0-9._-]: no '/', '\\', '%', ':' or
  // control character that could make a browser leave this server.
  absl::string_view id = next;
  if (absl::ConsumePrefix(&id, "/jobs/") && ValidateJobId(id).ok()) return next;
  return "/";
}

StatusPage::StatusPage(const JobRegistry* registry, StatusPageOptions options)
    : registry_(registry), options_(std::move(options)) {}

std::string StatusPage::StartSession() const {
  const std::string id = NewSessionId();
  if (id.empty()) return "";
  const absl::Time now = registry_->clock()->Now();
  absl::MutexLock lock(&mu_);
  // Expired logins go first; if still full, the one closest to its expiry.
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second <= now) {
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
  if (sessions_.size() >= options_.max_sessions && !sessions_.empty()) {
    auto oldest = std::min_element(sessions_.begin(), sessions_.end(),
                                   [](const auto& a, const auto& b) { return a.second < b.second; });
    sessions_.erase(oldest);
  }
  sessions_[Sha256Hex(id)] = now + options_.session_ttl;
  return id;
}

void StatusPage::EndSession(const std::string& id) const {
  if (id.empty()) return;
  absl::MutexLock lock(&mu_);
  sessions_.erase(Sha256Hex(id));
}

bool StatusPage::ValidSession(const std::string& id) const {
  if (id.empty()) return false;
  const std::string key = Sha256Hex(id);
  const absl::Time now = registry_->clock()->Now();
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(key);
  if (it == sessions_.end()) return false;
  if (it->second <= now) {
    sessions_.erase(it);
    return false;
  }
  return true;
}

bool StatusPage::Authorized(const HttpRequest& request) const {
  if (options_.operator_token.empty()) return true;
  const std::string header = request.Header("authorization");
  if (absl::StartsWith(header, "Bearer ") &&
      SameSecret(header.substr(7), options_.operator_token)) {
    return true;
  }
  return ValidSession(request.Cookie(kCookieName));
}

HttpResponse StatusPage::Page(int status, const std::string& title,
                              const std::string& body) const {
  HttpResponse reply;
  reply.status = status;
  reply.content_type = "text/html; charset=utf-8";
  reply.headers = {
      {"Content-Security-Policy",
       "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"},
      {"X-Content-Type-Options", "nosniff"},
      {"Referrer-Policy", "no-referrer"},
      {"Cache-Control", "no-store"}};
  const bool auth = !options_.operator_token.empty();
  reply.body = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width\">"
      "<title>",
      HtmlEscape(title),
      " &middot; modelavg</title>"
      "<link rel=\"stylesheet\" href=\"/static/status.css\">"
      "<noscript><meta http-equiv=\"refresh\" content=\"5\"></noscript>"
      "</head><body data-refresh-ms=\"",
      options_.refresh_ms,
      "\"><header><a href=\"/\">modelavg coordinator</a><a href=\"/metrics\">metrics</a>",
      auth ? "<a href=\"/logout\">log out</a>" : "",
      "<span class=\"right\">refreshes every ", options_.refresh_ms,
      " ms &middot; incarnation ", HtmlEscape(registry_->incarnation()),
      "</span></header><div id=\"unreachable\" class=\"banner\">The coordinator does not "
      "answer; showing what it said last.</div><main>",
      body, "</main><script src=\"/static/status.js\"></script></body></html>\n");
  return reply;
}

HttpResponse StatusPage::LoginPage(const HttpRequest& request, int status,
                                   const std::string& note) const {
  const std::string next = LoginRedirect(request.Query("next"));
  HttpResponse reply = Page(
      status, "log in",
      absl::StrCat(
          "<h1>Log in</h1><form class=\"login\" method=\"post\" action=\"/login?next=",
          HtmlEscape(UrlEncode(next)),
          "\"><label for=\"token\">Operator token (the coordinator's --auth_token_file)</label>"
          "<input type=\"password\" id=\"token\" name=\"token\" autocomplete=\"current-password\""
          " autofocus><button type=\"submit\">Log in</button>",
          note.empty() ? "" : absl::StrCat("<p class=\"lagging\">", HtmlEscape(note), "</p>"),
          "<p class=\"note\">Or send <code>Authorization: Bearer &lt;token&gt;</code>.</p>"
          "</form>"));
  if (status == 401) reply.headers.push_back({"WWW-Authenticate", "Bearer realm=\"modelavg\""});
  return reply;
}

HttpResponse StatusPage::Login(const HttpRequest& request) const {
  if (options_.operator_token.empty()) {
    HttpResponse reply;
    reply.status = 303;
    reply.headers.push_back({"Location", "/"});
    return reply;
  }
  if (request.method != "POST") return LoginPage(request, 200, "");
  if (!SameSecret(request.Form("token"), options_.operator_token)) {
    return LoginPage(request, 401, "That is not the operator token.");
  }
  const std::string session = StartSession();
  if (session.empty()) {
    HttpResponse reply;
    reply.status = 500;
    reply.body = "could not make a session id (no random bytes); send the token as a bearer "
                 "header instead\n";
    return reply;
  }
  HttpResponse reply;
  reply.status = 303;
  reply.headers.push_back({"Location", LoginRedirect(request.Query("next"))});
  reply.headers.push_back(
      {"Set-Cookie",
       absl::StrCat(kCookieName, "=", session, "; Path=/; Max-Age=",
                    absl::ToInt64Seconds(options_.session_ttl), "; HttpOnly; SameSite=Strict",
                    options_.secure_cookie ? "; Secure" : "")});
  reply.body = "logged in\n";
  return reply;
}

HttpResponse StatusPage::Handle(const HttpRequest& request) const {
  const std::string& path = request.path;
  if (path == "/static/status.css" || path == "/static/status.js") {
    HttpResponse reply;
    const bool css = absl::EndsWith(path, ".css");
    reply.content_type = css ? "text/css; charset=utf-8" : "text/javascript; charset=utf-8";
    reply.body = css ? kStyle : kScript;
    reply.headers = {{"X-Content-Type-Options", "nosniff"}, {"Cache-Control", "max-age=60"}};
    return reply;
  }
  if (path == "/login") return Login(request);
  if (path == "/logout") {
    // The session ends here, not only in this browser: a copy of the cookie is refused too.
    EndSession(request.Cookie(kCookieName));
    HttpResponse reply;
    reply.status = 303;
    reply.headers = {{"Location", "/login"},
                     {"Set-Cookie", absl::StrCat(kCookieName,
                                                 "=; Path=/; HttpOnly; SameSite=Strict; "
                                                 "Max-Age=0",
                                                 options_.secure_cookie ? "; Secure" : "")}};
    return reply;
  }
  const bool known = path == "/" || absl::StartsWith(path, "/jobs/");
  if (!known) {
    HttpResponse reply = Page(404, "not found",
                              absl::StrCat("<h1>Not found</h1><p>No page ", HtmlEscape(path),
                                           ". <a href=\"/\">All jobs</a></p>"));
    return reply;
  }
  if (request.method != "GET" && request.method != "HEAD") {
    HttpResponse reply;
    reply.status = 405;
    reply.headers.push_back({"Allow", "GET, HEAD"});
    reply.body = "only GET and HEAD here\n";
    return reply;
  }
  if (!Authorized(request)) {
    HttpRequest login = request;
    login.query["next"] = path;
    return LoginPage(login, 401, "");
  }
  if (path == "/") return Index();
  return JobPage(path.substr(6));
}

HttpResponse StatusPage::Index() const {
  std::string rows;
  int n = 0;
  for (const std::shared_ptr<Job>& job : registry_->ListJobs()) {
    v1::Job j;
    job->ToProto(&j, /*max_bytes=*/0);  // without members: min/max step are still set
    ++n;
    const v1::JobSpec& spec = j.spec();
    absl::StrAppend(
        &rows, "<tr><td><a href=\"/jobs/", HtmlEscape(UrlEncode(spec.job_id())), "\">",
        HtmlEscape(spec.job_id()), "</a></td><td>", StateSpan(v1::JobState_Name(j.state())),
        "</td>", Td(spec.mode() == v1::PERIODIC ? "periodic" : "hierarchical"),
        TdNum(j.generation()),
        absl::StrCat("<td class=\"num\">", j.live_world_size(), " / ", spec.world_size(),
                     "</td>"),
        Td(j.vacant_ranks().empty() ? "" : absl::StrJoin(j.vacant_ranks(), ", ")),
        TdNum(j.deaths()), TdNum(j.admissions()), TdNum(j.nonfinite_reports()),
        TdStep(j.min_step()), TdStep(j.max_step()),
        "</tr>");
  }
  std::string body = absl::StrCat(
      "<div id=\"content\"><h1>Jobs</h1>",
      n == 0 ? std::string("<p>No jobs.</p>")
             : absl::StrCat("<table id=\"jobs\"><tr><th>job</th><th>state</th><th>mode</th>"
                            "<th>generation</th><th>live / world</th><th>vacant ranks</th>"
                            "<th>deaths</th><th>admissions</th><th>non-finite</th>"
                            "<th>min step</th>"
                            "<th>max step</th></tr>",
                            rows, "</table>"),
      "<p class=\"note\">", n, n == 1 ? " job" : " jobs", " &middot; as of ",
      HtmlEscape(TimeText(absl::ToUnixMillis(registry_->clock()->Now()))), "</p></div>");
  return Page(200, "jobs", body);
}

HttpResponse StatusPage::JobPage(const std::string& job_id) const {
  absl::StatusOr<std::shared_ptr<Job>> found = registry_->Find(job_id);
  if (!found.ok()) {
    return Page(404, "no such job",
                absl::StrCat("<div id=\"content\"><h1>No job ", HtmlEscape(job_id), "</h1><p>",
                             HtmlEscape(std::string(found.status().message())),
                             ". <a href=\"/\">All jobs</a></p></div>"));
  }
  const std::shared_ptr<Job>& job = *found;
  v1::Job j;
  job->ToProto(&j);
  const std::vector<v1::GenerationChange> generations = job->GenerationHistory();
  const std::vector<LoggedEvent> events = job->RecentEvents();
  const v1::JobSpec& spec = j.spec();

  std::string body = absl::StrCat(
      "<div id=\"content\"><h1>Job <span id=\"job-id\">", HtmlEscape(spec.job_id()),
      "</span> ", StateSpan(v1::JobState_Name(j.state())), "</h1><dl class=\"kv\">",
      "<dt>generation</dt><dd id=\"generation\">", j.generation(), "</dd>",
      "<dt>live / world</dt><dd>", j.live_world_size(), " / ", spec.world_size(), "</dd>",
      spec.min_world_size() > 0
          ? absl::StrCat("<dt>elastic</dt><dd>runs on with at least ", spec.min_world_size(),
                         " ranks</dd>")
          : std::string(),
      spec.replica_size() > 1
          ? absl::StrCat("<dt>replicas</dt><dd id=\"replicas\">", spec.world_size() /
                             spec.replica_size(), " of ", spec.replica_size(),
                         " ranks each (rank r holds shard r % ", spec.replica_size(),
                         " of replica r / ", spec.replica_size(), ")</dd>")
          : std::string(),
      "<dt>vacant ranks</dt><dd>",
      j.vacant_ranks().empty() ? "none" : absl::StrJoin(j.vacant_ranks(), ", "), "</dd>",
      j.waiting_ranks().empty()
          ? std::string()
          : absl::StrCat("<dt>waiting for their replica</dt><dd>",
                         absl::StrJoin(j.waiting_ranks(), ", "), "</dd>"),
      "<dt>deaths</dt><dd id=\"deaths\">", j.deaths(), "</dd>", "<dt>admissions</dt><dd>",
      j.admissions(), "</dd>", "<dt>non-finite reports</dt><dd id=\"nonfinite\">",
      NonFiniteText(j), "</dd>", "<dt>steps</dt><dd>",
      j.min_step() < 0 ? std::string("none reported")
                       : absl::StrCat(j.min_step(), " to ", j.max_step()),
      "</dd><dt>plan</dt><dd id=\"plan\">", HtmlEscape(PlanText(spec)),
      j.plan_history_size() > 1 ? absl::StrCat(" (version ", j.plan_version(), ")")
                                : std::string(),
      "</dd>",
      j.has_pending_plan()
          ? absl::StrCat("<dt>pending plan</dt><dd id=\"pending-plan\">version ",
                         j.pending_plan().version(), " from step ",
                         j.pending_plan().switch_step(), ": ",
                         HtmlEscape(PlanText(j.pending_plan().spec())), "</dd>")
          : std::string(),
      PacingText(j),
      "<dt>heartbeat timeout</dt><dd>", spec.heartbeat_timeout_ms(), " ms</dd>",
      "<dt>created</dt><dd>", HtmlEscape(TimeText(j.created_unix_ms())), "</dd></dl>");
  for (const std::string& w : j.warnings()) {
    absl::StrAppend(&body, "<p class=\"lagging\">warning: ", HtmlEscape(w), "</p>");
  }

  // Members.
  absl::StrAppend(&body, "<h2>Members</h2>");
  if (j.members_omitted()) {
    absl::StrAppend(&body, "<p class=\"note\">Too many members to list.</p>");
  } else {
    // Sharded replicas: the members grouped by replica, each group under a row naming it.
    const int32_t replica_size = std::max(1, spec.replica_size());
    absl::StrAppend(&body,
                    "<table id=\"members\"><tr><th>rank</th><th>worker</th><th>host</th>"
                    "<th>state</th><th>step</th><th>lag</th><th>ms since heartbeat</th>"
                    "<th>admitted at step</th><th>joined generation</th></tr>");
    int32_t replica_shown = -1;
    int shown = 0;
    const int64_t leader = j.max_step();
    const int64_t lag_alarm = std::max<int64_t>(2, spec.levels_size() > 0
                                                       ? spec.levels(0).period()
                                                       : 2);
    std::vector<bool> listed(spec.world_size(), false);
    for (const v1::Member& m : j.members()) {
      if (shown++ >= options_.max_member_rows) break;
      if (m.rank() >= 0 && m.rank() < spec.world_size()) listed[m.rank()] = true;
      if (replica_size > 1 && m.replica() != replica_shown) {
        replica_shown = m.replica();
        absl::StrAppend(&body, "<tr class=\"replica\" data-replica=\"", m.replica(),
                        "\"><th colspan=\"9\">replica ", m.replica(), " (ranks ",
                        m.replica() * replica_size, "..", m.replica() * replica_size +
                        replica_size - 1, ")</th></tr>");
      }
      const std::string state = v1::MemberState_Name(m.state());
      // A retired member: which rank's loss retired its replica.
      const std::string why = m.state() == v1::RETIRED
                                  ? absl::StrCat(" (rank ", m.retired_by(), " lost)")
                                  : std::string();
      // Lag behind the leader, for the members of the current generation.
      const int64_t lag = (m.state() == v1::ALIVE && m.generation() == j.generation() &&
                           m.last_step() >= 0 && leader >= 0)
                              ? leader - m.last_step()
                              : -1;
      absl::StrAppend(
          &body, "<tr class=\"member", m.state() == v1::DEAD ? " dead" : "", "\" data-rank=\"",
          m.rank(), "\">", TdNum(m.rank()),
          Td(m.worker_id()), Td(m.host()), "<td>", StateSpan(state), why, "</td>",
          TdStep(m.last_step()),
          lag < 0 ? std::string("<td class=\"num\">&ndash;</td>")
                  : absl::StrCat("<td class=\"num", lag > lag_alarm ? " lagging" : "", "\">",
                                 lag, "</td>"),
          TdNum(m.ms_since_heartbeat()), TdStep(m.admitted_step()), TdNum(m.generation()),
          "</tr>");
    }
    for (int32_t r : j.vacant_ranks()) {
      if (r >= 0 && r < spec.world_size() && listed[r]) continue;  // its departed member shows
      absl::StrAppend(&body, "<tr class=\"vacant\">", TdNum(r),
                      "<td colspan=\"2\">(no live worker)</td><td>", StateSpan("VACANT"),
                      "</td><td colspan=\"5\"></td></tr>");
    }
    absl::StrAppend(&body, "</table>");
    if (j.members_size() > options_.max_member_rows) {
      absl::StrAppend(&body, "<p class=\"note\">", j.members_size() - options_.max_member_rows,
                      " more members not shown (modelavg job ID --json lists them all).</p>");
    }
  }

  // The schedule.
  absl::StrAppend(&body, "<h2>Next averaging steps</h2>");
  absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(spec);
  absl::StatusOr<Schedule> schedule =
      schedule_spec.ok() ? Schedule::Create(*schedule_spec) : schedule_spec.status();
  if (schedule.ok()) {
    const int64_t from = std::max<int64_t>(0, j.max_step() + 1);
    // The plan shown holds until a pending plan's switch step.
    const int64_t until = j.has_pending_plan() ? j.pending_plan().switch_step()
                                               : std::numeric_limits<int64_t>::max();
    std::string listing;
    const std::string svg = Timeline(*schedule, from, options_.timeline_search_steps, until,
                                     options_.timeline_max_marks, &listing);
    absl::StrAppend(&body, "<p class=\"note\">From step ", from,
                    " (after the leader's last step)",
                    j.has_pending_plan()
                        ? absl::StrCat(" to step ", until - 1, ", under the plan in force; plan "
                                       "version ", j.pending_plan().version(),
                                       " takes over at step ", until)
                        : std::string(),
                    ".</p>", svg, listing);
  } else {
    absl::StrAppend(&body, "<p>", HtmlEscape(std::string(schedule.status().message())), "</p>");
  }

  // Plan history (UpdateJob, docs/plan-updates.md), newest first.
  absl::StrAppend(&body,
                  "<h2>Plan history</h2><table id=\"plans\"><tr><th>version</th>"
                  "<th>from step</th><th>accepted</th><th>status</th><th>plan</th></tr>");
  for (auto it = j.plan_history().rbegin(); it != j.plan_history().rend(); ++it) {
    const bool pending = j.has_pending_plan() && it->version() >= j.pending_plan().version();
    const char* status = pending                               ? "pending"
                         : it->version() == j.plan_version() ? "in force"
                                                               : "past";
    absl::StrAppend(&body, "<tr class=\"plan\" data-version=\"", it->version(), "\">",
                    TdNum(it->version()), TdNum(it->switch_step()),
                    Td(TimeText(it->version() == 0 ? j.created_unix_ms() : it->unix_ms())),
                    Td(status), Td(PlanText(it->spec())), "</tr>");
  }
  absl::StrAppend(&body, "</table>");

  // Generation history, newest first.
  absl::StrAppend(&body,
                  "<h2>Generation history</h2><table id=\"generations\"><tr><th>generation</th>"
                  "<th>reason</th><th>rank</th><th>when</th></tr>");
  if (generations.empty() && j.has_last_change()) {
    const v1::GenerationChange& c = j.last_change();
    absl::StrAppend(&body, "<tr>", TdNum(c.generation()), Td(c.reason()),
                    c.rank() < 0 ? Td("") : TdNum(c.rank()), Td(TimeText(c.unix_ms())),
                    "</tr>");
  }
  for (auto it = generations.rbegin(); it != generations.rend(); ++it) {
    absl::StrAppend(&body, "<tr>", TdNum(it->generation()), Td(it->reason()),
                    it->rank() < 0 ? Td("") : TdNum(it->rank()), Td(TimeText(it->unix_ms())),
                    "</tr>");
  }
  absl::StrAppend(&body, "</table>");

  // Recent events, newest first.
  absl::StrAppend(&body,
                  "<h2>Recent events</h2><table id=\"events\"><tr><th>when</th><th>event</th>"
                  "<th>rank</th><th>generation</th><th>message</th></tr>");
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    absl::StrAppend(&body, "<tr>", Td(TimeText(it->unix_ms)), Td(EventKindName(it->kind)),
                    it->rank < 0 ? Td("") : TdNum(it->rank), TdNum(it->generation),
                    Td(it->message), "</tr>");
  }
  absl::StrAppend(&body, "</table><p class=\"note\">History since the coordinator started; ",
                  "as of ", HtmlEscape(TimeText(absl::ToUnixMillis(registry_->clock()->Now()))),
                  ".</p></div>");
  return Page(200, absl::StrCat("job ", spec.job_id()), body);
}

}  // namespace modelavg::server
