// One job's membership and generations: who holds which rank, in which generation, and the
// job's state (PENDING while a round assembles, RUNNING once complete, FINISHED once every member
// left). A plain value class: no lock, no clock, no gRPC, no storage. Every operation returns
// what changed, and the hard-state changes accumulate until PeekDelta() hands them to a
// StateStore. Job (server/job.h) owns one under its mutex and makes each operation a
// transaction: Begin(), the operation, then Commit() once the store has written PeekDelta(), or
// Rollback() when it could not, which leaves the membership exactly as before Begin().
#ifndef MODELAVG_SERVER_MEMBERSHIP_H_
#define MODELAVG_SERVER_MEMBERSHIP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/state_store.h"

namespace modelavg::server {

// Admission of replacements into a RUNNING elastic job (Membership::Join).
// The admission step is at least the largest step the live members reported plus this margin:
// kMinAdmissionMargin, plus the steps the job advances in kAdmissionNotice (estimated from the
// reported steps), at most kMaxAdmissionMargin in all.
inline constexpr int64_t kMinAdmissionMargin = 2;
inline constexpr int64_t kMaxAdmissionMargin = 100000;
inline constexpr absl::Duration kAdmissionNotice = absl::Seconds(1);
// The progress rate is re-estimated from two samples of the largest reported step at least
// this far apart.
inline constexpr absl::Duration kRateSampleInterval = absl::Seconds(1);
// The admission step is searched among the next kMaxAdmissionScan steps from the floor.
inline constexpr int64_t kMaxAdmissionScan = 1000000;
// MemberSteps::from_step of a rank no live member holds.
inline constexpr int64_t kNotMember = INT64_MAX;

// Which ranks take part in decisions, step by step: from_step[r] is the first step at which
// rank r is a member of its subgroups' averaging: -1 for a member of the world that started
// the job (and for every rank while the job is not RUNNING), the admission step of a
// replacement, kNotMember for a vacant rank. A decision at step s lists the ranks with
// from_step <= s as members, and those with from_step == s as joining.
struct MemberSteps {
  std::vector<int64_t> from_step;
  // Every rank is a member at every step (no vacancy, no replacement): decisions are the
  // schedule's.
  bool all_from_start = true;
};

// Whether a background all-reduce (Level.sync_delay, docs/streaming.md) started before `step`
// is applied after it: a sync step s of a level with delay tau and s < step < s + tau. The
// members' outer state is then half-way through a sync, so no replacement is admitted there.
bool InsideDelayedSync(const Schedule& schedule, int64_t step);

// The admission step of a replacement taking `rank`: the first step s >= max(floor, 1) at
// which the schedule averages (at level L), no delayed sync is pending (InsideDelayedSync),
// and `rank`'s block at L has a rank other than `rank`
// with from_step[r] < s (a live member admitted before s, whose parameters it can receive).
// `from_step` as MemberSteps, with `rank` itself ignored. FAILED_PRECONDITION when no such step
// is among the next kMaxAdmissionScan steps (no block of `rank` has a live member, or the
// period that would give one is too far).
absl::StatusOr<int64_t> FindAdmissionStep(const Schedule& schedule, int32_t rank,
                                          const std::vector<int64_t>& from_step, int64_t floor,
                                          const std::string& job_id);

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
  // Elastic job: a replacement took `changed_by_rank` and the generation moved on with every
  // live member and it (still RUNNING). It is admitted at `admission_step`, chosen from
  // `admission_floor` = the largest step the live members reported (`max_reported_step`, -1
  // if none) + `admission_margin`.
  bool admitted = false;
  // The newcomer took the rank of a live member (its holder re-joining with its credential, or
  // the same worker retrying its Join): that membership departed.
  bool replaced_live_member = false;
  int64_t admission_step = -1;
  int64_t admission_floor = -1;
  int64_t admission_margin = 0;
  int64_t max_reported_step = -1;
};

class Membership {
 public:
  struct Member {
    bool present = false;
    std::string worker_id;
    std::string host;
    int64_t last_step = -1;
    absl::Time last_heartbeat;
    // When its HeartbeatStream broke without a clean end (the process died, its host went away)
    // with no beat since; InfiniteFuture otherwise.
    absl::Time stream_lost_at = absl::InfiniteFuture();
    v1::MemberState state = v1::MEMBER_STATE_UNSPECIFIED;
    // The generation of this member's round: the one it joined, or a later one that an elastic
    // job shrank into with it as a survivor; 0 when not in any round.
    int64_t generation = 0;
    // Digest of the credential its Join was given (server/member_credential.h).
    std::string credential_digest;
    // The last credential CheckCredential found to match `verified_digest` (memory only, never
    // stored): a beat that brings it again is checked by comparison instead of a SHA-256. It
    // counts only while verified_digest is still credential_digest.
    mutable std::string verified_credential;
    mutable std::string verified_digest;
    // The generation in which this worker joined (its heartbeats count from then on).
    int64_t joined_generation = 0;
    // The step from which it takes part in the averaging: -1 for a member of the world that
    // started the job (or re-formed it after a fall-back to PENDING), its admission step for a
    // replacement admitted into the RUNNING elastic job.
    int64_t admitted_step = -1;
  };

  struct JoinResult {
    int32_t rank = -1;
    // The same worker was already in the current round (it retried): its older Join is
    // superseded.
    bool was_in_round = false;
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
  // job (see JobSpec.min_world_size). `schedule` chooses admission steps.
  Membership(Schedule schedule, int32_t min_world_size);
  // A membership whose schedule averages the whole world at every step (PERIODIC, period 1).
  explicit Membership(int32_t world_size, int32_t min_world_size = 0);

  // Continues from stored state (after a coordinator restart). Every restored member of the
  // current generation counts as having sent a heartbeat at `now`.
  void Restore(const StoredJobHeader& header, const std::vector<StoredMember>& members,
               absl::Time now);

  int32_t world_size() const { return static_cast<int32_t>(members_.size()); }
  int32_t min_world_size() const { return min_world_size_; }
  bool elastic() const { return min_world_size_ < world_size(); }
  // RUNNING: ranks no live member holds (vacancies of an elastic job), ascending; else empty.
  std::vector<int32_t> VacantRanks() const;
  v1::JobState state() const { return state_; }
  int64_t generation() const { return generation_; }
  int32_t round_size() const { return round_size_; }
  const Member& member(int32_t rank) const { return members_[rank]; }
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
  // Errors:
  //   FAILED_PRECONDITION  FINISHED; RUNNING and the worker names no rank and holds none (strict
  //                        job) or no rank is vacant (elastic job: it is full); no admission step
  //   ALREADY_EXISTS       another worker holds the rank, alive (the message names it)
  //   UNAVAILABLE          elastic admission: a live member has not reported its step since it
  //                        joined or the coordinator restarted (retry shortly)
  absl::StatusOr<JoinResult> Join(const std::string& worker_id, const std::string& host,
                                  std::optional<int32_t> rank, absl::Time now,
                                  const std::string& job_id, const std::string& credential = "",
                                  const std::string& new_digest = "");

  // OK when `credential` is the one `rank`'s member was given; PERMISSION_DENIED otherwise
  // (no member, no credential, another's), naming `rpc`. Never says anything of the secret.
  absl::Status CheckCredential(int32_t rank, const std::string& credential, const char* rpc,
                               const std::string& job_id) const;

  // Takes a rank out of a round that is still assembling (its Join was cancelled or timed out),
  // freeing it for anyone.
  void Withdraw(int32_t rank);

  // Orderly exit of a rank that joined at some point. FAILED_PRECONDITION if it never did.
  absl::StatusOr<LeaveResult> Leave(int32_t rank, const std::string& reason, absl::Time now,
                                    const std::string& job_id);

  // Marks `ranks` (members of the running round) DEAD and starts a new generation: in an
  // elastic job with at least min_world_size survivors, one of the survivors (still RUNNING,
  // change.shrunk); otherwise a PENDING one that every worker must re-join.
  MembershipChange Die(const std::vector<int32_t>& ranks, const std::string& reason,
                       absl::Time now);

  // Ranks of the running round whose last heartbeat is older than `timeout` (none unless
  // RUNNING). O(1) until the earliest member could expire, O(world_size) then.
  // Also those whose HeartbeatStream broke more than `lost_grace` ago with no beat since (a
  // live client re-opens a broken stream well within it).
  std::vector<int32_t> Stale(absl::Time now, absl::Duration timeout,
                             absl::Duration lost_grace = absl::InfiniteDuration()) const;
  // The rank's HeartbeatStream broke (its connection dropped, not a clean end).
  void StreamLost(int32_t rank, absl::Time now);

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

  // Ranks missing from the current round, at most `limit` listed, then "and N more".
  std::string MissingRanks(int limit) const;

  // The hard-state changes since the last ClearDelta() (empty when none). The caller writes
  // them and then clears them. The members of a round that is still assembling are left out
  // (and stay pending): until the round completes, a rank in it is part of its Join's wait, which
  // nobody has been answered about yet, so a coordinator that stops or dies then must not bring
  // it back as a member.
  JobDelta PeekDelta() const;
  void ClearDelta();

  // Transactions (see the top of this file). Begin() starts recording what the operations that
  // follow change; Commit() keeps it (after ClearDelta() when its delta was written), Rollback()
  // undoes it: the members, the state, the generation, the soft progress figures and the
  // pending delta are exactly as at Begin(). Without Begin(), changes are not recorded.
  void Begin();
  void Commit();
  void Rollback();

 private:
  bool InRound(const Member& m) const {
    return m.present && m.generation == generation_ && m.state == v1::ALIVE;
  }
  MembershipChange Bump(int32_t rank, const std::string& reason, absl::Time now);
  // Puts a worker into `rank` as an ALIVE member of the current generation (round_size_ is the
  // caller's).
  void Seat(int32_t rank, const std::string& worker_id, const std::string& host, absl::Time now,
            const std::string& digest, int64_t admitted_step);
  // Members of the running round departed (already marked DEAD or LEFT): Shrink when the job
  // is elastic and enough survive, Bump otherwise.
  // An `orderly` departure (Leave) of an elastic job shrinks it even below min_world_size.
  MembershipChange Depart(int32_t rank, const std::string& reason, absl::Time now, bool orderly);
  MembershipChange Shrink(int32_t rank, const std::string& reason, absl::Time now);
  // Join of a RUNNING elastic job: a replacement.
  absl::StatusOr<JoinResult> Admit(const std::string& worker_id, const std::string& host,
                                   std::optional<int32_t> rank, absl::Time now,
                                   const std::string& job_id, const std::string& credential,
                                   const std::string& new_digest);
  absl::Status HeldByOther(int32_t rank, const std::string& job_id) const;
  // A step report of a live member: the running maximum and the rate estimate.
  void NoteProgress(int64_t step, absl::Time now);
  void ResetProgress();
  // Finishes the job if every present member has left.
  bool MaybeFinish();
  // The member of `rank`, to be changed: recorded for Rollback (once per transaction) and
  // marked for the next delta.
  Member& Mutable(int32_t rank);
  // True if PeekDelta leaves `m` out: an ALIVE member of a round that is still assembling.
  bool Assembling(const Member& m) const { return state_ == v1::PENDING && InRound(m); }
  void MarkHeader() {
    dirty_header_ = true;
    decision_members_.reset();
    stale_not_before_ = absl::InfinitePast();
  }

  const Schedule schedule_;
  const int32_t min_world_size_;
  v1::JobState state_ = v1::PENDING;
  int64_t generation_ = 1;
  // Indexed by rank; kept across generations.
  std::vector<Member> members_;
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

  // Hard-state changes not yet cleared by ClearDelta.
  bool dirty_header_ = false;
  bool dirty_clear_comm_ids_ = false;
  std::vector<int32_t> dirty_members_;

  // What Rollback restores; set by Begin.
  struct Undo {
    v1::JobState state;
    int64_t generation;
    int32_t round_size;
    std::optional<v1::GenerationChange> last_change;
    int64_t progress_max;
    absl::Time rate_sample_time;
    int64_t rate_sample_step;
    double steps_per_second;
    bool dirty_header;
    bool dirty_clear_comm_ids;
    size_t dirty_members;
    // The members as they were before their first change in the transaction.
    std::vector<std::pair<int32_t, Member>> members;
    absl::flat_hash_set<int32_t> saved;
  };
  std::optional<Undo> undo_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_H_
