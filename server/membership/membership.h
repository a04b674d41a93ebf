// One job's membership and generations: who holds which rank, in which generation, and the
// job's state (PENDING while a round assembles, RUNNING once complete, FINISHED once every member
// left). With sharded replicas (JobSpec.replica_size S > 1) an elastic job loses and admits whole
// replicas: a rank that dies, leaves or fails retires the live ranks of its replica (RETIRED), and
// a replacement replica's S ranks wait for each other and are admitted together. A plain value class: no lock, no clock, no gRPC, no storage. Every operation reports
// what it changed (a MembershipChange: the generation moved, the round completed, which members'
// records changed) and takes effect only once its writer (given at construction; Job's writes
// the change to its StateStore) has accepted that report: when the writer fails, the operation
// fails with its error and the membership is exactly as before.
#ifndef MODELAVG_SERVER_MEMBERSHIP_MEMBERSHIP_H_
#define MODELAVG_SERVER_MEMBERSHIP_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/membership/admission.h"
#include "server/membership/member.h"

namespace modelavg::server {

// A member as Membership holds it: its hard state (Member, what a StateStore keeps) and what the
// coordinator knows of it in memory only, never written.
struct LiveMember : Member {
  int64_t last_step = -1;
  absl::Time last_heartbeat;
  // When its HeartbeatStream broke without a clean end (the process died, its host went away)
  // with no beat since; InfiniteFuture otherwise.
  absl::Time stream_lost_at = absl::InfiniteFuture();
  // The last credential CheckCredential found to match `verified_digest`: a beat that brings it
  // again is checked by comparison instead of a SHA-256. It counts only while verified_digest is
  // still credential_digest.
  mutable std::string verified_credential;
  mutable std::string verified_digest;
  // The digest of the nonce of the Join that seated it (JoinRequest.join_nonce; empty: none):
  // a replacement not heard from yet gets its rank again only from a Join with that nonce.
  std::string join_nonce_digest;
};

// What one operation did to the membership.
struct MembershipChange {
  // The generation moved on (re-join while RUNNING, Leave or Die of a round member).
  bool generation_changed = false;
  int64_t old_generation = 0;
  int32_t changed_by_rank = -1;
  std::string reason;
  // The round became complete: the job is RUNNING in the current generation.
  bool world_complete = false;
  // Every member has left: the job is FINISHED.
  bool finished = false;
  // Elastic job: the generation moved on with the survivors as its members, still RUNNING (the
  // departed ranks are vacant). False when it fell back to PENDING (strict, or below
  // min_world_size).
  bool shrunk = false;
  // Sharded replicas: the live ranks of the departed ranks' replicas that were retired with them
  // (RETIRED), ascending.
  std::vector<int32_t> retired;
  // Elastic job: a replacement took `changed_by_rank` and the generation moved on with every
  // live member and it (still RUNNING). With sharded replicas the replica's ranks are admitted
  // together (`admitted_ranks`, ascending; `changed_by_rank` is the last of them to join). It is admitted at `admission_step`, chosen from
  // `admission_floor` = the largest step the live members reported (`max_reported_step`, -1
  // if none) + `admission_margin`.
  bool admitted = false;
  // The newcomer took the rank of a live member (its holder re-joining with its credential, or
  // the same worker retrying its Join): that membership departed.
  bool replaced_live_member = false;
  std::vector<int32_t> admitted_ranks;
  int64_t admission_step = -1;
  int64_t admission_floor = -1;
  int64_t admission_margin = 0;
  int64_t max_reported_step = -1;

  // The hard state it changed: the header after it, when that changed, and the records of the
  // members whose hard state changed (in rank order; a record without a worker_id: the rank's
  // member was removed). The members of a round that is still assembling are left out until it
  // completes (then all of them are listed): until then a rank in it is part of its Join's wait,
  // which nobody has been answered about yet, so a coordinator that stops or dies then must not
  // bring it back as a member.
  std::optional<MembershipHeader> header;
  std::vector<Member> members;

  // True if the change has hard state to write.
  bool changes_hard_state() const { return header.has_value() || !members.empty(); }
};

// Accepts a change before it takes effect (Job writes it to its StateStore). An error rejects
// it: the operation fails with that error and changes nothing. It must not call back into the
// Membership.
using MembershipWriter = std::function<absl::Status(const MembershipChange&)>;

class Membership {
 public:
  struct JoinResult {
    int32_t rank = -1;
    // The same worker was already in the current round (it retried): its older Join is
    // superseded.
    bool was_in_round = false;
    // Sharded replicas: a replacement whose replica still misses ranks. It waits for them (its
    // Join is answered once they have all joined); nothing was written. `was_in_round` says the
    // same worker was already waiting (its older Join is superseded).
    bool waiting_for_replica = false;
    // The ranks of the replica that waited and are admitted now with `rank` (change.admitted):
    // their Joins are answered too.
    std::vector<int32_t> admitted_with;
    MembershipChange change;
  };

  struct LeaveResult {
    // The rank was in a round that is still assembling: its pending Join is aborted.
    bool left_pending_round = false;
    // False when the rank had already left.
    bool left = false;
    MembershipChange change;
  };

  // `min_world_size`: 0 (or world_size) for a strict job; otherwise 1..world_size-1, an elastic
  // job (see JobSpec.min_world_size). `schedule` chooses admission steps. `write` accepts each
  // change that has hard state to write before it takes effect; without one, every change takes
  // effect as it is made.
  Membership(Schedule schedule, int32_t min_world_size, MembershipWriter write = nullptr);
  // A membership whose schedule averages the whole world at every step (PERIODIC, period 1).
  explicit Membership(int32_t world_size, int32_t min_world_size = 0,
                      MembershipWriter write = nullptr);

  // Continues from stored state (after a coordinator restart). Every restored member of the
  // current generation counts as having sent a heartbeat at `now`. Nothing is written.
  void Restore(const MembershipHeader& header, const std::vector<Member>& members,
               absl::Time now);

  int32_t world_size() const { return static_cast<int32_t>(members_.size()); }
  int32_t min_world_size() const { return min_world_size_; }
  // A plan update of an elastic job (UpdateJob): the job keeps running while at least this many
  // ranks are alive (1..world_size-1; checked by the caller). Takes effect at the next death.
  void SetMinWorldSize(int32_t min_world_size) { min_world_size_ = min_world_size; }
  // A paced job (docs/paced.md): replacements are admitted at the step this chooses for their
  // ranks (their group's sync step of a round nobody holds yet) instead of the schedule's
  // admission rule. Empty: the schedule's rule.
  using AdmissionChooser = std::function<absl::StatusOr<int64_t>(const std::vector<int32_t>&)>;
  void SetAdmissionChooser(AdmissionChooser chooser) { admission_chooser_ = std::move(chooser); }
  bool elastic() const { return min_world_size_ < world_size(); }
  // RUNNING: ranks no live member holds (vacancies of an elastic job), ascending; else empty.
  std::vector<int32_t> VacantRanks() const;
  v1::JobState state() const { return state_; }
  int64_t generation() const { return generation_; }
  int32_t round_size() const { return round_size_; }
  // The ranks of one replica (1: every rank holds a whole one).
  int32_t replica_size() const { return schedule_.replica_size(); }
  // A plan update (docs/plan-updates.md): admissions are chosen at steps >= `switch_step`,
  // following `plan` (those planned before stay where they are: the switch step lies past them).
  void SetPlan(Schedule plan, int64_t switch_step) {
    schedule_ = std::move(plan);
    plan_from_ = switch_step;
  }
  // Sharded replicas: replacement ranks waiting for the rest of their replica (not members).
  bool Waiting(int32_t rank) const { return waiting_.count(rank) > 0; }
  std::vector<int32_t> WaitingRanks() const;
  const LiveMember& member(int32_t rank) const { return members_[rank]; }
  const std::optional<v1::GenerationChange>& last_change() const { return last_change_; }
  bool InRound(int32_t rank) const { return InRound(members_[rank]); }

  // Adds a worker to the current round. `rank` was validated against world_size. The rank is
  // the requested one, else the worker's earlier rank, else the lowest free one. A re-join
  // while RUNNING starts a new generation first; only the holder may do that, proving it with
  // `credential` (its earlier membership's). The member gets `new_digest`.
  // An elastic job that is RUNNING admits the worker at once as a replacement (change.admitted):
  // into the requested rank if vacant, or its own if it is the live holder (credential) or the
  // same worker retrying a Join it got no answer to (worker_id, not heard from since), else the
  // lowest vacant rank; a new generation of every live member and the newcomer, RUNNING, with
  // the newcomer's admitted_step chosen by FindAdmissionStep from the members' reported steps.
  // With sharded replicas the replacement takes the rank it asks for in a vacant replica (one
  // with no live rank), else the lowest vacant rank of the lowest vacant replica, and waits
  // (JoinResult::waiting_for_replica) until every rank of its replica has joined; then all of
  // them are admitted together, at one admission step, in one new generation.
  // Errors:
  //   FAILED_PRECONDITION  FINISHED; RUNNING and the worker names no rank and holds none (strict
  //                        job) or no rank is vacant (elastic job: it is full); no admission step
  //   ALREADY_EXISTS       another worker holds the rank, alive (the message names it), or
  //                        waits in it for its replica
  //   UNAVAILABLE          elastic admission: a live member has not reported its step since it
  //                        joined or the coordinator restarted (retry shortly); sharded: the
  //                        rank's earlier member restarted and is not declared dead yet
  //   the writer's error   the change could not be written (nothing changed)
  absl::StatusOr<JoinResult> Join(const std::string& worker_id, const std::string& host,
                                  std::optional<int32_t> rank, absl::Time now,
                                  const std::string& job_id, const std::string& credential = "",
                                  const std::string& new_digest = "",
                                  const std::string& nonce = "");

  // OK when `credential` is the one `rank`'s member was given; PERMISSION_DENIED otherwise
  // (no member, no credential, another's), naming `rpc`. Never says anything of the secret.
  absl::Status CheckCredential(int32_t rank, const std::string& credential, const char* rpc,
                               const std::string& job_id) const;

  // Takes a rank out of a round that is still assembling (its Join was cancelled or timed out),
  // freeing it for anyone. Nothing is written now (nothing was for its seat); the removal is
  // part of the next change that has hard state to write. A rank waiting for its replica
  // (Waiting) only stops waiting.
  void Withdraw(int32_t rank);

  // Orderly exit of a rank that joined at some point. FAILED_PRECONDITION if it never did; the
  // writer's error (nothing changed). `next_step`: the first step the leaver did not start
  // (0: unknown); with sharded replicas its retired replica mates take part in the averaging
  // of the steps before it (they finish the steps it finished, the end of a run).
  absl::StatusOr<LeaveResult> Leave(int32_t rank, const std::string& reason, absl::Time now,
                                    const std::string& job_id, int64_t next_step = 0);

  // Marks `ranks` (members of the running round) DEAD and starts a new generation: in an
  // elastic job with at least min_world_size survivors, one of the survivors (still RUNNING,
  // change.shrunk; with sharded replicas the rest of each dead rank's replica is RETIRED);
  // otherwise a PENDING one that every worker must re-join. Fails only with the writer's error
  // (nothing changed).
  absl::StatusOr<MembershipChange> Die(const std::vector<int32_t>& ranks,
                                       const std::string& reason, absl::Time now);

  // Ranks of the running round whose last heartbeat is older than `timeout` (none unless
  // RUNNING). O(1) until the earliest member could expire, O(world_size) then.
  // Also those whose HeartbeatStream broke more than `lost_grace` ago with no beat since (a
  // live client re-opens a broken stream well within it).
  std::vector<int32_t> Stale(absl::Time now, absl::Duration timeout,
                             absl::Duration lost_grace = absl::InfiniteDuration()) const;
  // The rank's HeartbeatStream broke (its connection dropped, not a clean end).
  void StreamLost(int32_t rank, absl::Time now);

  // OK when `step`, reported by `rank` at `now`, is one the job's pace can have reached: at most
  // kStepLeap + 10 x (its steps per second) x (the time since the pace was sampled, at least a
  // second) past the largest step reported since the job formed. INVALID_ARGUMENT otherwise,
  // saying why: one member reporting 2^62 made every later admission fail ("too large"), and at
  // 10^15 an admission landed past it. Anything goes while nothing is reported (a job resumed
  // from a checkpoint starts where it was).
  absl::Status CheckPlausibleStep(int32_t rank, int64_t step, absl::Time now,
                                  const std::string& job_id) const;
  static constexpr int64_t kStepLeap = 1'000'000;

  // Liveness and progress of a rank; counts only for the worker of `generation`.
  void Heartbeat(int32_t rank, int64_t generation, int64_t step, absl::Time now);
  // Progress reported through Step (the generation was checked by the caller).
  void RecordStep(int32_t rank, int64_t step, absl::Time now);

  // Who takes part in decisions from which step (see MemberSteps). Cached until the membership
  // changes: O(1) while it does not, O(world_size) once after a change.
  std::shared_ptr<const MemberSteps> DecisionMembers() const;

  // Steps per second the job advances (the largest reported step over the latest sample of at
  // least kRateSampleInterval); negative while there is no estimate.
  double steps_per_second() const { return steps_per_second_; }

  // A full elastic job whose member's heartbeat stream broke (a worker killed and restarted at
  // once reaches the coordinator before its old self is declared dead): UNAVAILABLE naming it,
  // which the client retries; OK when no such member (the job is full).
  absl::Status FullButABrokenStream(const std::string& job_id) const;

  // Ranks missing from the current round, at most `limit` listed, then "and N more".
  std::string MissingRanks(int limit) const;

 private:
  bool InRound(const Member& m) const {
    return m.present() && m.generation == generation_ && m.state == v1::ALIVE;
  }
  // A replica mate of a rank that left in order: RETIRED, but a member of the averaging of the
  // steps before its retired_at_step (and so still watched for its heartbeat).
  static bool Lingering(const Member& m) {
    return m.present() && m.state == v1::RETIRED && m.retired_at_step > 0;
  }
  // A worker waiting for the rest of its replica (sharded replacements); never written.
  struct WaitingJoiner {
    std::string worker_id;
    std::string host;
    std::string digest;
    std::string nonce_digest;
  };
  // Runs `op` (one of the *InMemory operations below, returning a StatusOr of a result with its
  // MembershipChange) as one transaction: its change is completed with the hard state it
  // changed and handed to the writer; it is kept once the writer accepts it (or when there is
  // nothing to write), undone when `op` or the writer fails.
  template <typename Op>
  auto Transact(Op op) -> decltype(op());
  // Who asks to Join, and with what (Join's arguments).
  struct Joiner {
    const std::string& worker_id;
    const std::string& host;
    std::optional<int32_t> rank;
    const std::string& credential;
    const std::string& new_digest;
    // JoinRequest.join_nonce: what proves a retry of a Join whose reply was lost.
    const std::string& nonce;
  };
  // `joiner` is the Join of the worker waiting in `w` for its replica, retried: the same worker
  // id and the same nonce.
  static bool SameJoin(const WaitingJoiner& w, const Joiner& joiner);
  // `joiner` is the Join that seated `m` in an assembling round, retried: the same worker id
  // and, when that Join sent one, the same nonce (the worker id alone is public: WatchJob and
  // GetJob show it).
  static bool RetriedJoin(const LiveMember& m, const Joiner& joiner);
  // What Join, Leave and Die change in memory (see Transact).
  absl::StatusOr<JoinResult> JoinInMemory(const Joiner& joiner, absl::Time now,
                                          const std::string& job_id);
  // The rank a Join of a strict job, or of a round that is assembling, takes: the requested
  // one, else (RUNNING) the holder's own, else the worker's earlier one, else the lowest free one.
  absl::StatusOr<int32_t> ChooseRank(const Joiner& joiner, const std::string& job_id) const;
  absl::StatusOr<LeaveResult> LeaveInMemory(int32_t rank, const std::string& reason,
                                            absl::Time now, const std::string& job_id,
                                            int64_t next_step);
  MembershipChange DieInMemory(const std::vector<int32_t>& ranks, const std::string& reason,
                               absl::Time now);
  MembershipChange Bump(int32_t rank, const std::string& reason, absl::Time now);
  // Puts a worker into `rank` as an ALIVE member of the current generation (round_size_ is the
  // caller's).
  void Seat(int32_t rank, const std::string& worker_id, const std::string& host, absl::Time now,
            const std::string& digest, int64_t admitted_step,
            const std::string& nonce_digest = "");
  // Members of the running round departed (already marked DEAD or LEFT): Shrink when the job
  // is elastic and enough survive, Bump otherwise.
  // An `orderly` departure (Leave) of an elastic job shrinks it even below min_world_size.
  // With sharded replicas the live ranks of the departed ranks' replicas are retired (RETIRED)
  // when the job goes on: at once, or after `next_step` for an orderly departure.
  MembershipChange Depart(const std::vector<int32_t>& ranks, const std::string& reason,
                          absl::Time now, bool orderly, int64_t next_step = 0);
  MembershipChange Shrink(int32_t rank, const std::string& reason, absl::Time now);
  // Join of a RUNNING elastic job: a replacement.
  absl::StatusOr<JoinResult> Admit(const Joiner& joiner, absl::Time now,
                                   const std::string& job_id);
  // Where a replacement goes: the rank it asked for or the lowest vacant one, and whether it
  // takes the place of a live member (its holder re-joining, or the same worker retrying).
  struct Vacancy {
    int32_t rank = -1;
    bool replaced = false;
  };
  absl::StatusOr<Vacancy> FindVacancy(const Joiner& joiner, const std::string& job_id) const;
  // Sharded replicas: the rank a replacement waits in (the one it asks for in a vacant replica,
  // its own if it already waits, else the lowest vacant rank of the lowest vacant replica).
  absl::StatusOr<int32_t> FindReplicaVacancy(const Joiner& joiner,
                                             const std::string& job_id) const;
  // Join of a RUNNING elastic job of sharded replicas: waits, or admits the whole replica.
  absl::StatusOr<JoinResult> AdmitToReplica(const Joiner& joiner, absl::Time now,
                                            const std::string& job_id);
  // "replica 2 (ranks 4..5)".
  std::string ReplicaName(int32_t replica) const;
  // When the replacement taking `rank` is admitted (MembershipChange's admission_* figures).
  struct AdmissionStep {
    int64_t step = -1;
    int64_t floor = -1;
    int64_t margin = 0;
    int64_t max_reported = -1;
  };
  absl::StatusOr<AdmissionStep> ChooseAdmissionStep(const std::vector<int32_t>& ranks,
                                                    const std::string& job_id) const;
  // Moves every live member of `old_generation` but `except` into the current generation's
  // round (an elastic job going on with them).
  void CarryOver(int64_t old_generation, int32_t except);
  absl::Status HeldByOther(int32_t rank, const std::string& job_id) const;
  // A step report of a live member: the running maximum and the rate estimate.
  void NoteProgress(int64_t step, absl::Time now);
  void ResetProgress();
  // Finishes the job if every present member has left.
  bool MaybeFinish();
  // The member of `rank`, to be changed by the transaction: kept for its undo (once per
  // transaction) and listed in its change. `may_leave_round`: false when the change can only put
  // the rank into the round (Seat), which keeps ChooseRank's lowest free rank found valid.
  LiveMember& Mutable(int32_t rank, bool may_leave_round = true);
  // Keeps ranks_by_worker_ in step after members_[rank].worker_id changed from `old_worker_id`.
  void Reindex(int32_t rank, const std::string& old_worker_id);
  // True if a change leaves `m` out: an ALIVE member of a round that is still assembling.
  bool Assembling(const Member& m) const { return state_ == v1::PENDING && InRound(m); }
  // The header changed in this transaction.
  void MarkHeader();
  // Fills in the hard state `change` changed, then has the writer accept it: OK and kept, or
  // the writer's error and undone.
  absl::Status WriteAndKeep(MembershipChange* change);
  void Begin();
  void Rollback();

  // The latest plan, in force from plan_from_ on (admissions are chosen from it).
  Schedule schedule_;
  int64_t plan_from_ = 0;
  int32_t min_world_size_;
  AdmissionChooser admission_chooser_;
  const MembershipWriter write_;
  v1::JobState state_ = v1::PENDING;
  int64_t generation_ = 1;
  // Indexed by rank; kept across generations.
  std::vector<LiveMember> members_;
  int32_t round_size_ = 0;
  std::optional<v1::GenerationChange> last_change_;
  // Built by DecisionMembers(), dropped at every change of the membership.
  mutable std::shared_ptr<const MemberSteps> decision_members_;
  // Stale() finds nobody before this time (the earliest a member of the round can expire, as
  // of its last scan with these arguments): it is called every few ms and its scan is
  // O(world_size), while heartbeats only move expiries later. Reset by every change that can
  // move one earlier (a broken stream, a membership change, a restore).
  mutable absl::Time stale_not_before_ = absl::InfinitePast();
  mutable absl::Duration stale_timeout_;
  mutable absl::Duration stale_grace_;

  // Progress (soft state): the largest step reported since the job (re)formed, and the rate.
  int64_t progress_max_ = -1;
  absl::Time rate_sample_time_ = absl::InfinitePast();
  int64_t rate_sample_step_ = -1;
  double steps_per_second_ = -1;
  // Restored from a store (a restart, a take-over) and the members' pace not measured since: an
  // admission waits for it (the pace sets the admission's margin).
  bool pace_unknown_since_restore_ = false;

  // Ranks withdrawn (Withdraw) since the last change that wrote anything: their removal goes
  // with the next one.
  std::vector<int32_t> unwritten_;
  // Sharded replicas: replacements waiting for the rest of their replica, by rank (soft state:
  // a Join not answered yet, as in an assembling round).
  std::map<int32_t, WaitingJoiner> waiting_;

  // What keeps a Join that names no rank O(log world_size) (ChooseRank scanned every rank):
  // the ranks whose member has each worker id (present members, any state), ascending;
  absl::flat_hash_map<std::string, std::set<int32_t>> ranks_by_worker_;
  // and the lowest rank not in the round as last found: every rank below free_from_ was in the
  // round then, and still is while the generation is free_from_generation_ and nothing that can
  // take a rank out of the round has happened since (out_of_round_epoch_ unchanged).
  uint64_t out_of_round_epoch_ = 0;
  mutable int32_t free_from_ = 0;
  mutable int64_t free_from_generation_ = -1;
  mutable uint64_t free_from_epoch_ = 0;

  // The transaction in progress (Transact): what it changed and what undoes it.
  struct Transaction {
    v1::JobState state;
    int64_t generation;
    int32_t round_size;
    std::optional<v1::GenerationChange> last_change;
    int64_t progress_max;
    absl::Time rate_sample_time;
    int64_t rate_sample_step;
    double steps_per_second;
    bool header_changed = false;
    // Ranks whose record the change lists (unless assembling), in the order first touched.
    std::vector<int32_t> ranks;
    // The members as they were before their first change in the transaction.
    std::vector<std::pair<int32_t, LiveMember>> members;
    absl::flat_hash_set<int32_t> saved;
    std::map<int32_t, WaitingJoiner> waiting;
  };
  std::optional<Transaction> tx_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_MEMBERSHIP_H_
