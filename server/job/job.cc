// The Job's shared state and lifecycle: construction and restore, the write of each transition
// (Save), what follows a membership change (waits failed, ids dropped, events), the staleness
// check, cancelled waits, and Close. The RPCs are in the families: job_rounds.cc (membership and
// rounds), job_plans.cc (schedule and plans), job_views.cc (operator calls and views).
#include "server/job/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "server/job/job_internal.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

absl::Duration OrDefault(int64_t ms, absl::Duration fallback) {
  return ms > 0 ? absl::Milliseconds(ms) : fallback;
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
      plans_(spec_, schedule_, created_unix_ms) {
  if (schedule_.PacedLevel() >= 0) {
    // Pacing::Create fails only for a plan without a paced level.
    absl::StatusOr<PacedPlan> paced = PacedPlan::Create(schedule_);
    if (paced.ok()) paced_.emplace(*std::move(paced));
    membership_.SetAdmissionChooser(
        [this](const std::vector<int32_t>& ranks) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          // Called by membership_'s Join, under mu_.
          return PacedAdmission(ranks);
        });
  }
}

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
  if (paced_) {
    if (absl::Status s = paced_->Restore(stored.paced_rounds); !s.ok()) {
      spdlog::error("job {}: its stored paced rounds do not load ({}); the job is halted", id(),
                    s.ToString());
      halted_ = absl::DataLossError(absl::StrCat(
          "job ", id(), ": its stored paced rounds do not load (", s.message(),
          "); delete and re-create the job"));
      return;
    }
    if (!stored.paced_rounds.empty()) {
      spdlog::info("job {}: paced rounds {}..{} restored", id(),
                   stored.paced_rounds.front().round(), stored.paced_rounds.back().round());
    }
  }
  if (plans_.size() > 1) {
    const PlanHistory& history = *plans_.history();
    membership_.SetPlan(history.Latest(), history.SwitchStep(plans_.size() - 1));
    ApplySoftFields(plans_.plans().back().spec());
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
  CheckStragglers(now, &out);
  ExpireWaits(now, &out);
  if (plans_.proposed() != 0) MaybeFinishProposal(now, &out);
}

void Job::CheckStragglers(absl::Time now, Outbox* out) {
  if (!paced_ || !membership_.elastic() || membership_.state() != v1::RUNNING ||
      now < grace_until_ || !halted_.ok()) {
    return;
  }
  const double max_lag = schedule_.spec().levels.back().max_lag;
  if (max_lag <= 0) return;
  std::vector<bool> live(schedule_.world_size());
  for (int32_t r = 0; r < schedule_.world_size(); ++r) live[r] = membership_.InRound(r);
  const std::vector<int32_t> late = paced_->Stragglers(now, max_lag, live);
  if (late.empty()) return;
  DeclareDead(late, now, out,
              absl::StrCat("fell more than max_lag ", max_lag, " x its expected round time "
                           "behind the paced round the first group reached (docs/paced.md): "
                           "failed out as a straggler"));
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
