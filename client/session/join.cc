#include "client/session/join.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/strings/str_join.h"
#include "client/heartbeat/heartbeat_relay.h"
#include "client/rpc/coordinator_client.h"
#include "client/session/retry_wait.h"
#include "common/job_spec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

constexpr int64_t kMaxScheduleWindow = 100000;
// Used when the coordinator does not say (it always does after defaults).
constexpr absl::Duration kFallbackHeartbeatTimeout = absl::Seconds(3);

// `bytes` random bytes from the system's CSPRNG, in hex.
std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      // No CSPRNG: the nonce is then only as good as the clock and the pid (a retry after a
      // lost reply still works; a thief needs to guess it within the join).
      const uint64_t fallback = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
                                (static_cast<uint64_t>(getpid()) << 32);
      std::memcpy(raw.data(), &fallback, std::min(bytes, sizeof(fallback)));
      break;
    }
  }
  return absl::BytesToHexString(raw);
}

// Join, retried with backoff while the coordinator is unreachable, until join_timeout.
absl::StatusOr<v1::JoinResponse> JoinWithRetry(CoordinatorClient& coordinator,
                                               const v1::JoinRequest& join,
                                               const ClientOptions& options,
                                               const Clock& clock) {
  const absl::Time deadline = clock.Now() + options.join_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Time next_warning = clock.Now();
  while (true) {
    const absl::Duration left = std::max(absl::Milliseconds(1), deadline - clock.Now());
    absl::StatusOr<v1::JoinResponse> reply = coordinator.Join(join, left, options.cancel.get());
    if (reply.ok()) return reply;
    const absl::Status& s = reply.status();
    if (options.cancel != nullptr && options.cancel->cancelled()) {
      return absl::CancelledError(absl::StrCat("joining job ", options.job_id,
                                               ": cancelled (ClientOptions.cancel)"));
    }
    if (absl::IsDeadlineExceeded(s) && clock.Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "joining job ", options.job_id, ": the world did not complete within "
          "ClientOptions.join_timeout (", absl::FormatDuration(options.join_timeout),
          "); GetJob shows which ranks have joined: ", s.message()));
    }
    if (!absl::IsUnavailable(s)) return s;
    if (clock.Now() + backoff >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", options.coordinator, " within ",
          absl::FormatDuration(options.join_timeout),
          " (is it running, and is ClientOptions.coordinator its host:port?): ", s.message()));
    }
    if (clock.Now() >= next_warning) {
      // UNAVAILABLE: the coordinator unreachable, or its answer to retry (a full job whose
      // member's stream just broke, a pace not measured yet, a recovery in progress).
      spdlog::warn("joining job {} at {}: {}; retrying until the join timeout", options.job_id,
                   options.coordinator, std::string(s.message()));
      next_warning = clock.Now() + absl::Seconds(5);
    }
    SleepUnlessCancelled(clock, options.cancel.get(), backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

// The checks of a Join reply: a spec this client can use, a rank of its world, and the
// subgroups the local schedule gives.
absl::StatusOr<Schedule> CheckReply(const v1::JoinResponse& joined) {
  absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(joined.spec());
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the coordinator sent a job spec this client cannot use: ", spec.status().message()));
  }
  MODELAVG_ASSIGN_OR_RETURN(Schedule schedule, Schedule::Create(*std::move(spec)));
  if (joined.world_size() != schedule.world_size() || joined.rank() < 0 ||
      joined.rank() >= schedule.world_size()) {
    return absl::InternalError(absl::StrCat("the coordinator's Join reply is inconsistent: rank ",
                                            joined.rank(), ", world size ", joined.world_size(),
                                            ", spec world size ", schedule.world_size()));
  }
  // The subgroups the coordinator computed must be the ones the local schedule gives (their
  // ranks where the reply lists them: a coordinator that predates subgroup_ranks_from_spec does).
  for (const v1::Subgroup& g : joined.subgroups()) {
    if (g.level() < 0 || g.level() >= schedule.num_levels()) continue;
    const SubgroupRange mine = schedule.SubgroupOf(g.level(), joined.rank());
    if (g.subgroup() != mine.index ||
        (g.ranks_size() > 0 &&
         std::vector<int32_t>(g.ranks().begin(), g.ranks().end()) != mine.Ranks())) {
      return absl::InternalError(absl::StrCat(
          "the coordinator's subgroup at level ", g.level(), " (", g.subgroup(), ": ",
          absl::StrJoin(g.ranks(), ","), ") differs from the local schedule's (", mine.index,
          "); client and coordinator versions disagree"));
    }
  }
  return schedule;
}

}  // namespace

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

absl::StatusOr<double> TokensPerStepFromEnvironment(double fallback) {
  const char* v = std::getenv("MODELAVG_TOKENS_PER_STEP");
  if (v == nullptr || *v == '\0') return fallback;
  double tokens = 0;
  if (!absl::SimpleAtod(v, &tokens) || !std::isfinite(tokens) || tokens <= 0 ||
      tokens > kMaxTokensPerStep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MODELAVG_TOKENS_PER_STEP=", v,
        ": the tokens of one local step are a finite number in (0, 1e12] (default 1)"));
  }
  return tokens;
}

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.coordinator.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.coordinator is empty: set it to the coordinator's host:port");
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(ValidateJobId(o.job_id), "ClientOptions.job_id"));
  if (o.expected_world_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.expected_world_size is ",
                                                   o.expected_world_size,
                                                   ": a world size is >= 1 (0: any)"));
  }
  if (o.rank.has_value() && *o.rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.rank is ", *o.rank, ": a rank is >= 0 (or leave it unset)"));
  }
  if (o.join_timeout <= absl::ZeroDuration() || o.rpc_timeout <= absl::ZeroDuration() ||
      o.heartbeat_interval <= absl::ZeroDuration() ||
      o.collective_timeout <= absl::ZeroDuration() ||
      o.coordinator_outage_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "ClientOptions: join_timeout, rpc_timeout, heartbeat_interval, collective_timeout and "
        "coordinator_outage_timeout must all be positive");
  }
  if (o.leave_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "ClientOptions.leave_timeout is negative: it is how long Leave retries through a "
        "coordinator outage (0: one attempt)");
  }
  if (o.schedule_window < 1 || o.schedule_window > kMaxScheduleWindow) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.schedule_window is ",
                                                   o.schedule_window, ": it must be in 1..",
                                                   kMaxScheduleWindow));
  }
  if (!std::isfinite(o.tokens_per_step) || o.tokens_per_step <= 0 ||
      o.tokens_per_step > kMaxTokensPerStep) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.tokens_per_step is ", o.tokens_per_step,
        ": the tokens of one local step are a finite number in (0, 1e12] (default 1)"));
  }
  if (!o.heartbeat_relay_dir.empty()) {
    // (The key does not matter here: only the directory is checked.)
    MODELAVG_RETURN_IF_ERROR(
        Annotate(RelayPathsFor(o.heartbeat_relay_dir, "").status(), "ClientOptions"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Joined> JoinJob(CoordinatorClient& coordinator, const ClientOptions& options,
                               const std::string& host, const Clock& clock) {
  v1::JoinRequest join;
  join.set_job_id(options.job_id);
  join.set_worker_id(options.worker_id);
  join.set_host(host);
  if (options.rank.has_value()) join.set_rank(*options.rank);
  join.set_world_size(options.expected_world_size);
  join.set_credential(options.credential);
  // A paced level weighs this member's rounds by it (1 is the wire's default too: 0 means 1).
  join.set_tokens_per_step(options.tokens_per_step);
  // Sent again with every retry: it alone proves a retry after a lost reply (the worker id is
  // public).
  join.set_join_nonce(RandomHex(16));
  // The subgroups come from the spec (CheckReply): the reply need not list their ranks, which
  // at the top level of a large world are the whole world in every rank's reply.
  join.set_subgroup_ranks_from_spec(true);
  spdlog::info("joining job {} at {} as {}{}", options.job_id, options.coordinator,
               options.worker_id,
               options.rank ? absl::StrCat(" (rank ", *options.rank, ")") : std::string());
  MODELAVG_ASSIGN_OR_RETURN(v1::JoinResponse reply,
                            JoinWithRetry(coordinator, join, options, clock));
  MODELAVG_ASSIGN_OR_RETURN(Schedule schedule, CheckReply(reply));
  Joined joined{schedule, PlanHistory(schedule)};
  for (const v1::PlanChange& c : reply.plan_changes()) {
    absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(c.spec());
    absl::StatusOr<Schedule> plan =
        spec.ok() ? Schedule::Create(*std::move(spec)) : absl::StatusOr<Schedule>(spec.status());
    absl::Status added = plan.ok() ? joined.plans.Add(*std::move(plan), c.switch_step())
                                   : plan.status();
    if (!added.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the coordinator sent plan version ", c.version(), " of job ", options.job_id,
          " that this client cannot use: ", added.message()));
    }
  }
  joined.rank = reply.rank();
  joined.generation = reply.generation();
  joined.heartbeat_timeout = reply.heartbeat_timeout_ms() > 0
                                 ? absl::Milliseconds(reply.heartbeat_timeout_ms())
                                 : kFallbackHeartbeatTimeout;
  joined.incarnation = reply.coordinator_incarnation();
  joined.credential = reply.credential();
  joined.elastic = reply.spec().min_world_size() > 0 &&
                   reply.spec().min_world_size() < reply.spec().world_size();
  spdlog::info("joined job {}: rank {} of {}, generation {}", options.job_id, reply.rank(),
               reply.world_size(), reply.generation());
  if (reply.admission_step() > 0) {
    joined.admission_step = reply.admission_step();
    spdlog::info("rank {} joined job {} as a replacement: admitted at step {}", reply.rank(),
                 options.job_id, reply.admission_step());
  }
  return joined;
}

absl::StatusOr<MembershipView> ReadAdmission(CoordinatorClient& coordinator,
                                             const std::string& job_id,
                                             const ViewReader& reader) {
  absl::StatusOr<v1::Job> job = coordinator.GetJob(job_id);
  if (!job.ok()) return Annotate(job.status(), "reading the job a replacement was admitted to");
  std::string why;
  std::optional<MembershipView> view = ViewOf(*job, reader, &why);
  if (!view.has_value()) {
    return absl::AbortedError(absl::StrCat("job ", job_id, " changed while rank ", reader.rank,
                                           " was being admitted (", why,
                                           "); start the replacement again"));
  }
  return *std::move(view);
}

}  // namespace modelavg::client
