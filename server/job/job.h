// One job's coordination state: one state machine under one mutex, composed of parts that know
// nothing of each other's storage: the membership and generations (server/membership/membership.h), the
// comm-id store (server/job/comm_id_store.h), the pending waits (server/job/pending_waits.h) and the
// event fan-out to watchers (here). At each hard-state transition the Job hands the change to its
// StateStore (server/store/state_store.h) before it answers. No gRPC in here: waits are callbacks that
// the Job completes (outside its lock) when their condition is met, their deadline passes, the
// generation changes, the job is deleted or the coordinator stops.
//
// Its calls come in three families, each in a file of its own over the state below (job.cc: that
// state's lifecycle and what the families share): membership and rounds (job_rounds.cc), schedule
// and plans (job_plans.cc), operator calls and views (job_views.cc). An RPC of a job is one
// method of one family; server/rpc/coordinator_rpcs.h routes it.
#ifndef MODELAVG_SERVER_JOB_JOB_H_
#define MODELAVG_SERVER_JOB_JOB_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/job/comm_id_store.h"
#include "server/job/event_log.h"
#include "server/job/pending_waits.h"
#include "server/job/request_checks.h"
#include "server/membership/decisions.h"
#include "server/membership/membership.h"
#include "server/pacing/paced_plan.h"
#include "server/membership/plan_updates.h"
#include "server/membership/peer_reports.h"
#include "server/store/state_store.h"

namespace modelavg::server {

// Receives a job's events in order. `OnEvent` and `OnClosed` are called outside the Job's lock,
// one at a time per job, and must not block. After OnClosed no more calls come.
class JobWatcher {
 public:
  virtual ~JobWatcher() = default;
  virtual void OnEvent(const v1::JobEvent& event) = 0;
  // The stream ends: the job was deleted (ABORTED) or the coordinator stops (UNAVAILABLE).
  virtual void OnClosed(const absl::Status& status) = 0;
  // True once the receiving end is gone; the Job then drops the watcher.
  virtual bool Done() const { return false; }
};

// GetJob and ListJobs answers stay below gRPC's default 4 MiB receive limit (clients, grpcurl):
// a job whose members would pass this is shown without them.
inline constexpr int64_t kMaxJobReplyBytes = 4 * 1024 * 1024 - 64 * 1024;

// Daemon-wide defaults for the per-job timeouts (a spec's 0 means "use these").
struct JobDefaults {
  absl::Duration heartbeat_timeout = absl::Milliseconds(3000);
  absl::Duration join_timeout = absl::Milliseconds(300000);
};

// A change of hard state takes effect if and only if it is durable: every call that changes it
// writes the change to the StateStore before anything in memory changes for others to see and
// before it answers. When the write fails the call fails with UNAVAILABLE (naming the store and
// why: disk full, read-only, directory gone) and memory is exactly as before the call, so a
// retry is a first attempt again. A death the coordinator declares itself (heartbeat timeout)
// that cannot be written halts the job instead: every call about it answers UNAVAILABLE saying
// so, pending waits fail, and the write is tried again at every staleness check; once it
// succeeds the job goes on.
class Job {
 public:
  // `spec` must have been validated into `schedule` (ScheduleSpecFromProto). `store` (not owned,
  // outlives the Job) already holds the job (StateStore::CreateJob); the Job writes its
  // transitions to it.
  Job(v1::JobSpec spec, Schedule schedule, const JobDefaults& defaults, Clock* clock,
      StateStore* store, int64_t created_unix_ms);
  ~Job();

  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Continues from the state a StateStore kept (after a coordinator restart): the generation,
  // its members and its ids. No member is declared dead before `grace` has passed (its
  // heartbeat timeout at least): the workers re-attach with their next heartbeat. Call before
  // the Job is shared.
  void Restore(const StoredJob& stored, absl::Duration grace);

  const std::string& id() const { return spec_.job_id(); }
  // The spec as created (timeouts of 0 not yet resolved to the defaults).
  const v1::JobSpec& spec() const { return spec_; }
  int32_t world_size() const { return schedule_.world_size(); }
  int64_t created_unix_ms() const { return created_unix_ms_; }
  // May change with UpdateJob (from the moment it is accepted).
  absl::Duration heartbeat_timeout() const {
    return absl::Milliseconds(heartbeat_timeout_ms_.load(std::memory_order_relaxed));
  }
  absl::Duration join_timeout() const { return join_timeout_; }

  // ---- Membership and rounds (job_rounds.cc) ----

  // Rendezvous (the contract in docs/coordinator.md). `done` gets the JoinResponse once
  // every rank has joined this generation; a Join of a RUNNING elastic job (a replacement, see
  // Membership::Join) is answered at once with its admission_step. Or:
  //   INVALID_ARGUMENT    empty/too long worker_id, rank outside [0, world_size), a world_size
  //                       (when set) other than the job's
  //   ALREADY_EXISTS      another worker holds the requested rank in this generation
  //   FAILED_PRECONDITION the job is RUNNING and this is not a re-join (job full), or FINISHED;
  //                       an elastic job has no vacant rank, or no admission step
  //   UNAVAILABLE         (elastic admission) a member has not reported its step yet: retry
  //   DEADLINE_EXCEEDED   min(join timeout, `call_deadline`) passed; names the missing ranks
  //   ABORTED             the generation changed while waiting, or the job was deleted
  //   CANCELLED           CancelWait(wait_id)
  //   UNAVAILABLE         the coordinator stops
  void Join(const v1::JoinRequest& request, absl::Time call_deadline, WaitId wait_id,
            JoinCallback done);

  // Liveness and progress; never fails for a stale generation. INVALID_ARGUMENT for a rank
  // outside [0, world_size) or a negative step; after Close, NOT_FOUND when the job was deleted
  // (as for a beat that names it later: a worker ends its session on it, while an ABORTED beat
  // reads as a passing fault that it would wait out), else its status (UNAVAILABLE: stopping).
  absl::Status Heartbeat(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response);

  // Elastic jobs: the HeartbeatStream of `rank` (whose member holds `credential`) broke without
  // a clean end (HeartbeatRequest.closing): its process died or its connection dropped. Unless
  // a beat comes within half the heartbeat timeout (a live client re-opens a broken stream well
  // within that), the member is declared dead then rather than at the full timeout. Ignored for
  // a strict job and for anyone but the rank's member.
  void HeartbeatStreamLost(int32_t rank, const std::string& credential);

  // Orderly exit of one rank (any generation). INVALID_ARGUMENT for a bad rank,
  // FAILED_PRECONDITION if the rank never joined.
  absl::Status Leave(const v1::LeaveRequest& request, v1::LeaveResponse* response);

  // A member's round failed and it names the peers it could not reach over the data network
  // (a gray failure). The report is kept for PeerReportTtl(); once the reports confirm a
  // suspect (server/membership/peer_reports.h) it is declared DEAD and the generation moves on, as after a
  // heartbeat timeout; response->declared_dead lists who. A report alone evicts nobody.
  // A report of an older generation is answered with the current one and ignored.
  // INVALID_ARGUMENT (bad rank, a named rank outside the world), PERMISSION_DENIED
  // (credential), FAILED_PRECONDITION (the job is not RUNNING, or the rank is not in its round).
  absl::Status ReportPeerFailure(const v1::ReportPeerFailureRequest& request,
                                 v1::ReportPeerFailureResponse* response);
  // A member found non-finite values in its contribution to a round and kept them out of it.
  // Recorded (nonfinite_reports, last_nonfinite, a MEMBER_NON_FINITE event); in a RUNNING
  // elastic job whose current round the rank is in, the rank is declared DEAD with the report
  // as the reason (written first, like every death) and the generation moves on without it:
  // response->retired. A strict job's generation stays (every member failed that round, and
  // nothing changed). INVALID_ARGUMENT (CheckNonFiniteReport), PERMISSION_DENIED (credential),
  // FAILED_PRECONDITION (the rank never joined), UNAVAILABLE (halted; the death's write failed).
  absl::Status ReportNonFinite(const v1::ReportNonFiniteRequest& request,
                               v1::ReportNonFiniteResponse* response);
  // How long a peer failure report counts: twice the heartbeat timeout, at least 5 s (the
  // members of a failed round report within about a second of each other).
  absl::Duration PeerReportTtl() const {
    return std::max(2 * heartbeat_timeout(), absl::Seconds(5));
  }

  // ---- Schedule and plans (job_plans.cc) ----

  // The decision for (rank, step). INVALID_ARGUMENT for a bad rank or step < 0;
  // FAILED_PRECONDITION for a stale generation or a job that is not RUNNING.
  absl::Status Step(const v1::StepRequest& request, v1::StepDecision* response);

  // A window of decisions. INVALID_ARGUMENT for from_step < 0, count outside [1, 100000], a bad
  // rank, or an answer that would exceed kMaxScheduleReplyBytes. `cancelled` (may be null) is
  // polled while the answer is built: once it says true the call stops with CANCELLED.
  absl::Status GetSchedule(const v1::GetScheduleRequest& request,
                           v1::GetScheduleResponse* response,
                           const std::function<bool()>& cancelled = nullptr);

  // Stores a bootstrap blob for the current generation. INVALID_ARGUMENT (level, subgroup, rank,
  // key length, empty or oversize blob), FAILED_PRECONDITION (stale generation, job not
  // RUNNING), PERMISSION_DENIED (rank not in the subgroup), ALREADY_EXISTS (same key, other
  // bytes; identical bytes are OK).
  absl::Status PublishCommId(const v1::PublishCommIdRequest& request);

  // Waits for a blob. Errors as PublishCommId, plus DEADLINE_EXCEEDED, ABORTED (generation
  // changed, job deleted), CANCELLED (CancelWait), UNAVAILABLE (coordinator stops).
  void GetCommId(const v1::GetCommIdRequest& request, absl::Time call_deadline, WaitId wait_id,
                 CommIdCallback done);

  // A new plan for the RUNNING job (docs/plan-updates.md). `done` gets the switch step once the
  // members answered the proposal (or its deadline passed) and the plan is written. Or:
  //   INVALID_ARGUMENT    the spec does not validate (as CreateJob's), or changes job_id,
  //                       world_size, mode, replica_size or whether the job is elastic
  //   FAILED_PRECONDITION the job is not RUNNING; an update is being proposed or has not
  //                       switched yet; warmup_steps changes after a member passed it
  //   UNAVAILABLE         the members have not all re-attached since the coordinator started
  //                       (retry after the recovery grace); the plan could not be written
  //   ABORTED             the job left RUNNING or was deleted while the update was proposed
  void UpdateJob(const v1::UpdateJobRequest& request, UpdateCallback done);

  // ---- Operator calls and views (job_views.cc) ----

  // The job as the API shows it. When the members would make it larger than `max_bytes`,
  // they are left out and members_omitted is set.
  void ToProto(v1::Job* out, int64_t max_bytes = kMaxJobReplyBytes) const;

  // Figures for metrics: current members in the round, generation, max-min step.
  struct Stats {
    int32_t workers = 0;
    int64_t generation = 0;
    int64_t step_lag = 0;
    v1::JobState state = v1::PENDING;
    // Elastic jobs: ranks of the running job that no live worker holds.
    int32_t vacant_ranks = 0;
    // Members declared dead (heartbeat timeout) since the job was created (or restored).
    int64_t deaths = 0;
    // Replacements admitted into the running elastic job since the job was created (or
    // restored).
    int64_t admissions = 0;
    // Members' reports of non-finite values (ReportNonFinite) since the job was created (or
    // restored).
    int64_t nonfinite_reports = 0;
    // Plans accepted by UpdateJob since the job was created (or restored: all stored ones).
    int64_t plan_updates = 0;
    // A paced job: the rounds planned, and the share of the members' time its last round saves
    // from waiting (PacingStatus.idle_saved).
    bool paced = false;
    int64_t paced_rounds = 0;
    double idle_saved = 0;
  };
  Stats GetStats() const;

  // The job's recent events and generation changes (bounded, oldest first; since the job was
  // created or the coordinator restarted). For people: the status page.
  std::vector<LoggedEvent> RecentEvents() const;
  std::vector<v1::GenerationChange> GenerationHistory() const;

  // Registers a watcher; its first event is a SNAPSHOT. Returns an id for Unwatch.
  uint64_t Watch(std::shared_ptr<JobWatcher> watcher);
  void Unwatch(uint64_t watcher_id);

  // ---- Lifecycle (job.cc) ----

  // Heartbeat timeouts (RUNNING only) and due waits, as of the clock's now. Called periodically.
  void CheckStaleness();

  // Completes the wait with CANCELLED if it is still pending (no-op otherwise). A cancelled Join
  // leaves the round so the rank is free again.
  void CancelWait(WaitId wait_id);

  // Fails every pending wait with `status` and closes every watcher (ABORTED on DeleteJob,
  // UNAVAILABLE on stop). Later waits fail with `status` at once.
  void Close(const absl::Status& status, bool deleted);

 private:
  // Work collected under mu_ and run after it is released: completions in any order, events in
  // the order they happened (delivery_mu_ keeps batches of concurrent calls in order). Defined in
  // job_internal.h, which the families share.
  class Outbox;

  // How long after a broken HeartbeatStream a member without a beat since is declared dead.
  absl::Duration StreamLostGrace() const { return heartbeat_timeout() / 2; }
  // Whether members are `stale` while every member of the round (two or more) has been silent
  // for over 3/4 of the heartbeat timeout and none of their heartbeat streams broke: the
  // coordinator, not the members, lost the network.
  bool SilentTogether(const std::vector<int32_t>& stale, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every member of the round (two or more) silent for over 3/4 of the timeout, no stream broke.
  bool AllSilent(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How long a silence of every member is ridden through before the silent are declared dead
  // as usual (they may all be gone: a whole job killed at once).
  absl::Duration MaxSilentTogether() const { return 3 * heartbeat_timeout(); }
  // A sharded replacement waits for the rest of its replica (Membership::Waiting) until
  // `deadline`; `superseding`: the same worker waited already (its older Join ends).
  void WaitForReplica(int32_t rank, bool superseding, std::string credential,
                      absl::Time deadline, bool ranks_from_spec, WaitId wait_id,
                      JoinCallback done, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A replacement waited for its replica past its deadline: DEADLINE_EXCEEDED naming the ranks
  // that did not join.
  void ExpireReplicaWait(JoinWait wait, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the Join of a replacement admitted into the running elastic job (at once).
  void AnswerAdmission(int32_t rank, const MembershipChange& change, std::string credential,
                       bool ranks_from_spec, JoinCallback done, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round is complete: answers every Join waiting for it.
  void CompleteRound(Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reacts to what a membership operation did: fails the waits of an old generation, drops its
  // ids, completes the round's Joins, logs and emits events.
  void OnMembershipChange(const MembershipChange& change, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes one transition to the store: membership_'s writer (every membership change that
  // has hard state, before it takes effect) and PublishCommId. UNAVAILABLE naming the store's
  // error (kept in last_save_error_) when the write fails.
  absl::Status Save(const JobDelta& delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Members the staleness check found dead (heartbeat timeout, broken stream): written, then
  // the generation moves on; a death that cannot be written halts the job (see the class).
  // `straggler`: a paced job's max_lag failed them out (docs/paced.md), else a heartbeat
  // timeout or a lost connection.
  void DeclareDead(const std::vector<int32_t>& dead, absl::Time now, Outbox* out,
                   const std::string& straggler = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the Join and GetCommId waits whose deadline passed.
  void ExpireWaits(absl::Time now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes every pending Join and GetCommId of the job with `status` (with
  // `keep_replica_waits`, not the Joins of replacements waiting for their replica).
  void FailAllWaits(const absl::Status& status, Outbox* out, bool keep_replica_waits = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `with_ranks`: the subgroups list their member ranks (the Join did not ask for
  // subgroup_ranks_from_spec).
  void FillJoinResponse(int32_t rank, bool with_ranks, v1::JoinResponse* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StaleMessage(int64_t generation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when the job takes a call of `rank`'s member now: not closed, not halted, and
  // `credential` is the member's (Membership::CheckCredential, naming `rpc`).
  absl::Status CheckMemberCall(int32_t rank, const std::string& credential,
                               const char* rpc) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateCommRequest(int64_t generation, int32_t plan, int32_t level,
                                   int32_t subgroup, int32_t rank, const std::string& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ToProtoLocked(v1::Job* out, bool with_members,
                     int64_t max_bytes = kMaxJobReplyBytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddEvent(v1::JobEvent::Kind kind, int32_t rank, const std::string& message,
                bool with_members, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the proposal under way once every member of the round answered it or its deadline
  // passed (`now`): chooses the switch step, writes the plan, answers UpdateJob.
  void MaybeFinishProposal(absl::Time now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailProposal(const absl::Status& status, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The fields of an accepted plan that take effect at once (heartbeat timeout, an elastic
  // job's min_world_size).
  void ApplySoftFields(const v1::JobSpec& spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Paced jobs (paced_ set): `rank`'s decision at `step`, and a window of GetSchedule (planning
  // the rounds they need; the window ends at the rank's last planned sync step).
  absl::StatusOr<Decision> PacedDecision(int32_t rank, int64_t step, const MemberSteps& members)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PacedWindow(const v1::GetScheduleRequest& request, int64_t generation,
                           const MemberSteps& members, v1::GetScheduleResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Level.max_lag of a paced elastic job: fails out the groups too far behind (docs/paced.md).
  void CheckStragglers(absl::Time now, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans (and stores first) the rounds `rank` needs to be decided at `step`.
  absl::Status PlanPaced(int32_t rank, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores rounds just planned, then makes them the plan's (never handed out unstored).
  absl::Status StoreAndCommit(std::vector<PlannedRound> rounds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The admission step of replacements taking `ranks` in a paced job: their group's sync step
  // of the round planned now for it (Membership::SetAdmissionChooser).
  absl::StatusOr<int64_t> PacedAdmission(const std::vector<int32_t>& ranks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The members' smallest step in the current generation (-1 when none reported).
  int64_t MinStep() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The state the families share, named here once: what is fixed at creation, then under mu_
  // the membership, the ids, the plans, the reports, the event log, the pending waits and the
  // watchers.
  const v1::JobSpec spec_;
  const Schedule schedule_;
  std::atomic<int64_t> heartbeat_timeout_ms_;
  const absl::Duration join_timeout_;
  Clock* const clock_;
  const int64_t created_unix_ms_;
  const std::vector<std::string> warnings_;

  StateStore* const store_;

  mutable absl::Mutex mu_;
  // Serializes event delivery across calls; taken while mu_ is held, mu_ released first.
  absl::Mutex delivery_mu_ ABSL_ACQUIRED_AFTER(mu_);
  // Its changes are written through Save before they take effect.
  Membership membership_ ABSL_GUARDED_BY(mu_);
  // Members declared dead since creation (or restore): a metric.
  int64_t deaths_ ABSL_GUARDED_BY(mu_) = 0;
  // Replacements admitted since creation (or restore): a metric.
  int64_t admissions_ ABSL_GUARDED_BY(mu_) = 0;
  // Non-finite reports since creation (or restore), and the latest: a metric, the status page.
  int64_t nonfinite_reports_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<v1::NonFiniteReport> last_nonfinite_ ABSL_GUARDED_BY(mu_);
  CommIdStore comm_ids_ ABSL_GUARDED_BY(mu_);
  // The job's plans, the members' promises and the update being proposed.
  PlanUpdates plans_ ABSL_GUARDED_BY(mu_);
  // A job whose plan has a paced level (docs/paced.md): its planned rounds, the members' paces
  // and tokens. Absent otherwise.
  std::optional<PacedPlan> paced_ ABSL_GUARDED_BY(mu_);
  // Peer failure reports of the current generation (ReportPeerFailure).
  PeerReports peer_reports_ ABSL_GUARDED_BY(mu_){PeerReportTtl()};
  EventLog history_ ABSL_GUARDED_BY(mu_);
  PendingWaits waits_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, std::shared_ptr<JobWatcher>>> watchers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_watcher_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Restore: no heartbeat timeout before this time.
  absl::Time grace_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // When every member of the round fell silent together (InfiniteFuture: not now).
  absl::Time silent_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // Set by Close: every new wait fails with it.
  absl::Status closed_ ABSL_GUARDED_BY(mu_);
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;  // closed by DeleteJob
  // Set while a death could not be written (UNAVAILABLE, saying why): every call fails with it.
  absl::Status halted_ ABSL_GUARDED_BY(mu_);
  // The store's error of the last write that failed (Save).
  absl::Status last_save_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_JOB_H_
