// The plan of a paced level (Level.paced, docs/paced.md): for each round of the level, the sync
// step of each of its groups, chosen from the groups' measured paces so that every group is
// expected to arrive at the round at the same moment. A pure value class: no clock (the paces are
// given), no state between calls (the previous round is given), no I/O. Deterministic: the same
// round and paces give the same plan, bit for bit.
//
// The groups. A paced level is the last level. Its groups are the blocks of ranks that the
// lower levels' groups and the replicas lock together by their own collectives (they always take
// the same steps): PacedGroupSize(spec, level) = lcm(replica_size, every lower level's
// group_size) consecutive ranks; group g holds ranks [g * size, (g + 1) * size). A group's pace
// is its slowest member's (GroupPaces).
//
// The rule. Let p be the level's step period (period / fragments: a sync of one fragment each
// p steps of the slowest group, as in a step-locked level).
//   * Round 0 is step-locked: every group syncs at the level's first step, the schedule's
//     (Schedule::FirstStepOf: the first multiple of p at or past warm-up, or warm-up itself in
//     a PERIODIC job). Inner steps n_g(0) = that step + 1 for every group (the steps 0..s of
//     each; equal weights).
//   * Round r >= 1: with v_g the pace of group g (steps per second; unknown when not finite
//     or <= 0) and v the slowest known pace, n_g(r) = min(kMaxPaceRatio * p,
//     floor(p * v_g / v + kPaceRoundingSlack)) for a group of known pace, p for a group of
//     unknown pace, p for every group when no pace is known (step-locked). The sync step is
//     s_g(r) = s_g(r - 1) + n_g(r).
//   So n_g(r) >= p >= 1 always (v_g >= v); the slowest group, and any group not measured yet,
//   take exactly p steps; a faster group takes as many whole steps as fit into the slowest
//   group's p steps, rounded down, so that it arrives at most one of its own steps before the
//   slowest and never after it (as measured). The expected arrival times agree: a round lasts
//   n_g(r) / v_g ~ p / v for every group, counted from the previous round, which they all
//   leave together.
//   * The fragment of round r is (f_0 + r) mod fragments, f_0 the schedule's fragment at round
//     0's step: each fragment still syncs once every `fragments` rounds.
// A change of pace takes effect at the first round planned after it is measured: the caller
// plans round r with the paces it knows then (docs/paced.md says when the coordinator plans).
#ifndef MODELAVG_SERVER_PACING_PACING_H_
#define MODELAVG_SERVER_PACING_PACING_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::server {

// The most steps a group takes between two rounds, in step periods of the slowest group: a
// group measured as 100 times faster still takes at most kMaxPaceRatio x p (its replica would
// otherwise drift far from the others between rounds, and a stalled slowest group would stretch
// the rounds of every other without bound; max_lag is what handles a stalled group).
inline constexpr int64_t kMaxPaceRatio = 16;
// Added before rounding down p * v_g / v: a ratio that is a whole number in exact arithmetic
// (1.5 x 10 steps) and comes out a hair below it in floating point still gives that number.
inline constexpr double kPaceRoundingSlack = 1e-6;
// The largest sync step a plan may reach (far from int64 overflow at any period).
inline constexpr int64_t kMaxPacedStep = int64_t{1} << 62;

// One planned round of the paced level.
struct PacedRound {
  // The level's round index, from 0.
  int64_t round = 0;
  // The fragment the round syncs, in [0, fragments).
  int32_t fragment = 0;
  // Per group (index g), its sync step s_g(round) and the inner steps n_g(round) it takes since
  // its previous round of the level: the step count of its members' weights.
  std::vector<int64_t> sync_step;
  std::vector<int64_t> inner_steps;

  bool operator==(const PacedRound& o) const {
    return round == o.round && fragment == o.fragment && sync_step == o.sync_step &&
           inner_steps == o.inner_steps;
  }
};

class Pacing {
 public:
  // The pacing of `schedule`'s paced level. INVALID_ARGUMENT unless its last level is paced.
  static absl::StatusOr<Pacing> Create(const Schedule& schedule);

  // The paced level's index (the last level).
  int level() const { return level_; }
  // Ranks per group, and how many groups.
  int32_t group_size() const { return group_size_; }
  int32_t num_groups() const { return num_groups_; }
  // The group of `rank`. Precondition: 0 <= rank < world_size.
  int32_t GroupOf(int32_t rank) const { return rank / group_size_; }
  // The slowest group's inner steps between two rounds: the level's period / fragments.
  int64_t step_period() const { return step_period_; }

  // Each group's pace from its members' (indexed by rank; a value not finite or <= 0 is
  // unknown): the slowest known member's, as the members of a group advance together; unknown
  // (-1) when no member's is known. `rank_pace` has one entry per rank (missing ranks count as
  // unknown, entries past the world are ignored).
  std::vector<double> GroupPaces(const std::vector<double>& rank_pace) const;

  // Round 0 (step-locked, see above).
  PacedRound First() const;

  // Round previous.round + 1, from the groups' paces (indexed by group; a value not finite or
  // <= 0 is unknown). INVALID_ARGUMENT when `previous` or `group_pace` does not have one entry
  // per group; OUT_OF_RANGE when a sync step would pass kMaxPacedStep.
  absl::StatusOr<PacedRound> Next(const PacedRound& previous,
                                  const std::vector<double>& group_pace) const;

  // n_g for a group of pace `pace` when the slowest known pace is `slowest` (both as in Next;
  // `slowest` unknown: p).
  int64_t InnerSteps(double pace, double slowest) const;

 private:
  Pacing(int level, int32_t group_size, int32_t num_groups, int64_t step_period,
         int32_t fragments, int64_t first_step, int32_t first_fragment)
      : level_(level),
        group_size_(group_size),
        num_groups_(num_groups),
        step_period_(step_period),
        fragments_(fragments),
        first_step_(first_step),
        first_fragment_(first_fragment) {}

  int level_;
  int32_t group_size_;
  int32_t num_groups_;
  int64_t step_period_;
  int32_t fragments_;
  int64_t first_step_;
  int32_t first_fragment_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_PACING_PACING_H_
