#include "modelavg/client/client.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/gloo/gloo_mesh.h"  // IgnoreDefaultSigpipe
#include "client/heartbeat/heartbeat.h"
#include "client/heartbeat/heartbeat_relay.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "client/session/backends.h"
#include "client/session/decision_window.h"
#include "client/session/round_notes.h"
#include "common/job_spec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

constexpr int64_t kMaxScheduleWindow = 100000;
// Used when the coordinator does not say (it always does after defaults).
constexpr absl::Duration kFallbackHeartbeatTimeout = absl::Seconds(3);

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
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
  if (!o.heartbeat_relay_dir.empty()) {
    // (The key does not matter here: only the directory is checked.)
    MODELAVG_RETURN_IF_ERROR(
        Annotate(RelayPathsFor(o.heartbeat_relay_dir, "").status(), "ClientOptions"));
  }
  return absl::OkStatus();
}

// Join, retried with backoff while the coordinator is unreachable, until join_timeout.
absl::StatusOr<v1::JoinResponse> JoinWithRetry(CoordinatorClient& coordinator,
                                               const v1::JoinRequest& join,
                                               const ClientOptions& options) {
  const absl::Time deadline = absl::Now() + options.join_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  absl::Time next_warning = absl::Now();
  while (true) {
    const absl::Duration left = std::max(absl::Milliseconds(1), deadline - absl::Now());
    absl::StatusOr<v1::JoinResponse> reply = coordinator.Join(join, left, options.cancel.get());
    if (reply.ok()) return reply;
    const absl::Status& s = reply.status();
    if (options.cancel != nullptr && options.cancel->cancelled()) {
      return absl::CancelledError(absl::StrCat("joining job ", options.job_id,
                                               ": cancelled (ClientOptions.cancel)"));
    }
    if (absl::IsDeadlineExceeded(s) && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "joining job ", options.job_id, ": the world did not complete within "
          "ClientOptions.join_timeout (", absl::FormatDuration(options.join_timeout),
          "); GetJob shows which ranks have joined: ", s.message()));
    }
    if (!absl::IsUnavailable(s)) return s;
    if (absl::Now() + backoff >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach the coordinator at ", options.coordinator, " within ",
          absl::FormatDuration(options.join_timeout),
          " (is it running, and is ClientOptions.coordinator its host:port?): ", s.message()));
    }
    if (absl::Now() >= next_warning) {
      spdlog::warn("coordinator {} unreachable ({}); retrying until the join timeout",
                   options.coordinator, std::string(s.message()));
      next_warning = absl::Now() + absl::Seconds(5);
    }
    SleepUnlessCancelled(options.cancel.get(), backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  return Connect(std::move(options), nullptr);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    ClientOptions options, std::unique_ptr<CommunicatorFactory> communicators) {
  MODELAVG_RETURN_IF_ERROR(ValidateOptions(options));
  if (communicators == nullptr) {
    communicators = std::make_unique<BackendFactory>(options.gloo_hostname);
  }
  const std::string host = HostName();
  if (options.worker_id.empty()) options.worker_id = absl::StrCat(host, ":", getpid());

  MODELAVG_ASSIGN_OR_RETURN(std::unique_ptr<CoordinatorClient> coordinator,
                            CoordinatorClient::Create(options));
  // The token as read (from auth_token_file): never the file again, whatever happens to it.
  options.auth_token = coordinator->options().auth_token;
  options.auth_token_file.clear();

  v1::JoinRequest join;
  join.set_job_id(options.job_id);
  join.set_worker_id(options.worker_id);
  join.set_host(host);
  if (options.rank.has_value()) join.set_rank(*options.rank);
  join.set_world_size(options.expected_world_size);
  join.set_credential(options.credential);
  spdlog::info("joining job {} at {} as {}{}", options.job_id, options.coordinator,
               options.worker_id,
               options.rank ? absl::StrCat(" (rank ", *options.rank, ")") : std::string());
  IgnoreDefaultSigpipe();
  MODELAVG_ASSIGN_OR_RETURN(v1::JoinResponse joined, JoinWithRetry(*coordinator, join, options));

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
  // The subgroups the coordinator computed must be the ones the local schedule gives.
  for (const v1::Subgroup& g : joined.subgroups()) {
    if (g.level() < 0 || g.level() >= schedule.num_levels()) continue;
    const SubgroupRange mine = schedule.SubgroupOf(g.level(), joined.rank());
    if (g.subgroup() != mine.index || g.ranks_size() != mine.size ||
        (g.ranks_size() > 0 && g.ranks(0) != mine.first_rank)) {
      return absl::InternalError(absl::StrCat(
          "the coordinator's subgroup at level ", g.level(), " (", g.subgroup(), ": ",
          absl::StrJoin(g.ranks(), ","), ") differs from the local schedule's (", mine.index,
          "); client and coordinator versions disagree"));
    }
  }
  const absl::Duration hb_timeout = joined.heartbeat_timeout_ms() > 0
                                        ? absl::Milliseconds(joined.heartbeat_timeout_ms())
                                        : kFallbackHeartbeatTimeout;
  spdlog::info("joined job {}: rank {} of {}, generation {}", options.job_id, joined.rank(),
               joined.world_size(), joined.generation());
  options.credential = joined.credential();
  auto outage = std::make_unique<CoordinatorOutage>(options.coordinator,
                                                    options.coordinator_outage_timeout);
  coordinator->set_outage(outage.get());
  std::unique_ptr<Client> client(new Client(
      std::move(options), std::move(coordinator), std::move(outage), joined.rank(),
      joined.generation(), std::move(schedule), hb_timeout, joined.coordinator_incarnation(),
      joined.spec().min_world_size() > 0 &&
          joined.spec().min_world_size() < joined.spec().world_size(),
      std::move(communicators)));
  if (joined.admission_step() > 0) {
    client->admission_step_ = joined.admission_step();
    client->ReportStep(joined.admission_step());
    spdlog::info("rank {} joined job {} as a replacement: admitted at step {}", joined.rank(),
                 client->job_id(), joined.admission_step());
    // Who averages from which step: the members of the generation it was admitted into.
    absl::StatusOr<v1::Job> job = client->coordinator_->GetJob(client->job_id());
    if (!job.ok()) return Annotate(job.status(), "reading the job a replacement was admitted to");
    std::string why;
    std::optional<MembershipView> view = client->ViewOf(*job, &why);
    if (!view.has_value()) {
      return absl::AbortedError(absl::StrCat("job ", client->job_id(), " changed while rank ",
                                             joined.rank(), " was being admitted (", why,
                                             "); start the replacement again"));
    }
    absl::MutexLock l(&client->mu_);
    client->generation_ = view->generation;
    client->latest_generation_ = std::max(client->latest_generation_, view->generation);
    client->view_ = *std::move(view);
  }
  return client;
}

Client::Client(ClientOptions options, std::unique_ptr<CoordinatorClient> coordinator,
               std::unique_ptr<CoordinatorOutage> outage, int32_t rank, int64_t generation,
               Schedule schedule, absl::Duration heartbeat_timeout, std::string incarnation,
               bool elastic, std::unique_ptr<CommunicatorFactory> communicators)
    : options_(std::move(options)),
      outage_(std::move(outage)),
      coordinator_(std::move(coordinator)),
      rank_(rank),
      joined_generation_(generation),
      schedule_(std::move(schedule)),
      elastic_(elastic),
      heartbeat_timeout_(heartbeat_timeout),
      communicators_(std::make_unique<CommunicatorCache>(std::move(communicators))),
      decisions_(std::make_unique<DecisionWindow>(*coordinator_, *outage_, schedule_,
                                                  options_.job_id, rank_,
                                                  options_.schedule_window)),
      round_notes_(std::make_unique<RoundNotes>(*coordinator_, options_.job_id, rank_,
                                                options_.credential, schedule_.num_levels())),
      latest_generation_(generation),
      last_heartbeat_ok_(absl::Now()),
      incarnation_(std::move(incarnation)) {
  generation_ = generation;
  view_ = MembershipView::Initial(generation, schedule_.world_size());
  Heartbeat::Hooks hooks;
  hooks.current = [this] {
    absl::MutexLock l(&mu_);
    return Heartbeat::Beat{step_, generation_, latest_generation_};
  };
  hooks.on_reply = [this](const v1::HeartbeatResponse& reply) { NoteHeartbeatReply(reply); };
  hooks.on_change = [this](const v1::HeartbeatResponse& reply, int64_t seen) {
    HandleHeartbeatReply(reply, seen);
  };
  hooks.on_failure = [this](const absl::Status& error) { NoteHeartbeatFailure(error); };
  heartbeat_ = std::make_unique<Heartbeat>(
      *coordinator_,
      Heartbeat::Options{options_.coordinator, options_.job_id, rank_, options_.credential,
                         options_.heartbeat_interval, heartbeat_timeout_,
                         options_.heartbeat_stream,
                         options_.share_heartbeat_stream || !options_.heartbeat_relay_dir.empty(),
                         options_.heartbeat_relay_dir},
      std::move(hooks));
}

Client::~Client() {
  bool left;
  {
    absl::MutexLock l(&mu_);
    left = left_;
  }
  if (!left) {
    absl::Status s = Leave("client destroyed");
    if (!s.ok()) spdlog::warn("leaving job {} on destruction: {}", options_.job_id, s.ToString());
  }
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  heartbeat_->Stop();
  // Communicators go before the coordinator connection they were built on.
  communicators_.reset();
}

absl::Status Client::Leave(absl::string_view reason, CancelToken* cancel) {
  absl::Status failure;
  {
    absl::MutexLock l(&mu_);
    if (left_) return absl::OkStatus();
    left_ = true;
    stopping_ = true;
    failure = failure_;
    if (broken_.ok()) {
      broken_ = absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, " left job ", options_.job_id,
                       "; connect a new Client to take part again"));
    }
  }
  heartbeat_->Stop();
  communicators_->Clear();
  v1::LeaveRequest req = LeaveRequestNow();
  // A worker whose averaging failed does not leave in order: the coordinator counts it as a
  // death (an elastic job below min_world_size stops instead of running on without it).
  const std::string why =
      failure.ok() ? std::string(reason) : absl::StrCat(reason, ": ", failure.message());
  req.set_reason(why);
  req.set_failed(!failure.ok());
  // Through a coordinator outage (a restart at the end of the job) the Leave of a worker that
  // finished is retried, for at most leave_timeout: it is not failed by a coordinator that is
  // back in seconds, and a destructor never waits long. A failed worker tries once: the
  // coordinator counts it dead at its heartbeat timeout anyway.
  const absl::Time started = absl::Now();
  const absl::Time deadline = started + (failure.ok() ? options_.leave_timeout
                                                      : absl::ZeroDuration());
  absl::Duration backoff = absl::Milliseconds(100);
  int attempts = 0;
  while (true) {
    ++attempts;
    absl::StatusOr<v1::LeaveResponse> resp = coordinator_->Leave(req, cancel);
    if (resp.ok()) break;
    const absl::Status& s = resp.status();
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(absl::StrCat(
          "leaving job ", options_.job_id, ": cancelled after ", attempts,
          " attempt(s); unless the Leave reached the coordinator, it counts rank ", rank_,
          " as dead at its heartbeat timeout"));
    }
    const bool unreachable = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
    if (!unreachable) return s;
    outage_->NoteUnreachable(s);
    // An outage already past coordinator_outage_timeout is not waited for again.
    if (outage_->Exceeded() || absl::Now() + backoff >= deadline) {
      return absl::Status(
          s.code(), absl::StrCat("leaving job ", options_.job_id, ": the coordinator at ",
                                 options_.coordinator, " did not answer within "
                                 "ClientOptions.leave_timeout (",
                                 absl::FormatDuration(options_.leave_timeout), ", ", attempts,
                                 " attempts); it will count rank ", rank_,
                                 " as dead at its heartbeat timeout: ", s.message()));
    }
    if (attempts == 1) {
      spdlog::warn("leaving job {}: coordinator {} unreachable ({}); retrying for up to {}",
                   options_.job_id, options_.coordinator, std::string(s.message()),
                   absl::FormatDuration(options_.leave_timeout));
    }
    SleepUnlessCancelled(cancel, backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
    // The record says what happened.
    req.set_reason(absl::StrCat(why, "; sent again after the coordinator was unreachable for ",
                                absl::FormatDuration(absl::Trunc(absl::Now() - started,
                                                                 absl::Milliseconds(100)))));
  }
  spdlog::info("rank {} {} job {} ({}){}", rank_, failure.ok() ? "left" : "failed out of",
               options_.job_id, why,
               attempts > 1 ? absl::StrCat(" after ", attempts, " attempts (coordinator outage)")
                            : std::string());
  return absl::OkStatus();
}

void Client::FailOut(const absl::Status& failure) {
  if (failure.ok()) return;
  RecordFailure(failure);
  BreakOnce(failure);
  {
    absl::MutexLock l(&mu_);
    if (left_) return;
    left_ = true;
    stopping_ = true;
  }
  heartbeat_->Stop();
  v1::LeaveRequest req = LeaveRequestNow();
  req.set_reason(absl::StrCat("failed out: ", failure.message()));
  req.set_failed(true);
  absl::StatusOr<v1::LeaveResponse> resp = coordinator_->Leave(req);
  if (!resp.ok()) {
    // Its peers then learn it at this rank's heartbeat timeout (its heartbeats have stopped).
    spdlog::error("rank {} failed out of job {} but could not tell the coordinator ({}); its "
                  "peers will count it dead at its heartbeat timeout",
                  rank_, options_.job_id, resp.status().ToString());
    return;
  }
  spdlog::error("rank {} failed out of job {} (generation {} -> {}): {}", rank_,
                options_.job_id, req.generation(), resp->generation(),
                std::string(failure.message()));
}

v1::LeaveRequest Client::LeaveRequestNow() const {
  v1::LeaveRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(rank_);
  req.set_generation(generation());
  req.set_credential(options_.credential);
  return req;
}

void Client::RecordFailure(const absl::Status& failure) {
  if (failure.ok()) return;
  absl::MutexLock l(&mu_);
  if (failure_.ok()) failure_ = failure;
}

void Client::ReportStep(int64_t step) {
  absl::MutexLock l(&mu_);
  step_ = step;
}

int64_t Client::generation() const {
  absl::MutexLock l(&mu_);
  return generation_;
}

int64_t Client::latest_generation() const {
  absl::MutexLock l(&mu_);
  return latest_generation_;
}

absl::Status Client::CheckUsable() const {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  if (latest_generation_ != generation_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", options_.job_id, " moved from generation ", generation_, " to ",
                     latest_generation_, " (", change_reason_, ")"));
  }
  return absl::OkStatus();
}

absl::Status Client::CheckCanAverage(const SubgroupRange& group) const {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  // An elastic job's client follows the generations it is carried into (AdvanceGeneration).
  if (elastic_ || latest_generation_ == generation_) return absl::OkStatus();
  for (int32_t r : departed_) {
    if (group.Contains(r)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot average with ranks ", group.first_rank, "..", group.first_rank + group.size - 1,
          ": rank ", r, " left job ", options_.job_id, " (generation ", generation_, " -> ",
          latest_generation_, ": ", change_reason_, "); connect a new Client to re-join"));
    }
  }
  return absl::OkStatus();
}

void Client::NoteGenerationChange(int64_t generation, const std::string& why,
                                  int32_t blamed_rank) {
  // Who is gone? Only orderly departures of other ranks leave communicators without them usable.
  absl::StatusOr<v1::Job> job = coordinator_->GetJob(options_.job_id);
  absl::Status abort;
  // No collective outlives its generation: one blocked on a dead or stopped peer is broken now
  // rather than at the collective timeout (outside mu_: the averaging thread reads it).
  absl::Cleanup abort_collectives = [&] {
    if (!abort.ok()) communicators_->AbortBefore(generation, abort);
  };
  absl::MutexLock l(&mu_);
  if (generation <= latest_generation_ && !broken_.ok()) return;
  latest_generation_ = std::max(latest_generation_, generation);
  change_reason_ = why;
  if (elastic_ && job.ok()) {
    // An elastic job goes on with its live members: this rank follows it into the new
    // generation if it is one of them. Its collectives of older generations are aborted (a
    // round in flight is retried there, see ModelAverager).
    std::string gone;
    std::optional<MembershipView> view = ViewOf(*job, &gone);
    if (view.has_value()) {
      latest_generation_ = std::max(latest_generation_, view->generation);
      const int64_t known = follow_.has_value() ? follow_->generation : generation_;
      if (view->generation > known) {
        std::vector<int32_t> vacant;
        for (int32_t r = 0; r < schedule_.world_size(); ++r) {
          if (!view->live[r]) vacant.push_back(r);
        }
        spdlog::info("job {} moved to generation {} ({}); rank {} goes on with the live members "
                     "(vacant ranks: {})",
                     options_.job_id, view->generation, why, rank_,
                     vacant.empty() ? std::string("none") : absl::StrJoin(vacant, ","));
        abort = SetErrorKind(
            absl::AbortedError(absl::StrCat(
                "job ", options_.job_id, " moved to generation ", view->generation, " (", why,
                "): a round of an older generation is retried with its live members")),
            ErrorKind::kGenerationMoved, /*peer=*/-1, blamed_rank);
        generation = view->generation;
        follow_ = *std::move(view);
      }
      return;
    }
    if (broken_.ok()) {
      broken_ = SetErrorKind(
          absl::FailedPreconditionError(absl::StrCat(
              "job ", options_.job_id, " moved from generation ", generation_, " to ",
              job->generation(), " (", why, "); rank ", rank_, " cannot average any more: ",
              gone)),
          ErrorKind::kGenerationMoved, /*peer=*/-1, blamed_rank);
      spdlog::error("{}", std::string(broken_.message()));
      abort = broken_;
      generation = job->generation();
    }
    return;
  }
  // Without the job's record, every communicator counts as broken.
  Departures departures;
  departures.hard = true;
  if (job.ok()) departures = DeparturesOf(*job, generation_, schedule_.world_size());
  const bool hard = departures.hard;
  std::vector<int32_t> departed = std::move(departures.left);
  if (hard && broken_.ok()) {
    broken_ = SetErrorKind(
        absl::FailedPreconditionError(absl::StrCat(
            "job ", options_.job_id, " moved from generation ", generation_, " to ", generation,
            " because ", why, "; this rank's communicators are stale: connect a new Client to "
            "re-join (or restart the job)")),
        ErrorKind::kGenerationMoved, /*peer=*/-1, blamed_rank);
    spdlog::error("{}", std::string(broken_.message()));
    abort = broken_;
  } else {
    departed_ = std::move(departed);
    spdlog::info("job {} moved to generation {} ({}); ranks that left: {}", options_.job_id,
                 generation, why, absl::StrJoin(departed_, ","));
  }
}

void Client::HandleHeartbeatReply(const v1::HeartbeatResponse& reply, int64_t seen) {
  if (reply.generation() == generation() || reply.generation() == seen) return;
  std::string why = "membership changed";
  const int32_t blamed_rank = reply.has_last_change() ? reply.last_change().rank() : -1;
  if (reply.has_last_change() && !reply.last_change().reason().empty()) {
    why = reply.last_change().reason();
    const std::string who = absl::StrCat("rank ", reply.last_change().rank());
    if (reply.last_change().rank() >= 0 && !absl::StrContains(why, who)) {
      absl::StrAppend(&why, " (", who, ")");
    }
  }
  NoteGenerationChange(reply.generation(), why, blamed_rank);
}

void Client::NoteHeartbeatReply(const v1::HeartbeatResponse& reply) {
  outage_->NoteReachable();
  absl::MutexLock l(&mu_);
  last_heartbeat_ok_ = absl::Now();
  if (reply.recovery_grace_ms() > 0) {
    recovery_until_ = std::max(recovery_until_,
                               last_heartbeat_ok_ + absl::Milliseconds(reply.recovery_grace_ms()));
  }
  const std::string& incarnation = reply.coordinator_incarnation();
  const bool restarted = !incarnation.empty() && incarnation != incarnation_;
  // This rank joined generation_ once it was complete (RUNNING); only a new generation can be
  // PENDING again. The same generation PENDING means the coordinator lost the job's state and
  // has the job afresh (e.g. from its jobs file): it knows nothing of this rank.
  if (reply.generation() == generation_ && reply.state() == v1::PENDING && broken_.ok()) {
    broken_ = absl::FailedPreconditionError(absl::StrCat(
        "the coordinator that now answers at ", options_.coordinator, " (incarnation ",
        incarnation.empty() ? "unknown" : incarnation, ", this rank joined under ",
        incarnation_.empty() ? "unknown" : incarnation_, ") has job ", options_.job_id,
        " afresh, without this rank: it restarted without the job's state (run it with "
        "--state_dir); restart the workers"));
    spdlog::error("{}", std::string(broken_.message()));
  } else if (restarted) {
    spdlog::warn("coordinator {} restarted (incarnation {} -> {}); rank {} re-attached to job {} "
                 "in generation {}",
                 options_.coordinator, incarnation_.empty() ? "unknown" : incarnation_,
                 incarnation, rank_, options_.job_id, reply.generation());
  }
  if (restarted) incarnation_ = incarnation;
}

void Client::BreakOnce(absl::Status why) {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return;  // The first reason stands.
  broken_ = std::move(why);
  spdlog::error("{}", std::string(broken_.message()));
}

void Client::NoteHeartbeatFailure(const absl::Status& error) {
  if (absl::IsPermissionDenied(error)) {
    // The rank has another member now (this one was declared dead and replaced).
    BreakOnce(absl::FailedPreconditionError(absl::StrCat(
        "the coordinator no longer counts this worker as rank ", rank_, " of job ",
        options_.job_id, " (", error.message(), "); connect a new Client to re-join")));
    return;
  }
  if (absl::IsNotFound(error)) {
    // Only a coordinator that answers can say the job is unknown: it lost or never had it.
    std::string incarnation;
    {
      absl::MutexLock l(&mu_);
      incarnation = incarnation_.empty() ? "unknown" : incarnation_;
    }
    BreakOnce(absl::FailedPreconditionError(absl::StrCat(
        "job ", options_.job_id, " is unknown to the coordinator that now answers at ",
        options_.coordinator, " (this rank joined under incarnation ", incarnation,
        "): it restarted without the job's state (run it with --state_dir) or the job was "
        "deleted; create the job again and restart the workers (",
        error.message(), ")")));
    return;
  }
  // Unreachable, or answering with errors: either way this rank cannot learn of membership
  // changes, so the outage bound applies.
  outage_->NoteUnreachable(error);
  if (!outage_->Exceeded()) return;
  BreakOnce(outage_->Error(absl::StrCat("keeping rank ", rank_, " in job ", options_.job_id,
                                        " (membership changes cannot be learnt)"),
                           error));
}

absl::StatusOr<Decision> Client::DecisionAt(int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step is ", step, ": steps count from 0"));
  }
  ReportStep(step);
  absl::StatusOr<Decision> fetched = decisions_->At(step);
  MODELAVG_RETURN_IF_ERROR(fetched.status());
  Decision d = *std::move(fetched);
  absl::MutexLock l(&mu_);
  d.generation = generation_;
  if (!elastic_ || !d.average) return d;
  // The members of this generation that average at this step: live, and admitted by then.
  d.members.clear();
  d.joining.clear();
  for (int32_t r = d.subgroup.first_rank; r < d.subgroup.first_rank + d.subgroup.size; ++r) {
    if (!view_.live[r] || (view_.admitted[r] >= 0 && view_.admitted[r] > step)) continue;
    d.members.push_back(r);
    if (view_.admitted[r] == step) d.joining.push_back(r);
  }
  return d;
}

std::optional<MembershipView> Client::ViewOf(const v1::Job& job, std::string* why) const {
  return client::ViewOf(job, ViewReader{rank_, options_.worker_id, schedule_.world_size(),
                                        heartbeat_timeout_},
                        why);
}

absl::Status Client::AdvanceGeneration() {
  return AdvanceGeneration([](int64_t) {});
}

absl::Status Client::AdvanceGeneration(absl::FunctionRef<void(int64_t)> before_note) {
  int64_t from, to;
  {
    absl::MutexLock l(&mu_);
    if (!broken_.ok()) return broken_;
    if (!follow_.has_value()) return absl::OkStatus();
    from = generation_;
    to = follow_->generation;
    view_ = *std::move(follow_);
    follow_.reset();
    generation_ = to;
  }
  spdlog::info("rank {} of job {} averages in generation {} now (was {})", rank_,
               options_.job_id, to, from);
  before_note(to);
  round_notes_->Publish(to);
  return absl::OkStatus();
}

absl::Status Client::AwaitNewerGeneration(int64_t generation, absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !broken_.ok() || stopping_ || generation_ > generation ||
           (follow_.has_value() && follow_->generation > generation);
  };
  // While the coordinator is unreachable nobody can declare the death: wait for it to come back
  // (past coordinator_outage_timeout the client is broken). A coordinator back from a restart
  // declares no death before its recovery grace has passed: wait for that too, then as long
  // again as at first.
  const absl::Duration window = std::max(absl::ZeroDuration(), deadline - absl::Now());
  bool outage_seen = false;
  while (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    if (outage_->OutageLength() > absl::ZeroDuration()) {
      outage_seen = true;
      deadline = absl::Now() + absl::Milliseconds(200);
      continue;
    }
    absl::Time next = recovery_until_ + window;
    if (outage_seen) next = std::max(next, absl::Now() + window);
    outage_seen = false;
    if (next <= deadline) break;
    deadline = next;
  }
  if (!broken_.ok()) return broken_;
  if (generation_ > generation || (follow_.has_value() && follow_->generation > generation)) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "the coordinator reported no new generation of job ", options_.job_id, " after generation ",
      generation, " in time"));
}

void Client::RecordRound(int32_t level, int64_t step, int64_t generation, RoundOutcome outcome) {
  round_notes_->Record(level, step, generation, outcome);
}

absl::StatusOr<bool> Client::PeerCompletedRound(const Decision& decision,
                                                int64_t attempt_generation) {
  return round_notes_->PeerCompleted(decision, attempt_generation,
                                     absl::Now() + options_.collective_timeout);
}

}  // namespace modelavg::client
