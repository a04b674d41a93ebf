// Which generation of its job one rank averages in, and what stops it from averaging: the
// membership view of that generation, a newer one it follows (an elastic job's shrink or
// admission), the ranks that left since (a strict job), and whether the client is broken, and
// why (a peer died, the coordinator lost the job or has been gone too long, this rank left).
//
// A plain class, like the coordinator's Membership: no lock, no clock, no RPC. The Client calls
// it under its mutex with what its heartbeat and the coordinator said, and the times it read on
// its clock; each call returns what the Client must do about it (abort collectives, log).
#ifndef MODELAVG_CLIENT_SESSION_GENERATION_TRACKER_H_
#define MODELAVG_CLIENT_SESSION_GENERATION_TRACKER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/client/membership_view.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

class GenerationTracker {
 public:
  struct Options {
    std::string job_id;
    std::string coordinator;  // the address, for messages
    // Whom this rank is (reading a view of the job: membership_view.h).
    ViewReader reader;
    // An elastic job's rank follows the generations it is carried into as a live member; a
    // strict job's stops at a change that breaks its communicators.
    bool elastic = false;
  };

  // The rank joined `generation` (everybody live) of a coordinator of `incarnation`.
  GenerationTracker(Options options, int64_t generation, std::string incarnation);

  // The generation averaged in, and the latest one the heartbeat has seen (>= generation()).
  int64_t generation() const { return generation_; }
  int64_t latest_generation() const { return latest_generation_; }
  // Non-OK once nothing may be averaged any more.
  const absl::Status& broken() const { return broken_; }
  bool left() const { return left_; }
  const ViewReader& reader() const { return options_.reader; }

  // A replacement admitted into a running elastic job: `view` is the generation it joined.
  void Admit(MembershipView view);

  // --- What the heartbeat brings. ---

  // Whether a reply's `generation` is news: neither the generation averaged in nor `seen`, the
  // latest the heartbeat had reported when it sent the beat.
  bool IsNews(int64_t generation, int64_t seen) const {
    return generation != generation_ && generation != seen;
  }
  // Why the job moved to the reply's generation, as its last change says ("membership changed"
  // when it does not), and the rank whose change it was (-1: unknown).
  static std::string ChangeReason(const v1::HeartbeatResponse& reply);
  static int32_t BlamedRank(const v1::HeartbeatResponse& reply) {
    return reply.has_last_change() ? reply.last_change().rank() : -1;
  }

  // The collectives to abort after a generation change: every one of a generation before
  // `before`, with `why`.
  struct Abort {
    int64_t before = 0;
    absl::Status why;
    bool needed() const { return !why.ok(); }
  };
  // The job moved to `generation` because of `why` (a change of `blamed_rank`, -1: unknown,
  // which the errors it causes carry: client/base/error_kind.h); `job` is its record as read
  // after the change (or the error reading it). An elastic job's rank that is a live member of
  // the job's current generation follows it (Advance then moves to it); otherwise a change that
  // breaks communicators (a death, a re-join, an unreadable record) breaks the client, and
  // orderly departures are remembered (CheckCanAverage). An elastic job's record that is
  // UNAVAILABLE (a leader that lost etcd, a take-over) concludes nothing: nothing changes, and the
  // generation stays news for the next reply.
  Abort OnGenerationChange(int64_t generation, const std::string& why, int32_t blamed_rank,
                           const absl::StatusOr<v1::Job>& job);

  // A heartbeat reply, received at `now`: a recovery grace starts; a coordinator that has the
  // job afresh (PENDING in this rank's generation) breaks the client; a new incarnation is
  // logged.
  void OnReply(const v1::HeartbeatResponse& reply, absl::Time now);

  // A failed heartbeat that the coordinator answered with a refusal breaks the client
  // (PERMISSION_DENIED: the rank has another member now; NOT_FOUND: the coordinator lost or
  // never had the job), and true is returned. False: the coordinator is out of reach, and the
  // caller times the outage (breaking the client with Break once it has lasted too long).
  bool OnRefusal(const absl::Status& error);

  // Breaks the client with `why` unless it already is (the first reason stands), logging it.
  // Whether it took.
  bool Break(absl::Status why);

  // --- What the averagers do. ---

  // Records the first failed averaging call (later ones are ignored).
  void RecordFailure(const absl::Status& failure) {
    if (!failure.ok() && failure_.ok()) failure_ = failure;
  }
  const absl::Status& failure() const { return failure_; }

  // This rank leaves (Leave or FailOut): false when it already had. The client is broken from
  // then on (saying so, unless it already was).
  bool MarkLeft();

  // `decision` as this rank takes it at `step`: in the generation averaged in and, in an
  // elastic job, with the members of that generation that average at `step` (live, admitted by
  // then, and not retired by then) and those admitted at it.
  Decision Decide(Decision decision, int64_t step) const;
  // Decide for a paced round (Decision::round >= 0): the coordinator's members less the dead.
  Decision DecidePaced(Decision d) const;
  // Sharded replicas (an elastic job): once `step` reaches the step from which this rank's
  // replica is retired (a replica mate left in order; this rank finishes the steps the mate
  // started), the client is broken with ErrorKind::kReplicaLost naming the lost rank, and that
  // error is returned. OK before then, and in any job without such a retirement.
  absl::Status CheckRetiredAt(int64_t step);

  // OK while the job is at generation() and the client is not broken; why not otherwise.
  absl::Status CheckUsable() const;
  // OK when this rank may average with `group` now: the job is still at generation() (or, in an
  // elastic job, the rank follows it), or it moved on only because ranks outside `group` left in
  // an orderly way. Otherwise why not.
  absl::Status CheckCanAverage(const SubgroupRange& group) const;

  // Moves to the generation being followed, if any: the generations moved from and to (equal
  // when there was none). The error that stops averaging when the client is broken.
  struct Move {
    int64_t from = 0;
    int64_t to = 0;
    bool moved() const { return to != from; }
  };
  absl::StatusOr<Move> Advance();

  // Whether a wait for a generation newer than `generation` is over: there is one (averaged in
  // or followed), or the client is broken or left.
  bool NewerThan(int64_t generation) const;
  bool WaitOver(int64_t generation) const {
    return !broken_.ok() || left_ || NewerThan(generation);
  }

  // How long a wait for a newer generation (Client::AwaitNewerGeneration) goes on once its
  // deadline has passed without one. While the coordinator is unreachable nobody can declare a
  // death: the wait looks again a little later (in `look_again`), for as long as the outage
  // lasts (past coordinator_outage_timeout the client is broken). A coordinator back from a
  // restart declares no death before its recovery grace has passed: the wait goes on until then
  // and as long again as at first (`window`), and as long again after an outage. Returns the
  // new deadline, or nullopt when the wait is over.
  struct AwaitWindow {
    absl::Duration window;
    bool outage_seen = false;
  };
  static constexpr absl::Duration kLookAgain = absl::Milliseconds(200);
  std::optional<absl::Time> ExtendWait(AwaitWindow& wait, absl::Time now, absl::Time deadline,
                                       absl::Duration outage_length) const;

 private:
  const Options options_;
  int64_t generation_;
  MembershipView view_;
  // The newer generation of an elastic job this rank is a live member of, not moved to yet.
  std::optional<MembershipView> follow_;
  int64_t latest_generation_;
  absl::Status broken_;
  // A strict job: the ranks that left in an orderly way since generation_, and why it moved.
  std::vector<int32_t> departed_;
  std::string change_reason_;
  bool left_ = false;
  absl::Status failure_;
  // After a coordinator restart: until when it waits for members to re-attach before it
  // declares any dead (HeartbeatResponse.recovery_grace_ms).
  absl::Time recovery_until_ = absl::InfinitePast();
  // The coordinator incarnation of the last reply (a restart changes it).
  std::string incarnation_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_GENERATION_TRACKER_H_
