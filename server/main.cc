// modelavg-coordinator: the coordinator daemon. See the README's "Coordinator" section.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/job_spec.h"
#include "common/logging.h"
#include "server/coordinator_server.h"
#include "server/jobs_file.h"
#include "server/rpc/service_auth.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "Address to serve on, HOST:PORT (port 0: any).");
ABSL_FLAG(std::string, port_file, "",
          "Once serving, write the bound HOST:PORT to this file (for scripts and tests).");
ABSL_FLAG(std::string, jobs_file, "",
          "Jobs to create at start-up: JSON or protobuf text format of JobSpecList "
          "({\"jobs\": [JobSpec, ...]}) or of one JobSpec.");
ABSL_FLAG(std::string, metrics_listen, "",
          "Serve Prometheus metrics on http://HOST:PORT/metrics and the status page on "
          "http://HOST:PORT/ (empty: off; port 0: any).");
ABSL_FLAG(std::string, metrics_port_file, "",
          "Once serving, write the metrics endpoint's bound HOST:PORT to this file (needs "
          "--metrics_listen).");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a token; every RPC then needs metadata 'authorization: Bearer <token>'.");
ABSL_FLAG(std::string, worker_token_file, "",
          "File of worker role tokens (needs --auth_token_file, which then holds the "
          "operator's): enough for Join and the calls of a member, and reads; not CreateJob or "
          "DeleteJob. One token a line, alone (every job) or followed by the jobs it may use: "
          "\"TOKEN job-a,job-b,team-*\".");
ABSL_FLAG(int64_t, max_request_bytes, 1 << 20,
          "The largest request message the gRPC port reads; each method takes at most the "
          "smaller of this and its own bound (64 KiB for most). In [4096, 2^30].");
ABSL_FLAG(int64_t, rpc_memory_quota_mb, 1024,
          "gRPC's memory quota (its connections' buffers and calls), MiB; near it gRPC reads less "
          "per connection, past it closes connections (clients retry). 0: none; else >= 16.");
ABSL_FLAG(int64_t, rpc_handshake_timeout_ms, 10000,
          "A gRPC connection that has not finished its TLS and HTTP/2 handshake in this long is "
          "closed. In [100, 600000].");
ABSL_FLAG(int32_t, rpc_max_connections, 0,
          "The gRPC port's most connections at once; its next ones are closed at once. 0: as "
          "many as the limit on open files leaves after the HTTP port's connections and a "
          "reserve of 64 (a larger value that does not fit is refused at start).");
ABSL_FLAG(int32_t, rpc_max_connections_per_client, 512,
          "The gRPC port's most connections at once from one client address (at most "
          "--rpc_max_connections); its next ones are closed at once. At least 1.");
ABSL_FLAG(int64_t, rpc_schedule_bytes_per_client, int64_t{64} << 20,
          "The most bytes of GetSchedule answers one client address may have in flight (built, "
          "not yet sent) at once; past it an answer is refused RESOURCE_EXHAUSTED. At least "
          "4177920 (the largest answer).");
ABSL_FLAG(int64_t, rpc_accept_probe_interval_ms, 5000,
          "How often the coordinator opens a new connection to its own gRPC port to check that "
          "a new client is taken; while one is not, health says NOT_SERVING and the metric "
          "modelavg_grpc_accepting is 0. In [100, 600000].");
ABSL_FLAG(int32_t, http_max_connections, 1024,
          "The HTTP port's most connections at once. In [1, 65536].");
ABSL_FLAG(int32_t, http_max_connections_per_client, 32,
          "The HTTP port's most connections at once from one client address; its next ones are "
          "closed at once. In [1, --http_max_connections].");
ABSL_FLAG(int64_t, http_request_timeout_ms, 10000,
          "How long an HTTP client has to send a whole request and take its reply (from when it "
          "connected or got its previous reply); past it the connection is closed, however "
          "steadily it sends. In [100, 600000].");
ABSL_FLAG(int64_t, metrics_cache_ms, 1000,
          "One /metrics exposition serves every scrape for this long (its cost grows with jobs x "
          "ranks; many scrapers then cost one). 0: made for each scrape. In [0, 60000].");
ABSL_FLAG(bool, metrics_need_token, false,
          "/metrics needs the operator token (--auth_token_file) as \"Authorization: Bearer\" "
          "(Prometheus: authorization.credentials_file).");
ABSL_FLAG(bool, metrics_tls, false,
          "Serve the HTTP port (--metrics_listen) over TLS with --tls_cert and --tls_key; the "
          "status page's login cookie is then Secure.");
ABSL_FLAG(int64_t, login_ttl_minutes, 720,
          "How long a status page login (its session cookie) lasts. In [1, 44640].");
ABSL_FLAG(std::string, tls_operator_names, "",
          "Mutual TLS: comma-separated names (subject CN or SAN); client certificates naming one "
          "are operators, other verified ones workers. Empty: every verified client is an "
          "operator.");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error, critical or off.");
ABSL_FLAG(int64_t, default_heartbeat_timeout_ms, 3000,
          "Heartbeat timeout of jobs whose spec says 0.");
ABSL_FLAG(int64_t, default_join_timeout_ms, 300000, "Join timeout of jobs whose spec says 0.");
ABSL_FLAG(std::string, state_dir, "",
          "Keep every job's state in SQLite under this directory (created 0700) and continue the "
          "stored jobs on a restart. Empty: in memory only (a restart forgets every job).");
ABSL_FLAG(bool, require_state, false,
          "With --state_dir: refuse to start (exit 2) when the directory or its state file is "
          "missing, instead of starting with no jobs. For restarts of a coordinator whose state "
          "must exist (Kubernetes: set it once the first start has made the state).");
ABSL_FLAG(int64_t, recovery_grace_ms, 10000,
          "After a restart with --state_dir: how long the members of a running job have to "
          "re-attach (their next heartbeat) before any is declared dead; at least the job's "
          "heartbeat timeout. In (0, 3600000].");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "Keep every job's state in etcd (HOST:PORT[,HOST:PORT...], its v3 gRPC API) and serve "
          "only while elected leader among the coordinators on the same endpoints and prefix; a "
          "standby answers UNAVAILABLE naming the leader (see docs/high-availability.md). "
          "Excludes --state_dir.");
ABSL_FLAG(std::string, etcd_prefix, "/modelavg/", "The etcd keys' prefix (ends with '/').");
ABSL_FLAG(int64_t, leader_ttl_ms, 5000,
          "With --etcd_endpoints: the leader's etcd lease TTL (whole seconds, at least 2 s); a "
          "standby takes over about this long after the leader is lost. In [1000, 600000].");
ABSL_FLAG(std::string, advertise, "",
          "With --etcd_endpoints: the HOST:PORT clients dial this coordinator at, which standbys "
          "name; empty: the bound address.");
ABSL_FLAG(std::string, etcd_tls_ca, "",
          "PEM CA bundle that signed the etcd members' certificates: talk TLS to etcd.");
ABSL_FLAG(std::string, etcd_tls_cert, "", "PEM client certificate for etcd (with --etcd_tls_key).");
ABSL_FLAG(std::string, etcd_tls_key, "", "PEM private key for --etcd_tls_cert.");
ABSL_FLAG(std::string, etcd_user, "", "etcd user (etcd auth; with --etcd_password_file).");
ABSL_FLAG(std::string, etcd_password_file, "", "File holding the password of --etcd_user.");

namespace {

constexpr absl::Duration kShutdownDeadline = absl::Milliseconds(1000);

int Fail(const std::string& what) {
  std::fprintf(stderr, "modelavg-coordinator: %s\n", what.c_str());
  return 2;
}

// Every connection (gRPC, HTTP) and the state files take a file descriptor. A service started
// with the common soft limit of 1024 would stop accepting connections (workers, Prometheus, the
// operator's CLI) once about a thousand are open, which one client opening idle connections
// reaches in a second; the hard limit is the bound meant for it, so the soft one is raised to
// it.
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::debug("open file limit raised from {} to its hard limit {}", before, limit.rlim_max);
  } else {
    spdlog::warn("open file limit is {}; raising it to the hard limit {} failed: {} (clients "
                 "opening many connections can exhaust it)",
                 before, limit.rlim_max, std::strerror(errno));
  }
}

// Set (once) when the coordinator cannot go on (CoordinatorServerOptions::on_fatal); main exits
// with it.
std::mutex fatal_mu;
std::string fatal_error;

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "modelavg-coordinator --listen=HOST:PORT [--state_dir=DIR | --etcd_endpoints=H:P,...] "
      "[--jobs_file=F] "
      "[--metrics_listen=HOST:PORT] "
      "[--tls_cert=F --tls_key=F [--tls_client_ca=F]] [--auth_token_file=F "
      "[--worker_token_file=F]] [--log_level=info]");
  // --help lists the flags of this file. (Abseil's default lists those defined in a file named
  // like the program, modelavg-coordinator.cc, so --help would list none.) Matched by the end of
  // the path: the name Abseil keeps is __FILE__ normalized (no leading "/" or "./"), and __FILE__
  // is absolute or relative as the build passed it.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return file == "main.cc" || absl::EndsWith(file, "/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  // Lock-order cycle detection (on in this Abseil build) costs a graph update per lock on every
  // RPC; the unit tests run with it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::Status s = modelavg::InitLogging(absl::GetFlag(FLAGS_log_level), "coordinator");
      !s.ok()) {
    return Fail(std::string(s.message()));
  }
  modelavg::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  const int64_t hb = absl::GetFlag(FLAGS_default_heartbeat_timeout_ms);
  const int64_t join = absl::GetFlag(FLAGS_default_join_timeout_ms);
  if (hb < modelavg::kMinHeartbeatTimeoutMs || hb > modelavg::kMaxHeartbeatTimeoutMs ||
      join < modelavg::kMinJoinTimeoutMs || join > modelavg::kMaxJoinTimeoutMs) {
    return Fail(absl::StrCat(
        "--default_heartbeat_timeout_ms must be in [", modelavg::kMinHeartbeatTimeoutMs,
        ", 3600000] (members beat every 100 ms; a shorter timeout declares live members dead at "
        "the first late beat) and --default_join_timeout_ms in [",
        modelavg::kMinJoinTimeoutMs, ", 86400000]"));
  }
  options.defaults.heartbeat_timeout = absl::Milliseconds(hb);
  const int64_t grace = absl::GetFlag(FLAGS_recovery_grace_ms);
  if (grace <= 0 || grace > 3600000) return Fail("--recovery_grace_ms must be in (0, 3600000]");
  options.recovery_grace = absl::Milliseconds(grace);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.require_state = absl::GetFlag(FLAGS_require_state);
  options.defaults.join_timeout = absl::Milliseconds(join);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!absl::GetFlag(FLAGS_metrics_port_file).empty() && options.metrics_listen.empty()) {
    return Fail("--metrics_port_file needs --metrics_listen (e.g. --metrics_listen=127.0.0.1:0)");
  }
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = modelavg::ReadTokenFile(path);
    if (!token.ok()) return Fail(absl::StrCat("--auth_token_file: ", token.status().message()));
    options.auth_token = *std::move(token);
  }
  if (const std::string path = absl::GetFlag(FLAGS_worker_token_file); !path.empty()) {
    absl::StatusOr<std::string> text = modelavg::ReadFileToString(path);
    absl::StatusOr<std::vector<modelavg::server::WorkerToken>> tokens =
        text.ok() ? modelavg::server::ParseWorkerTokenFile(*text, path) : text.status();
    if (!tokens.ok()) {
      return Fail(absl::StrCat("--worker_token_file: ", tokens.status().message()));
    }
    options.worker_tokens = *std::move(tokens);
  }
  // The bounds on what a client can hold (docs/operations.md, "Hostile clients").
  const int64_t max_request = absl::GetFlag(FLAGS_max_request_bytes);
  if (max_request < 4096 || max_request > (int64_t{1} << 30)) {
    return Fail("--max_request_bytes must be in [4096, 1073741824]");
  }
  options.max_request_bytes = static_cast<size_t>(max_request);
  const int64_t quota_mb = absl::GetFlag(FLAGS_rpc_memory_quota_mb);
  if (quota_mb != 0 && (quota_mb < 16 || quota_mb > (int64_t{1} << 22))) {
    return Fail("--rpc_memory_quota_mb must be 0 (none) or in [16, 4194304]");
  }
  options.rpc_memory_quota_bytes = quota_mb << 20;
  const int64_t handshake_ms = absl::GetFlag(FLAGS_rpc_handshake_timeout_ms);
  if (handshake_ms < 100 || handshake_ms > 600000) {
    return Fail("--rpc_handshake_timeout_ms must be in [100, 600000]");
  }
  options.rpc_handshake_timeout = absl::Milliseconds(handshake_ms);
  options.rpc_max_connections = absl::GetFlag(FLAGS_rpc_max_connections);
  options.rpc_max_connections_per_client = absl::GetFlag(FLAGS_rpc_max_connections_per_client);
  if (options.rpc_max_connections < 0 || options.rpc_max_connections_per_client < 1) {
    return Fail("--rpc_max_connections must be 0 (from the limit on open files) or positive, "
                "and --rpc_max_connections_per_client at least 1");
  }
  options.rpc_schedule_bytes_per_client = absl::GetFlag(FLAGS_rpc_schedule_bytes_per_client);
  const int64_t probe_ms = absl::GetFlag(FLAGS_rpc_accept_probe_interval_ms);
  if (probe_ms < 100 || probe_ms > 600000) {
    return Fail("--rpc_accept_probe_interval_ms must be in [100, 600000]");
  }
  options.rpc_accept_probe_interval = absl::Milliseconds(probe_ms);
  options.http_max_connections = absl::GetFlag(FLAGS_http_max_connections);
  options.http_max_connections_per_client = absl::GetFlag(FLAGS_http_max_connections_per_client);
  if (options.http_max_connections < 1 || options.http_max_connections > 65536 ||
      options.http_max_connections_per_client < 1 ||
      options.http_max_connections_per_client > options.http_max_connections) {
    return Fail("--http_max_connections must be in [1, 65536] and "
                "--http_max_connections_per_client in [1, --http_max_connections]");
  }
  const int64_t request_ms = absl::GetFlag(FLAGS_http_request_timeout_ms);
  if (request_ms < 100 || request_ms > 600000) {
    return Fail("--http_request_timeout_ms must be in [100, 600000]");
  }
  options.http_request_timeout = absl::Milliseconds(request_ms);
  const int64_t cache_ms = absl::GetFlag(FLAGS_metrics_cache_ms);
  if (cache_ms < 0 || cache_ms > 60000) return Fail("--metrics_cache_ms must be in [0, 60000]");
  options.metrics_cache = absl::Milliseconds(cache_ms);
  options.metrics_need_token = absl::GetFlag(FLAGS_metrics_need_token);
  options.http_tls = absl::GetFlag(FLAGS_metrics_tls);
  if (options.http_tls && options.metrics_listen.empty()) {
    return Fail("--metrics_tls needs --metrics_listen");
  }
  const int64_t login_minutes = absl::GetFlag(FLAGS_login_ttl_minutes);
  if (login_minutes < 1 || login_minutes > 44640) {
    return Fail("--login_ttl_minutes must be in [1, 44640] (a month)");
  }
  options.http_session_ttl = absl::Minutes(login_minutes);
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_tls_operator_names), ',', absl::SkipWhitespace())) {
    options.operator_cert_names.emplace_back(absl::StripAsciiWhitespace(name));
  }
  options.etcd_endpoints = absl::GetFlag(FLAGS_etcd_endpoints);
  options.etcd_prefix = absl::GetFlag(FLAGS_etcd_prefix);
  const int64_t ttl = absl::GetFlag(FLAGS_leader_ttl_ms);
  if (ttl < 1000 || ttl > 600000) return Fail("--leader_ttl_ms must be in [1000, 600000]");
  options.leader_ttl = absl::Milliseconds(ttl);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.etcd_tls_ca_file = absl::GetFlag(FLAGS_etcd_tls_ca);
  options.etcd_tls_cert_file = absl::GetFlag(FLAGS_etcd_tls_cert);
  options.etcd_tls_key_file = absl::GetFlag(FLAGS_etcd_tls_key);
  options.etcd_user = absl::GetFlag(FLAGS_etcd_user);
  if (const std::string path = absl::GetFlag(FLAGS_etcd_password_file); !path.empty()) {
    absl::StatusOr<std::string> password = modelavg::ReadTokenFile(path);
    if (!password.ok()) {
      return Fail(absl::StrCat("--etcd_password_file: ", password.status().message()));
    }
    options.etcd_password = *std::move(password);
  }
  if (const std::string path = absl::GetFlag(FLAGS_jobs_file); !path.empty()) {
    absl::StatusOr<std::string> text = modelavg::ReadFileToString(path);
    if (!text.ok()) return Fail(absl::StrCat("--jobs_file: ", text.status().message()));
    absl::StatusOr<std::vector<modelavg::v1::JobSpec>> jobs =
        modelavg::server::ParseJobsFile(*text, path);
    if (!jobs.ok()) return Fail(std::string(jobs.status().message()));
    options.jobs = *std::move(jobs);
  }

  // SIGTERM/SIGINT are taken synchronously by this thread; every thread started below inherits
  // the blocked mask, so no handler runs at an arbitrary point.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // etcd refused this coordinator's options for good: shut down as on SIGTERM, then exit 2.
  options.on_fatal = [](const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(fatal_mu);
      fatal_error = std::string(status.message());
    }
    kill(getpid(), SIGTERM);
  };
  RaiseOpenFileLimit();
  absl::StatusOr<std::unique_ptr<modelavg::server::CoordinatorServer>> server =
      modelavg::server::CoordinatorServer::Start(options);
  if (!server.ok()) return Fail(server.status().ToString());
  // Written whole under a temporary name, then renamed: readers never see half a line.
  auto write_address = [](const std::string& path, const std::string& address) {
    const std::string tmp = absl::StrCat(path, ".tmp");
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << address << "\n";
      if (!out) return false;
    }
    return std::rename(tmp.c_str(), path.c_str()) == 0;
  };
  // The metrics address first: a script that saw --port_file may read both.
  if (const std::string path = absl::GetFlag(FLAGS_metrics_port_file); !path.empty()) {
    if (!write_address(path, (*server)->metrics_address())) {
      return Fail(absl::StrCat("cannot write --metrics_port_file ", path));
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    if (!write_address(path, (*server)->address())) {
      return Fail(absl::StrCat("cannot write --port_file ", path));
    }
  }
  int sig = 0;
  sigwait(&signals, &sig);
  std::string fatal;
  {
    std::lock_guard<std::mutex> lock(fatal_mu);
    fatal = fatal_error;
  }
  if (fatal.empty()) {
    spdlog::info("received {}; shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  } else {
    spdlog::error("cannot go on ({}); shutting down", fatal);
  }
  // A deadline on shutdown: whatever is still in flight, the process is gone within about a
  // second (waits are failed first and calls poll their cancellation, so this rarely fires).
  std::thread([code = fatal.empty() ? 0 : 2] {
    absl::SleepFor(kShutdownDeadline);
    spdlog::error("shutdown passed its {} ms deadline; exiting with calls still in flight",
                  absl::ToInt64Milliseconds(kShutdownDeadline));
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }).detach();
  (*server)->Shutdown();
  if (!fatal.empty()) return Fail(fatal);
  return 0;
}
