// A job's plans over time: the plan it was created with (version 0, from step 0) and each plan
// an UpdateJob made, from its switch step E on (docs/plan-updates.md). A pure value: the
// coordinator and every member hold the same history and derive the same decisions from it.
//
// The rule: the decision at step s follows the latest plan whose switch step is <= s, exactly as
// that plan's Schedule decides at s (phases stay absolute: a period of 8 averages at the
// multiples of 8 from E on). What a level carries across E is LevelCarryAt's rule.
#ifndef MODELAVG_COMMON_PLAN_HISTORY_H_
#define MODELAVG_COMMON_PLAN_HISTORY_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "modelavg/common/schedule.h"

namespace modelavg {

// Most plans one job may have (version 0 and its updates). Every member holds them all.
inline constexpr int kMaxPlanVersions = 1024;

// What level `level` of a new plan keeps from the same level of the plan before it.
enum class LevelCarry {
  // Same group size, same fragments, outer in both (its optimizer's lr, momentum or payload may
  // change): the anchors, momenta and error-feedback residuals carry over; the new optimizer
  // steps from E on.
  kKeepOuter,
  // Plain in both with the same group size: nothing to carry (a plain level holds no state).
  kPlain,
  // New, or its group size or fragment split changed, or it gained an outer optimizer: it starts
  // at its first averaging step from E on with a plain average that sets its anchors, as a
  // level's first step does at the start of a job.
  kFresh,
};

// The carry rule for level `level` of `next` (a plan following `prev`).
LevelCarry LevelCarryOf(const ScheduleSpec& prev, const ScheduleSpec& next, int level);

// Whether the error-feedback residuals of a kept outer level carry over: the same payload and
// density (a residual is what one encoding dropped; another encoding starts from zero).
bool ResidualCarries(const ScheduleLevel& prev, const ScheduleLevel& next);

// What may change between two plans of one job: INVALID_ARGUMENT naming the field for a change
// of world_size, mode or replica_size. (warmup_steps may change only while no member has passed
// it: the coordinator checks that, it knows the steps.)
absl::Status ValidatePlanChange(const ScheduleSpec& prev, const ScheduleSpec& next);

class PlanHistory {
 public:
  explicit PlanHistory(Schedule first) { plans_.push_back({std::move(first), 0}); }

  // Adds `next` from step `switch_step` on, as version size(). INVALID_ARGUMENT when
  // switch_step is not past the last switch step, the change is not allowed
  // (ValidatePlanChange), or kMaxPlanVersions plans exist.
  absl::Status Add(Schedule next, int64_t switch_step);

  // Versions held: 1 + the updates.
  int size() const { return static_cast<int>(plans_.size()); }
  const Schedule& Plan(int version) const { return plans_[version].schedule; }
  // The first step of `version` (0 for version 0).
  int64_t SwitchStep(int version) const { return plans_[version].switch_step; }
  const Schedule& Latest() const { return plans_.back().schedule; }
  // The version in force at `step` (>= 0).
  int VersionAt(int64_t step) const;
  const Schedule& At(int64_t step) const { return Plan(VersionAt(step)); }

  int32_t world_size() const { return plans_[0].schedule.world_size(); }
  int32_t replica_size() const { return plans_[0].schedule.replica_size(); }

  // What `rank` does at `step`, with Decision::plan set. Preconditions as Schedule's.
  Decision DecisionFor(int64_t step, int32_t rank) const;
  std::vector<Decision> Window(int64_t from_step, int64_t count, int32_t rank) const;
  std::vector<Decision> WindowAllSubgroups(int64_t from_step, int64_t count) const;

  // The smallest step E >= `earliest` (and past the last switch step) at which no background
  // round is in flight: no level with sync_delay d > 0 started a sync at a step s < E that it
  // would apply at s + d >= E, so no round of the old plan is applied at or past the switch.
  // At most one step period past `earliest` (sync_delay < period / fragments).
  int64_t SwitchStepFrom(int64_t earliest) const;

  // The carry rule of `level` of `version` (>= 1) against the version before it.
  LevelCarry CarryAt(int version, int level) const;

  // The step at which `level` of `version` set its anchors: its first averaging step from its
  // lineage's start (the job's start, or the switch step of the version from which it started
  // afresh). -1 when there is none within the search bound.
  int64_t FirstStepOf(int version, int level) const;
  // The same for one fragment of a streaming level.
  int64_t FirstSyncOf(int version, int level, int32_t fragment) const;

 private:
  // The version in which `level` of `version` started afresh (the lineage's start).
  int LineageStart(int version, int level) const;

  struct Entry {
    Schedule schedule;
    int64_t switch_step = 0;
  };
  std::vector<Entry> plans_;
};

}  // namespace modelavg

#endif  // MODELAVG_COMMON_PLAN_HISTORY_H_
