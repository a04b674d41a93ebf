// The Client keeps one rank's session with the coordinator and delegates: joining to join.h,
// leaving to leave.h, the generations and what stops averaging to GenerationTracker (under mu_),
// the decisions to DecisionWindow, the round notes to RoundNotes, the beats to Heartbeat.
#include "modelavg/client/client.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/comm/communicator.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/gloo/gloo_mesh.h"  // IgnoreDefaultSigpipe
#include "client/heartbeat/heartbeat.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "client/session/backends.h"
#include "client/session/decision_window.h"
#include "client/session/generation_tracker.h"
#include "client/session/join.h"
#include "common/job_spec.h"
#include "client/session/leave.h"
#include "client/session/pace_tracker.h"
#include "client/session/round_notes.h"
#include "common/clock.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  return Connect(std::move(options), nullptr);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    ClientOptions options, std::unique_ptr<CommunicatorFactory> communicators) {
  MODELAVG_RETURN_IF_ERROR(ValidateOptions(options));
  if (communicators == nullptr) {
    communicators = std::make_unique<BackendFactory>(options.gloo_hostname);
  }
  const Clock& clock = options.clock != nullptr ? *options.clock : *Clock::Real();
  const std::string host = HostName();
  if (options.worker_id.empty()) options.worker_id = absl::StrCat(host, ":", getpid());
  MODELAVG_ASSIGN_OR_RETURN(std::unique_ptr<CoordinatorClient> coordinator,
                            CoordinatorClient::Create(options));
  // The token as read (from auth_token_file): never the file again, whatever happens to it.
  options.auth_token = coordinator->options().auth_token;
  options.auth_token_file.clear();
  IgnoreDefaultSigpipe();
  MODELAVG_ASSIGN_OR_RETURN(Joined joined, JoinJob(*coordinator, options, host, clock));
  options.credential = joined.credential;
  auto outage = std::make_unique<CoordinatorOutage>(options.coordinator,
                                                    options.coordinator_outage_timeout, &clock);
  coordinator->set_outage(outage.get());
  const int64_t admission_step = joined.admission_step;
  std::unique_ptr<Client> client(new Client(std::move(options), std::move(coordinator),
                                            std::move(outage), std::move(joined),
                                            std::move(communicators)));
  if (admission_step > 0) {
    client->ReportStep(admission_step);
    ViewReader reader;
    {
      absl::MutexLock l(&client->mu_);
      reader = client->tracker_->reader();
    }
    // (A failure here destroys the client, which leaves the job.)
    MODELAVG_ASSIGN_OR_RETURN(MembershipView view,
                              ReadAdmission(*client->coordinator_, client->job_id(), reader));
    absl::MutexLock l(&client->mu_);
    client->tracker_->Admit(std::move(view));
  }
  return client;
}

Client::Client(ClientOptions options, std::unique_ptr<CoordinatorClient> coordinator,
               std::unique_ptr<CoordinatorOutage> outage, Joined joined,
               std::unique_ptr<CommunicatorFactory> communicators)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? *options_.clock : *Clock::Real()),
      outage_(std::move(outage)),
      coordinator_(std::move(coordinator)),
      rank_(joined.rank),
      joined_generation_(joined.generation),
      schedule_(std::move(joined.schedule)),
      elastic_(joined.elastic),
      heartbeat_timeout_(joined.heartbeat_timeout),
      admission_step_(joined.admission_step),
      communicators_(std::make_unique<CommunicatorCache>(std::move(communicators))),
      decisions_(std::make_unique<DecisionWindow>(
          *coordinator_, *outage_, clock_, std::move(joined.plans), options_.job_id, rank_,
          options_.credential, options_.schedule_window)),
      round_notes_(std::make_unique<RoundNotes>(
          *coordinator_, clock_, options_.job_id, rank_, options_.credential,
          schedule_.num_levels(),
          schedule_.SubgroupOf(schedule_.num_levels() - 1, rank_).index)),
      pace_(std::make_unique<PaceTracker>(clock_)),
      tracker_(std::make_unique<GenerationTracker>(
          GenerationTracker::Options{
              options_.job_id, options_.coordinator,
              ViewReader{rank_, options_.worker_id, schedule_.world_size(), heartbeat_timeout_,
                         schedule_.replica_size()},
              elastic_},
          joined.generation, std::move(joined.incarnation))) {
  Heartbeat::Hooks hooks;
  hooks.current = [this] {
    Heartbeat::Beat beat;
    {
      absl::MutexLock l(&mu_);
      beat = Heartbeat::Beat{step_, tracker_->generation(), tracker_->latest_generation()};
    }
    const DecisionWindow::BeatFields plans = decisions_->OnBeat(beat.step);
    beat.plans_known = plans.plans_known;
    beat.used_through = plans.used_through;
    beat.proposal_answered = plans.proposal_answered;
    beat.compute_steps_per_second = pace_->steps_per_second();
    return beat;
  };
  hooks.on_reply = [this](const v1::HeartbeatResponse& reply) { OnHeartbeatReply(reply); };
  hooks.on_change = [this](const v1::HeartbeatResponse& reply, int64_t seen) {
    OnGenerationSeen(reply, seen);
  };
  hooks.on_failure = [this](const absl::Status& error) { OnHeartbeatFailure(error); };
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
    left = tracker_->left();
  }
  if (!left) {
    absl::Status s = Leave("client destroyed");
    if (!s.ok()) spdlog::warn("leaving job {} on destruction: {}", options_.job_id, s.ToString());
  }
  heartbeat_->Stop();
  // Communicators go before the coordinator connection they were built on.
  communicators_.reset();
}

absl::Status Client::Leave(absl::string_view reason, CancelToken* cancel) {
  absl::Status failure;
  {
    absl::MutexLock l(&mu_);
    if (!tracker_->MarkLeft()) return absl::OkStatus();
    failure = tracker_->failure();
  }
  heartbeat_->Stop();
  communicators_->Clear();
  return SendLeave(*coordinator_, *outage_, clock_, options_, LeaveRequestNow(), reason, failure,
                   cancel);
}

void Client::FailOut(const absl::Status& failure) {
  if (failure.ok()) return;
  RecordFailure(failure);
  Break(failure);
  {
    absl::MutexLock l(&mu_);
    if (!tracker_->MarkLeft()) return;
  }
  heartbeat_->Stop();
  SendFailOut(*coordinator_, options_, LeaveRequestNow(), failure);
}

v1::LeaveRequest Client::LeaveRequestNow() const {
  v1::LeaveRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(rank_);
  req.set_generation(generation());
  req.set_credential(options_.credential);
  {
    // The first step this rank did not start: its replica mates finish the ones it did.
    absl::MutexLock l(&mu_);
    req.set_next_step(step_);
  }
  return req;
}

void Client::RecordFailure(const absl::Status& failure) {
  absl::MutexLock l(&mu_);
  tracker_->RecordFailure(failure);
}

void Client::ReportStep(int64_t step) {
  absl::MutexLock l(&mu_);
  step_ = step;
}

int64_t Client::generation() const {
  absl::MutexLock l(&mu_);
  return tracker_->generation();
}

int64_t Client::latest_generation() const {
  absl::MutexLock l(&mu_);
  return tracker_->latest_generation();
}

absl::Status Client::CheckUsable() const {
  absl::MutexLock l(&mu_);
  return tracker_->CheckUsable();
}

absl::Status Client::CheckCanAverage(const SubgroupRange& group) const {
  absl::MutexLock l(&mu_);
  return tracker_->CheckCanAverage(group);
}

absl::Status Client::AwaitCannotAverage(const SubgroupRange& group, absl::Duration wait) const {
  absl::MutexLock l(&mu_);
  auto cannot = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !tracker_->CheckCanAverage(group).ok();
  };
  clock_.AwaitWithDeadline(mu_, absl::Condition(&cannot), clock_.Now() + wait);
  return tracker_->CheckCanAverage(group);
}

void Client::OnGenerationSeen(const v1::HeartbeatResponse& reply, int64_t seen) {
  {
    absl::MutexLock l(&mu_);
    if (!tracker_->IsNews(reply.generation(), seen)) return;
  }
  // Who is gone? Only orderly departures of other ranks leave communicators without them usable.
  absl::StatusOr<v1::Job> job = coordinator_->GetJob(options_.job_id);
  GenerationTracker::Abort abort;
  {
    absl::MutexLock l(&mu_);
    abort = tracker_->OnGenerationChange(reply.generation(),
                                         GenerationTracker::ChangeReason(reply),
                                         GenerationTracker::BlamedRank(reply), job);
  }
  // No collective outlives its generation: one blocked on a dead or stopped peer is broken now
  // rather than at the collective timeout (outside mu_: the averaging thread reads it).
  if (abort.needed()) communicators_->AbortBefore(abort.before, abort.why);
}

void Client::OnHeartbeatReply(const v1::HeartbeatResponse& reply) {
  outage_->NoteReachable();
  if (absl::Status s = decisions_->OnReply(reply); !s.ok()) {
    Break(Annotate(s, "learning a plan of the job"));
  }
  absl::MutexLock l(&mu_);
  tracker_->OnReply(reply, clock_.Now());
}

void Client::Break(absl::Status why) {
  absl::Status broken;
  {
    absl::MutexLock l(&mu_);
    tracker_->Break(std::move(why));
    broken = tracker_->broken();
  }
  // A call waiting on the coordinator for its decision ends now (outside mu_).
  decisions_->Break(broken);
}

void Client::OnHeartbeatFailure(const absl::Status& error) {
  {
    absl::Status broken;
    {
      absl::MutexLock l(&mu_);
      if (tracker_->OnRefusal(error)) broken = tracker_->broken();
    }
    if (!broken.ok()) {
      // The job is gone or the rank taken: a call waiting for its decision ends now.
      decisions_->Break(broken);
      return;
    }
  }
  // Unreachable, or answering with errors: either way this rank cannot learn of membership
  // changes, so the outage bound applies.
  outage_->NoteUnreachable(error);
  if (!outage_->Exceeded()) return;
  Break(outage_->Error(absl::StrCat("keeping rank ", rank_, " in job ", options_.job_id,
                                    " (membership changes cannot be learnt)"),
                       error));
}

const PlanHistory& Client::plans() const { return *decisions_->plans(); }

absl::StatusOr<Decision> Client::DecisionAt(int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step is ", step, ": steps count from 0"));
  }
  ReportStep(step);
  absl::StatusOr<Decision> fetched = decisions_->At(step);
  MODELAVG_RETURN_IF_ERROR(fetched.status());
  if (elastic_ && fetched->round >= 0) {
    int64_t generation;
    {
      absl::MutexLock l(&mu_);
      generation = tracker_->generation();
    }
    if (fetched->generation != generation) {
      // A paced round (docs/paced.md) whose members changed since it was fetched: who is a
      // member, and who joins, is decided at each member's own sync step, which only the
      // coordinator holds. Asked again in this rank's generation (the same round, the same
      // steps: a plan never changes); if that fails, the members left alive of the fetched
      // decision average, and a mismatch fails the round, which is retried.
      v1::StepRequest req;
      req.set_job_id(options_.job_id);
      req.set_rank(rank_);
      req.set_generation(generation);
      req.set_step(step);
      absl::StatusOr<v1::StepDecision> again = coordinator_->Step(req);
      if (again.ok() && again->has_round() && again->round() == fetched->round) {
        fetched = DecisionFromProto(*again);
      } else if (!again.ok()) {
        spdlog::info("rank {} of job {}: paced round {} asked again in generation {}: {}", rank_,
                     options_.job_id, fetched->round, generation, again.status().ToString());
      }
    }
  }
  absl::MutexLock l(&mu_);
  // Sharded replicas: past the step its replica was retired from, this rank averages no more.
  MODELAVG_RETURN_IF_ERROR(tracker_->CheckRetiredAt(step));
  return tracker_->Decide(*std::move(fetched), step);
}

absl::Status Client::AdvanceGeneration() {
  return AdvanceGeneration([](int64_t) {});
}

absl::Status Client::AdvanceGeneration(absl::FunctionRef<void(int64_t)> before_note) {
  absl::StatusOr<GenerationTracker::Move> move;
  {
    absl::MutexLock l(&mu_);
    move = tracker_->Advance();
  }
  MODELAVG_RETURN_IF_ERROR(move.status());
  if (!move->moved()) return absl::OkStatus();
  spdlog::info("rank {} of job {} averages in generation {} now (was {})", rank_,
               options_.job_id, move->to, move->from);
  before_note(move->to);
  round_notes_->Publish(move->to);
  return absl::OkStatus();
}

absl::Status Client::AwaitNewerGeneration(int64_t generation, absl::Duration wait) {
  absl::MutexLock l(&mu_);
  auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return tracker_->WaitOver(generation); };
  GenerationTracker::AwaitWindow window{std::max(absl::ZeroDuration(), wait)};
  absl::Time deadline = clock_.Now() + window.window;
  while (!clock_.AwaitWithDeadline(mu_, absl::Condition(&over), deadline)) {
    std::optional<absl::Time> next =
        tracker_->ExtendWait(window, clock_.Now(), deadline, outage_->OutageLength());
    if (!next.has_value()) break;
    deadline = *next;
  }
  if (!tracker_->broken().ok()) return tracker_->broken();
  if (tracker_->NewerThan(generation)) return absl::OkStatus();
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
                                     clock_.Now() + options_.collective_timeout);
}

}  // namespace modelavg::client
