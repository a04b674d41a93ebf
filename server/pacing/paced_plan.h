// The planned rounds of a job's paced level (docs/paced.md): the state behind each member's
// paced decisions. Pacing (pacing.h) is the rule; this holds what the rule planned, the
// members' measured compute paces and their tokens per step, and answers a member's decision at
// any step it was planned for. Plain class, no lock, no clock: the job holds it under its mutex.
//
// When rounds are planned. A member's decisions end at its group's last planned sync step
// (DecidedThrough); asking for a later step (PlanFor) plans the next round, with the paces known
// then, for every group at once. Each member asks right after its round r (its next window
// starts past it), so round r + 1 is planned when the first member leaves round r, with the
// paces measured up to then: a change of pace is used at the next round planned after it is
// reported (one heartbeat, at most a round later). What was planned never changes: a decision
// handed out stays true.
//
// Weights. Round r's weight of rank i is n_g(r) x tokens_per_step_i, g its group, with the
// tokens per step each rank declared when it joined; fixed when the round is planned (a rank
// that joins later with other tokens changes the rounds planned after it only).
//
// Bounds. Rounds are kept while any member may still ask for them: at most kMaxKeptRounds; the
// oldest are dropped beyond that (a member asking for a dropped round's step gets
// OUT_OF_RANGE). Memory: kMaxKeptRounds x (2 x groups) int64s, plus one tokens vector per
// distinct set of tokens.
#ifndef MODELAVG_SERVER_PACING_PACED_PLAN_H_
#define MODELAVG_SERVER_PACING_PACED_PLAN_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"
#include "modelavg/common/schedule.h"
#include "server/membership/admission.h"
#include "server/pacing/pacing.h"

namespace modelavg::server {

// Rounds kept (PacedPlan, "Bounds").
inline constexpr size_t kMaxKeptRounds = 4096;
// The largest tokens_per_step a member may declare.
inline constexpr double kMaxTokensPerStep = 1e12;

// One planned round with the weights' tokens.
struct PlannedRound {
  PacedRound round;
  // Per rank: tokens per step as of planning (shared between rounds while unchanged).
  std::shared_ptr<const std::vector<double>> tokens;
  // The group paces it was planned with (steps per second; -1: not known).
  std::vector<double> group_paces;
  // When the first group reached the round (a member reported its group's sync step of it);
  // InfiniteFuture until then. Not stored: a restarted coordinator measures it again.
  absl::Time first_arrival = absl::InfiniteFuture();
};

class PacedPlan {
 public:
  // The plan of `schedule`'s paced level (INVALID_ARGUMENT unless its last level is paced), with
  // nothing planned: round 0 is planned by the first PlanFor, with the tokens known then.
  static absl::StatusOr<PacedPlan> Create(const Schedule& schedule);

  const Pacing& pacing() const { return pacing_; }
  // The job's length in rounds (ScheduleLevel::rounds; 0: no bound).
  int64_t budget() const { return budget_; }

  // A member's compute pace (HeartbeatRequest.compute_steps_per_second; 0 or not finite:
  // unknown) and tokens per step (JoinRequest.tokens_per_step; 0: 1). INVALID_ARGUMENT for a
  // tokens value outside (0, kMaxTokensPerStep] or not finite.
  void NotePace(int32_t rank, double steps_per_second);
  static absl::Status CheckTokens(double tokens_per_step);
  void NoteTokens(int32_t rank, double tokens_per_step);
  const std::vector<double>& rank_paces() const { return pace_; }
  // A member's reported step (its heartbeat's: the step counter, one past the call it is in) at
  // `now`: a round is reached when a member reports past its group's sync step of it.
  void NoteStep(int32_t rank, int64_t step, absl::Time now);
  // Level.max_lag (docs/paced.md): the ranks of every group that has not reached the latest
  // round the first group reached, once max_lag x the round's expected time (step period / the
  // slowest group pace it was planned with) has passed since the first group reached it.
  // `live[r]`: rank r is a member (the others are neither waited for nor returned). Empty when
  // the round's pace was unknown (a step-locked round: no expected time) or nobody is late.
  std::vector<int32_t> Stragglers(absl::Time now, double max_lag,
                                  const std::vector<bool>& live) const;
  // A rank left (death, leave): its pace and step are forgotten (a replacement is measured
  // afresh).
  void Forget(int32_t rank);

  // The groups' paces as the next round would be planned with (Pacing::GroupPaces).
  std::vector<double> GroupPaces() const { return pacing_.GroupPaces(pace_); }

  // The rounds to plan so that `rank`'s group has a planned sync step >= `step` (none when it
  // has, or when the budget's last round is planned), with the paces and tokens known now.
  // Nothing changes until Commit: the caller stores them first. OUT_OF_RANGE when a sync step
  // would pass kMaxPacedStep.
  absl::StatusOr<std::vector<PlannedRound>> RoundsNeeded(int32_t rank, int64_t step) const;
  // The round after the last planned one (round 0 when none is), for the admission of a
  // replacement: nobody holds its decisions yet. FAILED_PRECONDITION when the budget's last round
  // is planned; OUT_OF_RANGE as RoundsNeeded.
  absl::StatusOr<PlannedRound> NextRound() const;
  // Appends rounds from RoundsNeeded (dropping the oldest beyond kMaxKeptRounds).
  void Commit(std::vector<PlannedRound> rounds);
  // The first round still kept after Commit(`adding` more rounds).
  int64_t FirstKeptAfter(size_t adding) const;
  // RoundsNeeded then Commit. Returns whether anything was planned.
  absl::StatusOr<bool> PlanFor(int32_t rank, int64_t step);

  // A planned round as stored and shown (v1::PacedRound), and the stored rounds taken back
  // (after a restart or a fail-over; the tokens of the last one are the members' until they join
  // again). INVALID_ARGUMENT for records that do not fit the job (groups, ranks, order).
  v1::PacedRound ToProto(const PlannedRound& planned) const;
  absl::Status Restore(const std::vector<v1::PacedRound>& stored);
  // The last step of `rank` the planned rounds decide: its group's last planned sync step, or
  // INT64_MAX once the budget's last round is planned (past it, the lower levels alone decide);
  // -1 before anything is planned.
  int64_t DecidedThrough(int32_t rank) const;

  // What `rank` does at `step` (<= DecidedThrough(rank)): its round's paced decision at its
  // group's sync step (members and weights filled from `members`), else the lower levels'
  // decision (Schedule::DecisionBelowPaced, members as ApplyMembers). OUT_OF_RANGE for a step of
  // a dropped round; FAILED_PRECONDITION before anything is planned.
  absl::StatusOr<Decision> DecisionFor(const Schedule& schedule, const MemberSteps& members,
                                       int64_t step, int32_t rank) const;

  // The share of the members' time round `planned` saves from waiting against step-locked
  // (PacingStatus.idle_saved).
  double IdleSaved(const PlannedRound& planned) const;
  // GetJob's view (PacingStatus).
  v1::PacingStatus Status() const;

  // The planned rounds still kept, oldest first.
  const std::deque<PlannedRound>& rounds() const { return rounds_; }
  // Rounds dropped from the front (rounds().front().round.round == dropped()).
  int64_t dropped() const { return dropped_; }

 private:
  PacedPlan(Pacing pacing, int32_t world, int64_t budget);
  // Fills the paced decision `d` (skeleton from the schedule) for round `planned`.
  void FillRound(const PlannedRound& planned, const MemberSteps& members, Decision* d) const;

  Pacing pacing_;
  int32_t world_;
  int64_t budget_;
  std::vector<double> pace_;
  // Per rank: its last reported step (-1: none).
  std::vector<int64_t> step_;
  std::shared_ptr<const std::vector<double>> tokens_;
  std::deque<PlannedRound> rounds_;
  int64_t dropped_ = 0;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_PACING_PACED_PLAN_H_
