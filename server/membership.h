// One job's membership and generations: who holds which rank, in which generation, and the
// job's state (PENDING while a round assembles, RUNNING once complete, FINISHED once every member
// left). A plain value class: no lock, no clock, no gRPC, no storage. Every operation returns
// what changed, and the hard-state changes accumulate until PeekDelta() hands them to a
// StateStore. Job (server/job.h) owns one under its mutex.
#ifndef MODELAVG_SERVER_MEMBERSHIP_H_
#define MODELAVG_SERVER_MEMBERSHIP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/state_store.h"

namespace modelavg::server {

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
};

class Membership {
 public:
  struct Member {
    bool present = false;
    std::string worker_id;
    std::string host;
    int64_t last_step = -1;
    absl::Time last_heartbeat;
    v1::MemberState state = v1::MEMBER_STATE_UNSPECIFIED;
    // The generation of this member's round: the one it joined, or a later one that an elastic
    // job shrank into with it as a survivor; 0 when not in any round.
    int64_t generation = 0;
    // The generation in which this worker joined (its heartbeats count from then on).
    int64_t joined_generation = 0;
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
  // job (see JobSpec.min_world_size).
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
  // while RUNNING starts a new generation first. Errors:
  //   FAILED_PRECONDITION  FINISHED, or RUNNING and the worker names no rank and holds none, or
  //                        an elastic job is RUNNING (replacements are not admitted yet)
  //   ALREADY_EXISTS       another worker holds the requested rank in this round
  absl::StatusOr<JoinResult> Join(const std::string& worker_id, const std::string& host,
                                  std::optional<int32_t> rank, absl::Time now,
                                  const std::string& job_id);

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
  // RUNNING).
  std::vector<int32_t> Stale(absl::Time now, absl::Duration timeout) const;

  // Liveness and progress of a rank; counts only for the worker of `generation`.
  void Heartbeat(int32_t rank, int64_t generation, int64_t step, absl::Time now);
  // Progress reported through Step (the generation was checked by the caller).
  void RecordStep(int32_t rank, int64_t step, absl::Time now);

  // Ranks missing from the current round, at most `limit` listed, then "and N more".
  std::string MissingRanks(int limit) const;

  // The hard-state changes since the last ClearDelta() (empty when none). The caller writes
  // them and then clears them; after a failed write they stay, so the next write carries them.
  JobDelta PeekDelta() const;
  void ClearDelta();

 private:
  bool InRound(const Member& m) const {
    return m.present && m.generation == generation_ && m.state == v1::ALIVE;
  }
  MembershipChange Bump(int32_t rank, const std::string& reason, absl::Time now);
  // Members of the running round departed (already marked DEAD or LEFT): Shrink when the job
  // is elastic and enough survive, Bump otherwise.
  MembershipChange Depart(int32_t rank, const std::string& reason, absl::Time now);
  MembershipChange Shrink(int32_t rank, const std::string& reason, absl::Time now);
  // Finishes the job if every present member has left.
  bool MaybeFinish();
  void MarkMember(int32_t rank) { dirty_members_.push_back(rank); }

  const int32_t min_world_size_;
  v1::JobState state_ = v1::PENDING;
  int64_t generation_ = 1;
  // Indexed by rank; kept across generations.
  std::vector<Member> members_;
  int32_t round_size_ = 0;
  std::optional<v1::GenerationChange> last_change_;

  // Hard-state changes not yet cleared by ClearDelta.
  bool dirty_header_ = false;
  bool dirty_clear_comm_ids_ = false;
  std::vector<int32_t> dirty_members_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_H_
