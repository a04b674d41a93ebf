// A job's plans and what UpdateJob needs to choose their switch step: how far each member may
// still use the plans it holds, and the proposal under way (docs/plan-updates.md). A plain class:
// no lock, no clock, no I/O; Job (server/job/job.h) owns one under its mutex and writes each
// accepted plan to its StateStore before the plan takes effect.
//
// How a switch step E is chosen. A member is handed decisions in windows (GetSchedule) and uses
// them without asking again; during a coordinator outage it may use them to their end and no
// further. So E must lie past every step a member may still use. To make E soon, UpdateJob first
// proposes: each member's next heartbeat reply carries the proposal, and the member answers the
// step up to which it will still use what it holds (about half a second of steps ahead), giving back
// the rest. Once every live member answered, or the proposal's deadline passed, E is the first
// step past all of that (and past the planned admissions), moved on while a delayed round of the
// old plan would still be in flight at it (PlanHistory::SwitchStepFrom).
#ifndef MODELAVG_SERVER_MEMBERSHIP_PLAN_UPDATES_H_
#define MODELAVG_SERVER_MEMBERSHIP_PLAN_UPDATES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/common/plan_history.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

// Completion of an UpdateJob call. Called exactly once, never under a Job lock.
using UpdateCallback = absl::AnyInvocable<void(absl::StatusOr<v1::UpdateJobResponse>)>;

class PlanUpdates {
 public:
  // The job's first plan (`spec`, validated into `first`).
  PlanUpdates(const v1::JobSpec& spec, Schedule first, int64_t created_unix_ms);

  // Adds the stored plans after version 0, in version order. INVALID_ARGUMENT (naming the
  // version) for one that does not validate or does not follow the one before it.
  absl::Status Restore(const std::vector<v1::PlanChange>& changes);

  // Every plan, version 0 first. Shared with the calls that compute decisions outside the lock.
  std::shared_ptr<const PlanHistory> history() const { return history_; }
  const std::vector<v1::PlanChange>& plans() const { return plans_; }
  int size() const { return static_cast<int>(plans_.size()); }
  // The plans a member holding `known` of them lacks (known < 1 counts as 1: every member has
  // version 0), appended to `out`.
  template <typename Repeated>
  void AppendAfter(int32_t known, Repeated* out) const {
    for (int v = known < 1 ? 1 : known; v < size(); ++v) *out->Add() = plans_[v];
  }

  // The steps a member may use. `rank` was handed decisions through `last_step`.
  void Handed(int32_t rank, int64_t last_step);
  // From a member's beat: it may use what it holds through `used_through` (-1: not said), in
  // answer to proposal `answered` (0: none).
  void Reported(int32_t rank, int64_t used_through, int32_t answered);
  // The last step `rank` may still use its plans at, as far as is known; -1 when nothing is.
  int64_t UsedThrough(int32_t rank) const;
  // Whether `rank` answered the proposal under way.
  bool Answered(int32_t rank) const;

  struct Proposal {
    int32_t version = 0;
    v1::JobSpec spec;
    Schedule schedule;
    absl::Time deadline;
    UpdateCallback done;
  };
  // The version being proposed, 0 when none is.
  int32_t proposed() const { return proposal_ ? proposal_->version : 0; }
  const std::optional<Proposal>& proposal() const { return proposal_; }
  // Starts a proposal of version size(). Precondition: proposed() == 0.
  void Propose(v1::JobSpec spec, Schedule schedule, absl::Time deadline, UpdateCallback done);
  // Ends the proposal (accepted or failed) and returns it. Precondition: proposed() != 0.
  Proposal TakeProposal();

  // The switch step for the proposal under way, given the members that must not cross it on
  // the old plan (`members`, with the steps they reported) and `floor` (a step the switch may
  // not precede: past the planned admissions).
  int64_t ChooseSwitchStep(const std::vector<int32_t>& members,
                           const std::vector<int64_t>& steps, int64_t floor) const;

  // The record of `proposal` accepted at `switch_step`.
  static v1::PlanChange ChangeOf(const Proposal& proposal, int64_t switch_step,
                                 int64_t unix_ms);
  // Makes `change` (of `schedule`) the next plan. INVALID_ARGUMENT as PlanHistory::Add.
  absl::Status Accept(const v1::PlanChange& change, Schedule schedule);

  // The latest plan whose switch step is past `min_step` (the members' smallest), or null.
  const v1::PlanChange* Pending(int64_t min_step) const;

 private:
  std::shared_ptr<const PlanHistory> history_;
  std::vector<v1::PlanChange> plans_;
  // Per rank (grown on demand): the last step handed, the last step reported usable, and the
  // proposal version that report answered.
  std::vector<int64_t> handed_;
  std::vector<int64_t> reported_;
  std::vector<int32_t> answered_;
  std::optional<Proposal> proposal_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_PLAN_UPDATES_H_
