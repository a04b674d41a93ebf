#include "server/core/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/printable.h"
#include "server/core/request_checks.h"
#include "server/membership/decisions.h"
#include "server/membership/member_credential.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

constexpr size_t kMaxReasonLength = 256;
// Messages list at most this many missing ranks.
constexpr int kMaxListedRanks = 32;

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

std::string StateName(v1::JobState s) { return v1::JobState_Name(s); }

absl::Duration OrDefault(int64_t ms, absl::Duration fallback) {
  return ms > 0 ? absl::Milliseconds(ms) : fallback;
}

// A worker's free text (a Leave's or a report's reason), as the coordinator keeps, logs and shows
// it: at most n bytes of it, its control characters escaped.
std::string Truncate(const std::string& s, size_t n) {
  return EscapeControlCharacters(s.size() <= n ? s : s.substr(0, n) + "...");
}

// The comm-id key of `key` at a level of plan `plan`: the levels of two plans are apart (plan 0's
// keys are as they always were).
std::string PlanKey(int32_t plan, const std::string& key) {
  return plan == 0 ? key : absl::StrCat("plan", plan, "/", key);
}

// What the job keeps of a spec: its known fields (unknown ones would cost memory for nothing).
v1::JobSpec Stripped(v1::JobSpec spec) {
  spec.DiscardUnknownFields();
  return spec;
}

// The store's record of a membership change: its header and members' records, and the ids of
// the old generation dropped when the generation moved on or the job finished.
JobDelta StoreDeltaOf(const MembershipChange& change) {
  JobDelta delta;
  delta.header = change.header;
  delta.members = change.members;
  delta.clear_comm_ids = change.generation_changed || change.finished;
  return delta;
}

}  // namespace

// Collects completions and events under Job::mu_; runs them once mu_ is released (it is declared
// before the MutexLock, so it is destroyed after it). The first event takes delivery_mu_ while
// mu_ is still held, so that events of concurrent calls reach watchers in the order they
// happened.
class Job::Outbox {
 public:
  explicit Outbox(Job* job) : job_(job) {}
  ~Outbox() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) {
      for (auto& [target, event] : events_) {
        if (target != nullptr) {
          target->OnEvent(event);
          continue;
        }
        for (auto& w : watchers_) w->OnEvent(event);
      }
      for (auto& w : closing_) w->OnClosed(close_status_);
      job_->delivery_mu_.Unlock();
    }
    // Last, with no lock of the Job held: a completion may end the RPC that owns the Job.
    for (auto& f : completions_) f();
  }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  void Complete(absl::AnyInvocable<void()> f) { completions_.push_back(std::move(f)); }

  // Requires job_->mu_ held.
  void Event(std::shared_ptr<JobWatcher> target, v1::JobEvent event)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    StartDelivery();
    events_.emplace_back(std::move(target), std::move(event));
  }
  void CloseWatchers(std::vector<std::shared_ptr<JobWatcher>> watchers, absl::Status status) {
    StartDelivery();
    closing_ = std::move(watchers);
    close_status_ = std::move(status);
  }

 private:
  void StartDelivery() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (delivering_) return;
    job_->delivery_mu_.Lock();
    delivering_ = true;
    for (auto& [id, w] : job_->watchers_) watchers_.push_back(w);
  }

  Job* job_;
  std::vector<absl::AnyInvocable<void()>> completions_;
  bool delivering_ = false;
  std::vector<std::shared_ptr<JobWatcher>> watchers_;
  std::vector<std::pair<std::shared_ptr<JobWatcher>, v1::JobEvent>> events_;
  std::vector<std::shared_ptr<JobWatcher>> closing_;
  absl::Status close_status_;
};

Job::Job(v1::JobSpec spec, Schedule schedule, const JobDefaults& defaults, Clock* clock,
         StateStore* store, int64_t created_unix_ms)
    : spec_(Stripped(std::move(spec))),
      schedule_(std::move(schedule)),
      heartbeat_timeout_ms_(absl::ToInt64Milliseconds(
          OrDefault(spec_.heartbeat_timeout_ms(), defaults.heartbeat_timeout))),
      join_timeout_(OrDefault(spec_.join_timeout_ms(), defaults.join_timeout)),
      clock_(clock),
      created_unix_ms_(created_unix_ms),
      warnings_(ScheduleWarnings(schedule_.spec())),
      store_(store),
      membership_(schedule_, spec_.min_world_size(),
                  [this](const MembershipChange& change) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                    // Called by membership_'s operations, under mu_.
                    return Save(StoreDeltaOf(change));
                  }),
      plans_(spec_, schedule_, created_unix_ms) {}

Job::~Job() = default;

void Job::Restore(const StoredJob& stored, absl::Duration grace) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  membership_.Restore(stored.header, stored.members, now);
  grace_until_ = now + std::max(grace, heartbeat_timeout());
  comm_ids_.Clear();
  for (const StoredCommId& c : stored.comm_ids) {
    comm_ids_.Put(CommKey{c.level, c.subgroup, c.key}, c.blob);
  }
  if (absl::Status s = plans_.Restore(stored.plan_changes); !s.ok()) {
    // Never silently another plan: the job stops taking calls until an operator deletes it.
    spdlog::error("job {}: its stored plans do not load ({}); the job is halted", id(),
                  s.ToString());
    halted_ = absl::DataLossError(absl::StrCat("job ", id(), ": its stored plans do not load (",
                                               s.message(), "); delete and re-create the job"));
    return;
  }
  if (plans_.size() > 1) {
    const PlanHistory& history = *plans_.history();
    membership_.SetPlan(history.Latest(), history.SwitchStep(plans_.size() - 1));
    ApplySoftFields(plans_.plans().back().spec());
  }
}

void Job::ApplySoftFields(const v1::JobSpec& spec) {
  if (spec.heartbeat_timeout_ms() > 0) {
    heartbeat_timeout_ms_.store(spec.heartbeat_timeout_ms(), std::memory_order_relaxed);
  }
  if (membership_.elastic() && spec.min_world_size() > 0 &&
      spec.min_world_size() < membership_.world_size()) {
    membership_.SetMinWorldSize(spec.min_world_size());
  }
}

absl::Status Job::Save(const JobDelta& delta) {
  absl::Status s = store_->Apply(id(), delta);
  if (s.ok()) return s;
  last_save_error_ = s;
  // A halted job tries again at every staleness check: it said so once.
  if (halted_.ok()) {
    spdlog::error("job {}: could not save a change of its state ({}); the change was not made",
                  id(), s.ToString());
  }
  return absl::UnavailableError(absl::StrCat(
      "the coordinator could not save the state of job ", id(), " (", s.message(),
      "); nothing was changed: retry once the coordinator can write its state again"));
}

void Job::Join(const v1::JoinRequest& request, absl::Time call_deadline, WaitId wait_id,
               JoinCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status status) {
    out.Complete([done = std::move(done), status = std::move(status)]() mutable {
      done(std::move(status));
    });
  };
  if (!closed_.ok()) return fail(closed_);
  if (!halted_.ok()) return fail(halted_);
  const int32_t world = schedule_.world_size();
  if (absl::Status s = CheckJoinRequest(request, world, id()); !s.ok()) return fail(s);
  const absl::Time now = clock_->Now();
  std::string credential = NewMemberCredential();
  // Written before anything else happens: on a failed write nothing did, and a retry of this
  // Join is a first Join again, not a re-join that would move the generation. (A rank in a
  // round that is still assembling is part of this Join's wait: nothing is written for it.)
  absl::StatusOr<Membership::JoinResult> joined = membership_.Join(
      request.worker_id(), request.host(),
      request.has_rank() ? std::optional<int32_t>(request.rank()) : std::nullopt, now, id(),
      request.credential(), CredentialDigest(credential), request.join_nonce());
  if (!joined.ok()) return fail(joined.status());
  const int32_t rank = joined->rank;
  if (joined->waiting_for_replica) {
    return WaitForReplica(rank, joined->was_in_round, std::move(credential),
                          std::min(now + join_timeout_, call_deadline),
                          request.subgroup_ranks_from_spec(), wait_id, std::move(done), &out);
  }
  if (joined->change.admitted) {
    // A replacement in a RUNNING elastic job: answered at once, with the rest of its replica.
    for (int32_t mate : joined->admitted_with) {
      if (std::optional<JoinWait> w = waits_.TakeJoinOfRank(mate)) {
        v1::JoinResponse response;
        FillJoinResponse(mate, !w->ranks_from_spec, &response);
        response.set_credential(std::move(w->credential));
        out.Complete([cb = std::move(w->done), response = std::move(response)]() mutable {
          cb(std::move(response));
        });
      }
    }
    return AnswerAdmission(rank, joined->change, std::move(credential),
                           request.subgroup_ranks_from_spec(), std::move(done), &out);
  }
  OnMembershipChange(joined->change, &out);
  if (joined->was_in_round) {
    // The same worker joins again (e.g. it retried after losing the reply): the newer call wins.
    if (std::optional<JoinWait> old = waits_.TakeJoinOfRank(rank)) {
      out.Complete([cb = std::move(old->done)]() mutable {
        cb(absl::AbortedError("superseded by a newer Join from the same worker"));
      });
    }
  }
  const LiveMember& m = membership_.member(rank);
  const int64_t generation = membership_.generation();
  spdlog::info("job {}: worker \"{}\" ({}) joined as rank {} in generation {} ({}/{} joined)",
               id(), m.worker_id, m.host, rank, generation,
               joined->change.world_complete ? world : membership_.round_size(), world);
  AddEvent(v1::JobEvent::MEMBER_JOINED, rank,
           absl::StrCat("worker \"", m.worker_id, "\" joined as rank ", rank), false, &out);
  JoinWait wait{wait_id, rank, std::move(credential),
                std::min(now + join_timeout_, call_deadline), std::move(done)};
  wait.ranks_from_spec = request.subgroup_ranks_from_spec();
  waits_.AddJoin(std::move(wait));
  if (joined->change.world_complete) CompleteRound(&out);
}

void Job::WaitForReplica(int32_t rank, bool superseding, std::string credential,
                         absl::Time deadline, bool ranks_from_spec, WaitId wait_id,
                         JoinCallback done, Outbox* out) {
  if (superseding) {
    // The same worker joins again (it retried): the newer call waits, the older one ends.
    if (std::optional<JoinWait> old = waits_.TakeJoinOfRank(rank)) {
      out->Complete([cb = std::move(old->done)]() mutable {
        cb(absl::AbortedError("superseded by a newer Join from the same worker"));
      });
    }
  }
  const int32_t s = membership_.replica_size();
  const int32_t replica = rank / s;
  std::vector<int32_t> missing;
  for (int32_t r = replica * s; r < replica * s + s; ++r) {
    if (!membership_.Waiting(r)) missing.push_back(r);
  }
  spdlog::info("job {}: a replacement joined as rank {} of replica {}; it waits for ranks {} of "
               "its replica to join",
               id(), rank, replica, absl::StrJoin(missing, ", "));
  AddEvent(v1::JobEvent::MEMBER_JOINED, rank,
           absl::StrCat("a replacement joined as rank ", rank, " of replica ", replica,
                        " and waits for ranks ", absl::StrJoin(missing, ", ")),
           false, out);
  JoinWait wait{wait_id, rank, std::move(credential), deadline, std::move(done)};
  wait.for_replica = true;
  wait.ranks_from_spec = ranks_from_spec;
  waits_.AddJoin(std::move(wait));
}

void Job::AnswerAdmission(int32_t rank, const MembershipChange& change, std::string credential,
                          bool ranks_from_spec, JoinCallback done, Outbox* out) {
  const LiveMember& m = membership_.member(rank);
  ++admissions_;
  spdlog::info("job {}: worker \"{}\" ({}) admitted as rank {}{} in generation {} at step {} "
               "(floor {} = largest step reported {} + margin {}; {:.1f} steps/s)",
               id(), m.worker_id, m.host,
               change.admitted_ranks.size() > 1
                   ? absl::StrCat(rank, " with ranks ", absl::StrJoin(change.admitted_ranks, ","),
                                  " of its replica")
                   : absl::StrCat(rank),
               change.replaced_live_member ? " (its earlier membership departed)" : "",
               membership_.generation(), change.admission_step, change.admission_floor,
               change.max_reported_step, change.admission_margin,
               std::max(0.0, membership_.steps_per_second()));
  AddEvent(v1::JobEvent::MEMBER_ADMITTED, rank,
           change.admitted_ranks.size() > 1
               ? absl::StrCat("replica ", rank / membership_.replica_size(), " (ranks ",
                              absl::StrJoin(change.admitted_ranks, ","), ") admitted at step ",
                              change.admission_step)
               : absl::StrCat("worker \"", m.worker_id, "\" admitted as rank ", rank,
                              " at step ", change.admission_step),
           true, out);
  OnMembershipChange(change, out);
  v1::JoinResponse response;
  FillJoinResponse(rank, !ranks_from_spec, &response);
  response.set_credential(std::move(credential));
  out->Complete([done = std::move(done), response = std::move(response)]() mutable {
    done(std::move(response));
  });
}

void Job::CompleteRound(Outbox* out) {
  const int64_t generation = membership_.generation();
  for (JoinWait& w : waits_.TakeRoundJoins()) {
    v1::JoinResponse response;
    FillJoinResponse(w.rank, !w.ranks_from_spec, &response);
    response.set_credential(std::move(w.credential));
    out->Complete([cb = std::move(w.done), response = std::move(response)]() mutable {
      cb(std::move(response));
    });
  }
  spdlog::info("job {}: all {} ranks joined; RUNNING in generation {}", id(),
               schedule_.world_size(), generation);
  AddEvent(v1::JobEvent::WORLD_COMPLETE, -1, absl::StrCat("RUNNING in generation ", generation),
           true, out);
}

void Job::OnMembershipChange(const MembershipChange& change, Outbox* out) {
  if (change.generation_changed) {
    const std::string why = absl::StrCat(
        "job ", id(), " moved from generation ", change.old_generation, " to ",
        membership_.generation(), " because ", change.reason,
        change.shrunk     ? "; its survivors continue in the new generation"
        : change.admitted ? "; every live member continues in the new generation"
                          : "; re-join");
    // Replacements waiting for their replica go on waiting while the job runs on.
    FailAllWaits(absl::AbortedError(why), out,
                 /*keep_replica_waits=*/change.shrunk || change.admitted);
    comm_ids_.Clear();
    if (change.admitted) {
      spdlog::info("job {}: generation {} -> {}: {}; elastic: RUNNING with {} of {} ranks{}", id(),
                   change.old_generation, membership_.generation(), change.reason,
                   membership_.round_size(), membership_.world_size(),
                   membership_.round_size() == membership_.world_size()
                       ? std::string()
                       : absl::StrCat(" (vacant: ", absl::StrJoin(membership_.VacantRanks(), ", "),
                                      ")"));
    } else if (change.shrunk) {
      spdlog::warn("job {}: generation {} -> {}: {}; elastic: RUNNING on with {} of {} ranks "
                   "(vacant: {}){}",
                   id(), change.old_generation, membership_.generation(), change.reason,
                   membership_.round_size(), membership_.world_size(),
                   absl::StrJoin(membership_.VacantRanks(), ", "),
                   change.retired.empty()
                       ? std::string()
                       : absl::StrCat("; ranks ", absl::StrJoin(change.retired, ", "),
                                      " retired with their replica"));
    } else {
      spdlog::warn("job {}: generation {} -> {}: {}{}", id(), change.old_generation,
                   membership_.generation(), change.reason,
                   membership_.elastic()
                       ? absl::StrCat("; elastic job below min_world_size (",
                                      membership_.min_world_size(),
                                      "): PENDING until every rank re-joins")
                       : std::string());
    }
    AddEvent(v1::JobEvent::GENERATION_CHANGED, change.changed_by_rank, change.reason, true,
             out);
  }
  if (change.finished) {
    FailAllWaits(absl::AbortedError(absl::StrCat("job ", id(), " finished: every member left")),
                 out);
    comm_ids_.Clear();
    spdlog::info("job {}: FINISHED in generation {} (every member left)", id(),
                 membership_.generation());
    AddEvent(v1::JobEvent::JOB_FINISHED, -1, "every member left", true, out);
  }
}

void Job::FillJoinResponse(int32_t rank, bool with_ranks, v1::JoinResponse* out) const {
  out->set_rank(rank);
  out->set_world_size(schedule_.world_size());
  out->set_generation(membership_.generation());
  *out->mutable_spec() = spec_;
  out->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout()));
  out->set_admission_step(membership_.member(rank).admitted_step);
  plans_.AppendAfter(1, out->mutable_plan_changes());
  for (int level = 0; level < schedule_.num_levels(); ++level) {
    const SubgroupRange g = schedule_.SubgroupOf(level, rank);
    v1::Subgroup* s = out->add_subgroups();
    s->set_level(level);
    s->set_period(schedule_.spec().levels[level].period);
    s->set_subgroup(g.index);
    if (!with_ranks) continue;
    s->mutable_ranks()->Reserve(g.size);
    for (int32_t i = 0; i < g.size; ++i) s->add_ranks(g.RankAt(i));
  }
}

void Job::FailAllWaits(const absl::Status& status, Outbox* out, bool keep_replica_waits) {
  for (JoinWait& w : keep_replica_waits ? waits_.TakeRoundJoins() : waits_.TakeAllJoins()) {
    out->Complete([cb = std::move(w.done), status]() mutable { cb(status); });
  }
  for (CommIdWait& w : waits_.TakeAllCommIds()) {
    out->Complete([cb = std::move(w.done), status]() mutable { cb(status); });
  }
}

std::string Job::StaleMessage(int64_t generation) const {
  const int64_t current = membership_.generation();
  if (generation > current) {
    return absl::StrCat("generation ", generation, " does not exist yet; job ", id(),
                        " is at generation ", current, "; use the generation from Join");
  }
  std::string s = absl::StrCat("generation ", generation, " is stale; job ", id(),
                               " is at generation ", current);
  if (membership_.last_change().has_value()) {
    absl::StrAppend(&s, " since ", membership_.last_change()->reason());
  }
  absl::StrAppend(&s, "; re-join");
  return s;
}

absl::Status Job::Heartbeat(const v1::HeartbeatRequest& request,
                            v1::HeartbeatResponse* response) {
  if (absl::Status s = CheckRank(request.rank(), schedule_.world_size(), id()); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckStep(request.step()); !s.ok()) return s;
  const absl::Time now = clock_->Now();
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) {  // deleted (or stopping) while a stream still held it
    return deleted_ ? absl::NotFoundError(closed_.message()) : closed_;
  }
  // A rank without a member is answered (the reply tells a worker whose coordinator lost the
  // job's state that it has the job afresh) and nothing is recorded; a member's rank needs the
  // member's credential.
  if (membership_.member(request.rank()).present()) {
    if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                     "Heartbeat", id());
        !s.ok()) {
      return s;
    }
  }
  if (membership_.member(request.rank()).present()) {
    if (absl::Status s =
            membership_.CheckPlausibleStep(request.rank(), request.step(), now, id());
        !s.ok()) {
      return s;
    }
  }
  membership_.Heartbeat(request.rank(), request.generation(), request.step(), now);
  // Liveness still counts while halted: the death is written once it can be, of the same ranks.
  if (!halted_.ok()) return halted_;
  if (membership_.member(request.rank()).present() && request.used_through() >= 0) {
    plans_.Reported(request.rank(), request.used_through(), request.proposal_answered());
  }
  plans_.AppendAfter(request.plans_known(), response->mutable_plan_changes());
  response->set_proposed_plan(plans_.proposed());
  if (plans_.proposed() != 0) MaybeFinishProposal(now, &out);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  if (now < grace_until_) {
    response->set_recovery_grace_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(grace_until_ - now)));
  }
  if (request.generation() != membership_.generation() && membership_.last_change()) {
    *response->mutable_last_change() = *membership_.last_change();
  }
  return absl::OkStatus();
}

void Job::HeartbeatStreamLost(int32_t rank, const std::string& credential) {
  if (rank < 0 || rank >= schedule_.world_size()) return;
  absl::MutexLock lock(&mu_);
  if (!closed_.ok() || !membership_.elastic() || !membership_.InRound(rank)) return;
  if (!membership_.CheckCredential(rank, credential, "HeartbeatStream", id()).ok()) return;
  spdlog::info("job {}: rank {}'s heartbeat stream broke; DEAD unless it beats within {} ms",
               id(), rank, absl::ToInt64Milliseconds(StreamLostGrace()));
  membership_.StreamLost(rank, clock_->Now());
}

absl::Status Job::Step(const v1::StepRequest& request, v1::StepDecision* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckRank(rank, schedule_.world_size(), id()); !s.ok()) return s;
  if (absl::Status s = CheckStep(request.step()); !s.ok()) return s;
  const absl::Time now = clock_->Now();
  int64_t generation;
  std::shared_ptr<const MemberSteps> members;
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    if (!halted_.ok()) return halted_;
    generation = membership_.generation();
    members = membership_.DecisionMembers();
    if (request.generation() != generation) {
      return absl::FailedPreconditionError(StaleMessage(request.generation()));
    }
    if (membership_.state() != v1::RUNNING) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id(), " is ", StateName(membership_.state()), " in generation ",
                       generation, "; Step needs a RUNNING job (wait for Join to complete)"));
    }
    // Progress and liveness count only from the rank's member; anyone may read the decision.
    if (membership_.CheckCredential(rank, request.credential(), "Step", id()).ok()) {
      if (absl::Status s = membership_.CheckPlausibleStep(rank, request.step(), now, id());
          !s.ok()) {
        return s;
      }
      membership_.RecordStep(rank, request.step(), now);
      // Handed out to the rank: a later plan switches past it.
      plans_.Handed(rank, request.step());
    }
    plans = plans_.history();
  }
  DecisionToProto(plans->DecisionFor(request.step(), rank), generation, response);
  ApplyMembers(*members, response);
  return absl::OkStatus();
}

absl::Status Job::GetSchedule(const v1::GetScheduleRequest& request,
                              v1::GetScheduleResponse* response,
                              const std::function<bool()>& cancelled) {
  int64_t generation;
  std::shared_ptr<const MemberSteps> members;
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    plans = plans_.history();
  }
  if (absl::Status s = CheckDecisionWindow(*plans, request, id(), cancelled); !s.ok()) {
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    generation = membership_.generation();
    members = membership_.DecisionMembers();
    // The decisions handed out are promised: a later plan switches past them. Taken with the
    // plans they follow, under one lock, so that no update falls between.
    plans = plans_.history();
    if (request.has_rank() && !request.credential().empty() &&
        membership_.CheckCredential(request.rank(), request.credential(), "GetSchedule", id())
            .ok()) {
      plans_.Handed(request.rank(), request.from_step() + request.count() - 1);
    }
    plans_.AppendAfter(request.plans_known(), response->mutable_plan_changes());
  }
  return DecisionWindow(*plans, *members, generation, request, response, cancelled);
}

absl::Status Job::ValidateCommRequest(int64_t generation, int32_t plan, int32_t level,
                                      int32_t subgroup, int32_t rank,
                                      const std::string& key) const {
  if (plan < 0 || plan >= plans_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", plan, " is outside [0, ",
                                                   plans_.size(), ") for job ", id()));
  }
  const Schedule& schedule = plans_.history()->Plan(plan);
  if (absl::Status s = CheckCommRequest(schedule, level, subgroup, rank, key, id()); !s.ok()) {
    return s;
  }
  if (generation != membership_.generation()) {
    return absl::FailedPreconditionError(StaleMessage(generation));
  }
  if (membership_.state() != v1::RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), " is ", StateName(membership_.state()), " in generation ",
        membership_.generation(), "; communicator ids are exchanged once the world is complete"));
  }
  const SubgroupRange g = schedule.SubgroupOf(level, rank);
  if (g.index != subgroup) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " is in subgroup ", g.index, " at level ", level,
        ", not in subgroup ", subgroup, "; only the subgroup's members may use its ids"));
  }
  return absl::OkStatus();
}

absl::Status Job::PublishCommId(const v1::PublishCommIdRequest& request) {
  if (absl::Status s = CheckCommIdBlob(request.unique_id()); !s.ok()) return s;
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (!halted_.ok()) return halted_;
  if (absl::Status s =
          ValidateCommRequest(request.generation(), request.plan(), request.level(),
                              request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                   "PublishCommId", id());
      !s.ok()) {
    return s;
  }
  CommKey key{request.level(), request.subgroup(), PlanKey(request.plan(), request.key())};
  absl::StatusOr<bool> is_new =
      comm_ids_.CheckPublish(key, request.unique_id(), id(), membership_.generation());
  if (!is_new.ok()) return is_new.status();
  if (!*is_new) return absl::OkStatus();
  JobDelta published;
  published.comm_id = StoredCommId{request.level(), request.subgroup(), std::get<2>(key),
                                   request.unique_id()};
  if (absl::Status s = Save(published); !s.ok()) return s;
  comm_ids_.Put(key, request.unique_id());
  spdlog::debug("job {}: rank {} published a {}-byte id for level {}, subgroup {}, key \"{}\" "
                "in generation {}",
                id(), request.rank(), request.unique_id().size(), request.level(),
                request.subgroup(), request.key(), membership_.generation());
  for (CommIdWait& w : waits_.TakeCommIds(key)) {
    out.Complete([cb = std::move(w.done), blob = request.unique_id()]() mutable {
      cb(std::move(blob));
    });
  }
  return absl::OkStatus();
}

void Job::GetCommId(const v1::GetCommIdRequest& request, absl::Time call_deadline,
                    WaitId wait_id, CommIdCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto finish = [&](absl::StatusOr<std::string> result) {
    out.Complete([done = std::move(done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  };
  if (!closed_.ok()) return finish(closed_);
  if (!halted_.ok()) return finish(halted_);
  if (request.timeout_ms() < 0) {
    return finish(absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be >= 0 (0: the call's deadline), got ",
                     request.timeout_ms())));
  }
  if (absl::Status s =
          ValidateCommRequest(request.generation(), request.plan(), request.level(),
                              request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return finish(s);
  }
  if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                   "GetCommId", id());
      !s.ok()) {
    return finish(s);
  }
  CommKey key{request.level(), request.subgroup(), PlanKey(request.plan(), request.key())};
  if (const std::string* blob = comm_ids_.Find(key)) return finish(*blob);
  const absl::Time now = clock_->Now();
  const absl::Duration wait = request.timeout_ms() > 0
                                  ? absl::Milliseconds(request.timeout_ms())
                                  : join_timeout_;
  waits_.AddCommId(
      CommIdWait{wait_id, std::move(key), std::min(now + wait, call_deadline), std::move(done)});
}

absl::Status Job::Leave(const v1::LeaveRequest& request, v1::LeaveResponse* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckRank(rank, schedule_.world_size(), id()); !s.ok()) return s;
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!halted_.ok()) return halted_;
  if (absl::Status s = membership_.CheckCredential(rank, request.credential(), "Leave", id());
      !s.ok()) {
    return s;
  }
  std::string reason = absl::StrCat("rank ", rank, request.failed() ? " failed" : " left");
  if (!request.reason().empty()) {
    absl::StrAppend(&reason, " (", Truncate(request.reason(), kMaxReasonLength), ")");
  }
  // A worker that ends because it failed is no orderly departure: it counts as a death
  // (written first, like every change: on a failed write nothing changed).
  if (const LiveMember& m = membership_.member(rank);
      request.failed() && membership_.state() == v1::RUNNING && m.present() &&
      m.state == v1::ALIVE && m.generation == membership_.generation()) {
    const std::string worker_id = m.worker_id;
    absl::StatusOr<MembershipChange> died = membership_.Die({rank}, reason, clock_->Now());
    if (!died.ok()) return died.status();
    spdlog::warn("job {}: {} (worker \"{}\", generation {}); DEAD", id(), reason, worker_id,
                 request.generation());
    ++deaths_;
    OnMembershipChange(*died, &out);
    response->set_state(membership_.state());
    response->set_generation(membership_.generation());
    return absl::OkStatus();
  }
  absl::StatusOr<Membership::LeaveResult> left =
      membership_.Leave(rank, reason, clock_->Now(), id(), request.next_step());
  if (!left.ok()) return left.status();
  if (left->left) {
    spdlog::info("job {}: {} (worker \"{}\", generation {})", id(), reason,
                 membership_.member(rank).worker_id, request.generation());
    if (left->left_pending_round) {
      if (std::optional<JoinWait> w = waits_.TakeJoinOfRank(rank)) {
        out.Complete([cb = std::move(w->done), reason]() mutable {
          cb(absl::AbortedError(reason));
        });
      }
    }
    OnMembershipChange(left->change, &out);
  }
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

absl::Status Job::ReportPeerFailure(const v1::ReportPeerFailureRequest& request,
                                    v1::ReportPeerFailureResponse* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckPeerReport(request, schedule_.world_size(), id()); !s.ok()) {
    return s;
  }
  PeerReport report;
  report.reporter = rank;
  report.unreachable.assign(request.unreachable_ranks().begin(),
                            request.unreachable_ranks().end());
  report.reachable.assign(request.reachable_ranks().begin(), request.reachable_ranks().end());
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (!halted_.ok()) return halted_;
  if (absl::Status s =
          membership_.CheckCredential(rank, request.credential(), "ReportPeerFailure", id());
      !s.ok()) {
    return s;
  }
  const int64_t generation = membership_.generation();
  response->set_state(membership_.state());
  response->set_generation(generation);
  // The job moved on already (the failure was a death the coordinator saw itself, say).
  if (request.generation() != generation) return absl::OkStatus();
  if (membership_.state() != v1::RUNNING || !membership_.InRound(rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " is not a member of job ", id(), "'s running round (generation ",
        generation, "); a peer failure report is not taken from it"));
  }
  const absl::Time now = clock_->Now();
  report.at = now;
  spdlog::info("job {}: rank {} reports its round at step {} (level {}) failed: could not reach "
               "ranks [{}], reached [{}] ({})",
               id(), rank, request.step(), request.level(),
               absl::StrJoin(report.unreachable, ","), absl::StrJoin(report.reachable, ","),
               Truncate(request.reason(), kMaxReasonLength));
  peer_reports_.Add(generation, std::move(report));
  std::vector<ConfirmedPeer> confirmed = peer_reports_.Confirmed(
      generation, now, [this](int32_t r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return membership_.InRound(r);
      });
  if (confirmed.empty()) return absl::OkStatus();
  std::vector<int32_t> dead;
  for (const ConfirmedPeer& c : confirmed) dead.push_back(c.rank);
  std::string reason = absl::StrCat("rank ", dead[0], " unreachable by its peers");
  if (dead.size() > 1) absl::StrAppend(&reason, " (and ", dead.size() - 1, " more ranks)");
  absl::StatusOr<MembershipChange> died = membership_.Die(dead, reason, now);
  if (!died.ok()) return died.status();
  for (const ConfirmedPeer& c : confirmed) {
    spdlog::warn("job {}: rank {} (worker \"{}\") still beats but its peers cannot reach it: {}; "
                 "DEAD",
                 id(), c.rank, membership_.member(c.rank).worker_id, c.why);
    response->add_declared_dead(c.rank);
  }
  deaths_ += static_cast<int64_t>(dead.size());
  OnMembershipChange(*died, &out);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

absl::Status Job::ReportNonFinite(const v1::ReportNonFiniteRequest& request,
                                  v1::ReportNonFiniteResponse* response) {
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    plans = plans_.history();
  }
  // The level is one of the plan in force at the report's step.
  if (absl::Status s = CheckNonFiniteReport(
          request, plans->At(std::max<int64_t>(request.step(), 0)), id());
      !s.ok()) {
    return s;
  }
  const int32_t rank = request.rank();
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (!halted_.ok()) return halted_;
  if (absl::Status s =
          membership_.CheckCredential(rank, request.credential(), "ReportNonFinite", id());
      !s.ok()) {
    return s;
  }
  // The payload is the member's free text, shown in the log, the status page, the CLI and
  // events: its control and bidirectional formatting characters escaped.
  const std::string payload =
      request.payload().empty() ? "values" : EscapeControlCharacters(request.payload());
  const std::string& value = request.value();  // one of NaN, +Inf, -Inf (checked)
  const std::string reason = absl::StrCat(
      "rank ", rank, " contributed non-finite values (", value, " in tensor ",
      request.tensor(), " of its ", payload, ") at step ", request.step(), ", level ",
      request.level());
  const absl::Time now = clock_->Now();
  v1::NonFiniteReport report;
  report.set_rank(rank);
  report.set_generation(request.generation());
  report.set_step(request.step());
  report.set_level(request.level());
  report.set_tensor(request.tensor());
  report.set_value(value);
  report.set_payload(payload);
  report.set_unix_ms(UnixMs(now));
  // An elastic job goes on without the member, as after a failure: it is declared dead (a
  // member that is in the running round only; a report that comes after the job moved on
  // without it changes nothing).
  const bool retire = membership_.elastic() && membership_.state() == v1::RUNNING &&
                      membership_.InRound(rank);
  std::optional<MembershipChange> died;
  if (retire) {
    absl::StatusOr<MembershipChange> change = membership_.Die({rank}, reason, now);
    if (!change.ok()) return change.status();  // not written: nothing changed, nothing recorded
    died = *std::move(change);
    ++deaths_;
  }
  report.set_retired(retire);
  ++nonfinite_reports_;
  last_nonfinite_ = report;
  spdlog::warn("job {}: {} (worker \"{}\", generation {}); {}", id(), reason,
               membership_.member(rank).worker_id, request.generation(),
               retire ? "retired: DEAD"
               : membership_.elastic()
                   ? "the rank is no longer in the running round"
                   : "a strict job: every member's round fails and nothing changes");
  AddEvent(v1::JobEvent::MEMBER_NON_FINITE, rank,
           retire ? absl::StrCat(reason, "; retired") : reason, /*with_members=*/false, &out);
  if (died) OnMembershipChange(*died, &out);
  response->set_retired(retire);
  response->set_state(membership_.state());
  response->set_generation(membership_.generation());
  return absl::OkStatus();
}

uint64_t Job::Watch(std::shared_ptr<JobWatcher> watcher) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  const uint64_t watcher_id = next_watcher_id_++;
  if (!closed_.ok()) {
    out.CloseWatchers({watcher}, closed_);
    return watcher_id;
  }
  v1::JobEvent snapshot;
  snapshot.set_kind(v1::JobEvent::SNAPSHOT);
  ToProtoLocked(snapshot.mutable_job(), true);
  snapshot.set_rank(-1);
  snapshot.set_unix_ms(UnixMs(clock_->Now()));
  out.Event(watcher, std::move(snapshot));
  watchers_.emplace_back(watcher_id, std::move(watcher));
  return watcher_id;
}

void Job::Unwatch(uint64_t watcher_id) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(std::remove_if(watchers_.begin(), watchers_.end(),
                                 [&](const auto& w) { return w.first == watcher_id; }),
                  watchers_.end());
}

void Job::AddEvent(v1::JobEvent::Kind kind, int32_t rank, const std::string& message,
                   bool with_members, Outbox* out) {
  // The status page's history, whether or not anyone watches.
  history_.AddEvent({kind, rank, message, UnixMs(clock_->Now()), membership_.generation()});
  if (kind == v1::JobEvent::GENERATION_CHANGED && membership_.last_change()) {
    history_.AddGeneration(*membership_.last_change());
  } else if (kind == v1::JobEvent::WORLD_COMPLETE) {
    v1::GenerationChange start;
    start.set_generation(membership_.generation());
    start.set_rank(-1);
    start.set_reason(message);
    start.set_unix_ms(UnixMs(clock_->Now()));
    history_.AddGeneration(std::move(start));
  }
  // Streams whose client went away are dropped here.
  watchers_.erase(std::remove_if(watchers_.begin(), watchers_.end(),
                                 [](const auto& w) { return w.second->Done(); }),
                  watchers_.end());
  if (watchers_.empty()) return;
  v1::JobEvent event;
  event.set_kind(kind);
  ToProtoLocked(event.mutable_job(), with_members);
  event.set_rank(rank);
  event.set_message(message);
  event.set_unix_ms(UnixMs(clock_->Now()));
  out->Event(nullptr, std::move(event));
}

void Job::CancelWait(WaitId wait_id) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (std::optional<JoinWait> w = waits_.TakeJoin(wait_id)) {
    spdlog::info("job {}: rank {} left the generation {} round (its Join was cancelled)", id(),
                 w->rank, membership_.generation());
    // An assembling round's rank: nothing was written for it (Membership::Withdraw).
    membership_.Withdraw(w->rank);
    out.Complete([cb = std::move(w->done)]() mutable {
      cb(absl::CancelledError("the Join call was cancelled"));
    });
    return;
  }
  if (std::optional<CommIdWait> w = waits_.TakeCommId(wait_id)) {
    out.Complete([cb = std::move(w->done)]() mutable {
      cb(absl::CancelledError("the GetCommId call was cancelled"));
    });
  }
}

bool Job::SilentTogether(const std::vector<int32_t>& stale, absl::Time now) const {
  return !stale.empty() && AllSilent(now);
}

bool Job::AllSilent(absl::Time now) const {
  // Every member of the round (two or more) has been silent for over 3/4 of the timeout (a live
  // client beats every 100 ms), and no heartbeat stream broke.
  int32_t in_round = 0;
  for (int32_t r = 0; r < schedule_.world_size(); ++r) {
    if (!membership_.InRound(r)) continue;
    ++in_round;
    const LiveMember& m = membership_.member(r);
    if (m.stream_lost_at != absl::InfiniteFuture() ||
        now - m.last_heartbeat <= heartbeat_timeout() * 3 / 4) {
      return false;
    }
  }
  return in_round >= 2;
}

void Job::CheckStaleness() {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  const absl::Time now = clock_->Now();
  // After a restart, members re-attach within the grace period: a member is dead only once
  // both the grace period and its heartbeat timeout have passed.
  std::vector<int32_t> dead =
      now < grace_until_ ? std::vector<int32_t>{}
                         : membership_.Stale(now, heartbeat_timeout(), StreamLostGrace());
  if (!AllSilent(now)) silent_since_ = absl::InfiniteFuture();
  if (SilentTogether(dead, now) && silent_since_ == absl::InfiniteFuture()) silent_since_ = now;
  if (SilentTogether(dead, now) && now - silent_since_ < MaxSilentTogether()) {
    // Every member fell silent at once and no connection broke (a dead process's does): the
    // coordinator's own network is the likelier fault (docs/cluster.md). Nobody is declared
    // dead; the members get what a restart gives them, a grace to re-attach in, renewed while
    // the silence lasts, for at most MaxSilentTogether(). A member that does not come back is
    // declared dead once it is over.
    if (now >= grace_until_ + heartbeat_timeout() || grace_until_ == absl::InfinitePast()) {
      spdlog::warn("job {}: all {} members sent no heartbeat for over {} ms and no connection "
                   "broke: this coordinator looks cut off from them; declaring nobody dead "
                   "while it lasts",
                   id(), dead.size(), absl::ToInt64Milliseconds(heartbeat_timeout()));
    }
    grace_until_ = now + heartbeat_timeout();
    dead.clear();
  }
  if (!dead.empty()) DeclareDead(dead, now, &out);
  ExpireWaits(now, &out);
  if (plans_.proposed() != 0) MaybeFinishProposal(now, &out);
}

void Job::DeclareDead(const std::vector<int32_t>& dead, absl::Time now, Outbox* out) {
  bool all_lost = true;
  for (int32_t r : dead) {
    all_lost = all_lost && membership_.member(r).stream_lost_at != absl::InfiniteFuture();
  }
  std::string reason = absl::StrCat("rank ", dead[0],
                                    all_lost ? " connection lost" : " heartbeat timeout");
  if (dead.size() > 1) absl::StrAppend(&reason, " (and ", dead.size() - 1, " more ranks)");
  // Logged before the members change (their times are read here).
  std::vector<std::string> notes;
  for (int32_t r : dead) {
    const LiveMember& m = membership_.member(r);
    if (m.stream_lost_at != absl::InfiniteFuture()) {
      notes.push_back(absl::StrCat(
          "rank ", r, " (worker \"", m.worker_id, "\"): its heartbeat stream broke ",
          absl::ToInt64Milliseconds(now - m.stream_lost_at), " ms ago and no beat came since "
          "(the last ", absl::ToInt64Milliseconds(now - m.last_heartbeat), " ms ago)"));
    } else {
      notes.push_back(absl::StrCat("rank ", r, " (worker \"", m.worker_id,
                                   "\") sent no heartbeat for ",
                                   absl::ToInt64Milliseconds(now - m.last_heartbeat), " ms"));
    }
  }
  absl::StatusOr<MembershipChange> died = membership_.Die(dead, reason, now);
  if (!died.ok()) {
    // The death cannot be recorded: going on without it would make a restarted coordinator
    // bring the dead back (and issue the next generation twice). The job stops, loudly, until
    // the write succeeds (tried again at every check).
    if (halted_.ok()) {
      halted_ = absl::UnavailableError(absl::StrCat(
          "job ", id(), " is halted: the death of ", reason, " cannot be recorded (",
          last_save_error_.message(),
          "); the job resumes once the coordinator can write its state again"));
      spdlog::error("{}", std::string(halted_.message()));
      FailAllWaits(halted_, out);
    }
  } else {
    if (!halted_.ok()) {
      spdlog::info("job {}: its state is written again; no longer halted", id());
      halted_ = absl::OkStatus();
    }
    for (const std::string& note : notes) spdlog::warn("job {}: {}; DEAD", id(), note);
    deaths_ += static_cast<int64_t>(dead.size());
    OnMembershipChange(*died, out);
  }
}

void Job::ExpireWaits(absl::Time now, Outbox* out) {
  for (JoinWait& w : waits_.TakeExpiredJoins(now)) {
    if (w.for_replica) {
      ExpireReplicaWait(std::move(w), out);
      continue;
    }
    const std::string missing = membership_.MissingRanks(kMaxListedRanks);
    std::string msg = absl::StrCat(
        "join of job ", id(), " (generation ", membership_.generation(), ") timed out: ",
        membership_.round_size(), " of ", schedule_.world_size(),
        " ranks joined; missing ranks: ", missing,
        "; start the missing workers or raise join_timeout_ms");
    spdlog::warn("job {}: rank {} (worker \"{}\") Join timed out; missing ranks: {}", id(),
                 w.rank, membership_.member(w.rank).worker_id, missing);
    membership_.Withdraw(w.rank);  // nothing was written for it (Membership::Withdraw)
    out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
  }
  for (CommIdWait& w : waits_.TakeExpiredCommIds(now)) {
    const auto& [level, subgroup, key] = w.key;
    const int32_t leader = schedule_.Subgroup(level, subgroup).first_rank;
    std::string msg = absl::StrCat(
        "no id was published for level ", level, ", subgroup ", subgroup, ", key \"", key,
        "\" of job ", id(), " in generation ", membership_.generation(),
        " before the deadline; is rank ", leader, " (the subgroup's leader) alive?");
    out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
      cb(absl::DeadlineExceededError(msg));
    });
  }
}

void Job::ExpireReplicaWait(JoinWait w, Outbox* out) {
  const int32_t s = membership_.replica_size();
  const int32_t replica = w.rank / s;
  std::vector<int32_t> joined, missing;
  for (int32_t r = replica * s; r < replica * s + s; ++r) {
    (membership_.Waiting(r) ? joined : missing).push_back(r);
  }
  std::string msg = absl::StrCat(
      "join of job ", id(), " as rank ", w.rank, " timed out: a replacement replica is admitted "
      "whole, and ranks ", absl::StrJoin(missing, ", "), " of replica ", replica,
      " did not join (joined: ", absl::StrJoin(joined, ", "),
      "); start every rank of the replica or raise join_timeout_ms");
  spdlog::warn("job {}: rank {} waited for its replica {} in vain (missing ranks: {})", id(),
               w.rank, replica, absl::StrJoin(missing, ", "));
  membership_.Withdraw(w.rank);  // it only waited: nothing of it was written
  out->Complete([cb = std::move(w.done), msg = std::move(msg)]() mutable {
    cb(absl::DeadlineExceededError(msg));
  });
}

void Job::ToProto(v1::Job* out, int64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  ToProtoLocked(out, true, max_bytes);
}

void Job::ToProtoLocked(v1::Job* out, bool with_members, int64_t max_bytes) const {
  if (with_members) {
    // An upper bound of the members' encoded size: strings plus 9 varints (10 bytes at most)
    // and 3 tags/lengths each.
    int64_t bytes = 0;
    for (int32_t r = 0; r < membership_.world_size(); ++r) {
      const LiveMember& m = membership_.member(r);
      if (m.present()) bytes += static_cast<int64_t>(m.worker_id.size() + m.host.size()) + 112;
    }
    if (bytes > max_bytes - 16 * 1024) {
      with_members = false;
      out->set_members_omitted(true);
    }
  }
  *out->mutable_spec() = spec_;
  out->mutable_spec()->set_heartbeat_timeout_ms(absl::ToInt64Milliseconds(heartbeat_timeout()));
  out->mutable_spec()->set_join_timeout_ms(absl::ToInt64Milliseconds(join_timeout_));
  out->set_state(membership_.state());
  const int64_t generation = membership_.generation();
  out->set_generation(generation);
  const absl::Time now = clock_->Now();
  int64_t min_step = -1, max_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    const LiveMember& m = membership_.member(r);
    if (!m.present()) continue;
    if (m.generation == generation && m.last_step >= 0) {
      min_step = min_step < 0 ? m.last_step : std::min(min_step, m.last_step);
      max_step = std::max(max_step, m.last_step);
    }
    if (!with_members) continue;
    v1::Member* p = out->add_members();
    p->set_rank(r);
    p->set_worker_id(m.worker_id);
    p->set_host(m.host);
    p->set_last_step(m.last_step);
    p->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - m.last_heartbeat));
    p->set_state(m.state);
    p->set_generation(m.generation);
    p->set_admitted_step(m.admitted_step);
    p->set_replica(schedule_.ReplicaOf(r));
    p->set_shard(schedule_.ShardOf(r));
    if (m.state == v1::RETIRED) {
      p->set_retired_by(m.retired_by);
      p->set_retired_at_step(m.retired_at_step);
    }
  }
  out->set_min_step(min_step);
  out->set_max_step(max_step);
  if (membership_.last_change()) *out->mutable_last_change() = *membership_.last_change();
  for (const std::string& w : warnings_) out->add_warnings(w);
  if (!halted_.ok()) out->add_warnings(std::string(halted_.message()));
  out->set_created_unix_ms(created_unix_ms_);
  out->set_live_world_size(membership_.round_size());
  for (int32_t r : membership_.VacantRanks()) out->add_vacant_ranks(r);
  for (int32_t r : membership_.WaitingRanks()) out->add_waiting_ranks(r);
  out->set_deaths(deaths_);
  out->set_admissions(admissions_);
  out->set_nonfinite_reports(nonfinite_reports_);
  if (last_nonfinite_) *out->mutable_last_nonfinite() = *last_nonfinite_;
  for (const v1::PlanChange& c : plans_.plans()) *out->add_plan_history() = c;
  // The plan in force at the members' smallest step, and the one still to come.
  const int version = plans_.history()->VersionAt(std::max<int64_t>(min_step, 0));
  out->set_plan_version(version);
  if (version > 0) {
    *out->mutable_spec() = plans_.plans()[version].spec();
    out->mutable_spec()->set_heartbeat_timeout_ms(
        absl::ToInt64Milliseconds(heartbeat_timeout()));
    out->mutable_spec()->set_join_timeout_ms(absl::ToInt64Milliseconds(join_timeout_));
  }
  if (const v1::PlanChange* pending = plans_.Pending(std::max<int64_t>(min_step, 0))) {
    *out->mutable_pending_plan() = *pending;
  }
}

std::vector<LoggedEvent> Job::RecentEvents() const {
  absl::MutexLock lock(&mu_);
  return history_.events();
}

std::vector<v1::GenerationChange> Job::GenerationHistory() const {
  absl::MutexLock lock(&mu_);
  return history_.generations();
}

Job::Stats Job::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats stats;
  stats.workers = membership_.round_size();
  stats.generation = membership_.generation();
  stats.state = membership_.state();
  int64_t min_step = -1, max_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    const LiveMember& m = membership_.member(r);
    if (!membership_.InRound(r) || m.last_step < 0) continue;
    min_step = min_step < 0 ? m.last_step : std::min(min_step, m.last_step);
    max_step = std::max(max_step, m.last_step);
  }
  stats.step_lag = max_step - min_step;
  stats.vacant_ranks = static_cast<int32_t>(membership_.VacantRanks().size());
  stats.deaths = deaths_;
  stats.admissions = admissions_;
  stats.nonfinite_reports = nonfinite_reports_;
  stats.plan_updates = plans_.size() - 1;
  return stats;
}

void Job::UpdateJob(const v1::UpdateJobRequest& request, UpdateCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status status) {
    out.Complete([done = std::move(done), status = std::move(status)]() mutable {
      done(std::move(status));
    });
  };
  if (!closed_.ok()) return fail(closed_);
  if (!halted_.ok()) return fail(halted_);
  v1::JobSpec next = request.spec();
  next.DiscardUnknownFields();
  if (next.job_id() != id()) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "spec.job_id \"", EscapeControlCharacters(next.job_id()), "\" is not the job's (\"", id(),
        "\"): a job's id may not change; name the job in both job_id and spec.job_id")));
  }
  absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(next);
  if (!schedule_spec.ok()) return fail(schedule_spec.status());
  absl::StatusOr<Schedule> schedule = Schedule::Create(*std::move(schedule_spec));
  if (!schedule.ok()) return fail(schedule.status());
  const PlanHistory& history = *plans_.history();
  const ScheduleSpec& current = history.Latest().spec();
  if (absl::Status s = ValidatePlanChange(current, schedule->spec()); !s.ok()) return fail(s);
  const int32_t world = schedule_.world_size();
  const bool elastic_next = next.min_world_size() > 0 && next.min_world_size() < world;
  if (elastic_next != membership_.elastic()) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "min_world_size ", next.min_world_size(), " would make the ",
        membership_.elastic() ? "elastic" : "strict", " job ",
        membership_.elastic() ? "strict" : "elastic",
        "; a running job keeps its kind (an elastic job's min_world_size may change within 1..",
        world - 1, ")")));
  }
  if (next.join_timeout_ms() != 0 &&
      absl::Milliseconds(next.join_timeout_ms()) != join_timeout_) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "join_timeout_ms may not change in a running job (", absl::ToInt64Milliseconds(join_timeout_),
        " -> ", next.join_timeout_ms(), "); leave it 0 or as it is")));
  }
  if (membership_.state() != v1::RUNNING) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), " is ", StateName(membership_.state()),
        "; UpdateJob changes the plan of a RUNNING job (before the world is complete, delete and "
        "re-create the job with the new spec)")));
  }
  if (plans_.proposed() != 0) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), ": an update (plan version ", plans_.proposed(),
        ") is being proposed to the members; retry once it is answered")));
  }
  const int64_t min_step = MinStep();
  if (const v1::PlanChange* pending = plans_.Pending(std::max<int64_t>(min_step, 0))) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), ": plan version ", pending->version(), " switches at step ",
        pending->switch_step(), " and the members' smallest step is ", min_step,
        "; one update at a time: retry once every member has passed the switch")));
  }
  const absl::Time now = clock_->Now();
  if (now < grace_until_) {
    return fail(absl::UnavailableError(absl::StrCat(
        "job ", id(), ": the coordinator started ", "recently and its members are re-attaching (",
        absl::ToInt64Milliseconds(grace_until_ - now),
        " ms of recovery grace left); it cannot know yet how far each may still go on the "
        "current plan: retry then")));
  }
  if (schedule->spec().warmup_steps != current.warmup_steps) {
    int64_t max_step = -1;
    for (int32_t r = 0; r < world; ++r) {
      if (membership_.InRound(r)) max_step = std::max(max_step, membership_.member(r).last_step);
    }
    if (max_step >= current.warmup_steps) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "warmup_steps may change only while no member has passed the warm-up: a member is at "
          "step ", max_step, ", past warmup_steps ", current.warmup_steps,
          "; keep warmup_steps ", current.warmup_steps)));
    }
  }
  const absl::Duration answer_within =
      std::clamp(heartbeat_timeout(), absl::Seconds(1), absl::Seconds(5));
  spdlog::info("job {}: proposing plan version {} to its {} members (they answer within {} ms)",
               id(), plans_.size(), membership_.round_size(),
               absl::ToInt64Milliseconds(answer_within));
  plans_.Propose(std::move(next), *std::move(schedule), now + answer_within, std::move(done));
  MaybeFinishProposal(now, &out);
}

int64_t Job::MinStep() const {
  int64_t min_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    if (!membership_.InRound(r)) continue;
    const int64_t step = membership_.member(r).last_step;
    if (step >= 0) min_step = min_step < 0 ? step : std::min(min_step, step);
  }
  return min_step;
}

void Job::FailProposal(const absl::Status& status, Outbox* out) {
  PlanUpdates::Proposal p = plans_.TakeProposal();
  spdlog::warn("job {}: plan version {} not accepted: {}", id(), p.version, status.ToString());
  out->Complete([done = std::move(p.done), status]() mutable { done(status); });
}

void Job::MaybeFinishProposal(absl::Time now, Outbox* out) {
  if (membership_.state() != v1::RUNNING) {
    return FailProposal(absl::AbortedError(absl::StrCat(
                            "job ", id(), " left RUNNING (", StateName(membership_.state()),
                            ") while the update was proposed; retry once it runs again")),
                        out);
  }
  std::vector<int32_t> members;
  std::vector<int64_t> steps;
  int64_t floor = 0;
  int32_t answered = 0;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    if (!membership_.InRound(r)) continue;
    const LiveMember& m = membership_.member(r);
    members.push_back(r);
    steps.push_back(m.last_step);
    // Admissions planned already happen under the plan they were planned in.
    floor = std::max(floor, m.admitted_step + 1);
    if (plans_.Answered(r)) ++answered;
  }
  const bool all = answered == static_cast<int32_t>(members.size());
  if (!all && now < plans_.proposal()->deadline) return;
  const int64_t switch_step = plans_.ChooseSwitchStep(members, steps, floor);
  PlanUpdates::Proposal p = plans_.TakeProposal();
  const ScheduleSpec& current = plans_.history()->Latest().spec();
  if (p.schedule.spec().warmup_steps != current.warmup_steps &&
      switch_step > current.warmup_steps) {
    out->Complete([done = std::move(p.done), switch_step, w = current.warmup_steps]() mutable {
      done(absl::FailedPreconditionError(absl::StrCat(
          "warmup_steps may change only before the members pass the warm-up, and the switch "
          "would be at step ", switch_step, ", past warmup_steps ", w, "; keep warmup_steps ",
          w)));
    });
    return;
  }
  v1::PlanChange change = PlanUpdates::ChangeOf(p, switch_step, UnixMs(now));
  JobDelta delta;
  delta.plan_change = change;
  if (absl::Status s = Save(delta); !s.ok()) {
    out->Complete([done = std::move(p.done), s]() mutable { done(s); });
    return;
  }
  const Schedule latest = p.schedule;
  if (absl::Status s = plans_.Accept(change, std::move(p.schedule)); !s.ok()) {
    // Validated above; a failure here is a bug, and nothing was changed in memory.
    spdlog::error("job {}: plan version {} was written but not accepted: {}", id(),
                  change.version(), s.ToString());
    out->Complete([done = std::move(p.done), s]() mutable { done(absl::InternalError(s.message())); });
    return;
  }
  membership_.SetPlan(latest, switch_step);
  ApplySoftFields(change.spec());
  const std::string message = absl::StrCat(
      "plan version ", change.version(), " accepted: every member switches to it at step ",
      switch_step, " (", answered, " of ", members.size(), " members gave back their decisions",
      all ? "" : "; the others hold the switch back to the end of theirs", ")");
  spdlog::info("job {}: {}", id(), message);
  v1::GenerationChange entry;
  entry.set_generation(membership_.generation());
  entry.set_rank(-1);
  entry.set_reason(absl::StrCat("plan version ", change.version(), " from step ", switch_step));
  entry.set_unix_ms(UnixMs(now));
  history_.AddGeneration(std::move(entry));
  AddEvent(v1::JobEvent::PLAN_UPDATED, -1, message, false, out);
  v1::UpdateJobResponse response;
  response.set_switch_step(switch_step);
  response.set_plan_version(change.version());
  ToProtoLocked(response.mutable_job(), false);
  out->Complete([done = std::move(p.done), response = std::move(response)]() mutable {
    done(std::move(response));
  });
}

void Job::Close(const absl::Status& status, bool deleted) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return;
  closed_ = status;
  deleted_ = deleted;
  FailAllWaits(status, &out);
  if (plans_.proposed() != 0) FailProposal(status, &out);
  if (deleted) AddEvent(v1::JobEvent::JOB_DELETED, -1, status.ToString(), false, &out);
  std::vector<std::shared_ptr<JobWatcher>> closing;
  for (auto& [wid, w] : watchers_) closing.push_back(std::move(w));
  watchers_.clear();
  if (!closing.empty()) out.CloseWatchers(std::move(closing), status);
}

}  // namespace modelavg::server
