// The decisions of one rank, prefetched in windows: an ordinary step costs no RPC. Every
// decision fetched from the coordinator is checked against the job's plans as this rank holds
// them (pure functions of the specs it learnt: at Join, then from heartbeat replies and the
// windows themselves when UpdateJob changes the plan, docs/plan-updates.md).
//
// What this rank may use without asking again is what the coordinator handed it: the windows it
// fetched. A later plan switches past them, so during a coordinator outage the rank goes on with
// the plans it holds up to the end of its last window and then waits for the coordinator (at
// most the outage timeout): it never crosses a switch step it could not know of. When the
// coordinator proposes a new plan (a heartbeat reply's proposed_plan), the rank gives back what
// it holds past about half a second of steps from now, answers so in its beats, and waits at that
// step until it learns the switch step (or the proposal ends).
#ifndef MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_
#define MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/common/plan_history.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

class CoordinatorClient;
class CoordinatorOutage;

class DecisionWindow {
 public:
  // `coordinator`, `outage` and `clock` outlive this. `plans`: the job's plans as Join gave
  // them. `size`: decisions per GetSchedule call. `credential`: the rank's (its windows are its
  // own).
  DecisionWindow(CoordinatorClient& coordinator, CoordinatorOutage& outage, const Clock& clock,
                 PlanHistory plans, std::string job_id, int32_t rank, std::string credential,
                 int64_t size);

  // The decision at `step` (>= 0, not checked here), fetching the window that starts at `step`
  // when `step` is outside the current one. Thread-safe.
  // Errors: INTERNAL (the coordinator disagrees with the plans), UNAVAILABLE (the coordinator
  // was out of reach past the outage timeout at a step this rank may not decide alone), the RPC
  // errors.
  absl::StatusOr<Decision> At(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // The plans this rank holds (decisions name their version). Every snapshot lives as long as
  // this window: a reference taken once stays valid.
  std::shared_ptr<const PlanHistory> plans() const ABSL_LOCKS_EXCLUDED(mu_);

  // What a beat reports about the plans (HeartbeatRequest fields), at the rank's `step`; also
  // keeps the rank's pace (the steps of the last second) for the answer to a proposal.
  struct BeatFields {
    int32_t plans_known = 1;
    int64_t used_through = -1;
    int32_t proposal_answered = 0;
  };
  BeatFields OnBeat(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // A heartbeat reply: plans this rank lacked, a proposal to answer. A plan that does not
  // validate is an error (the client is then broken: its decisions could not be trusted).
  absl::Status OnReply(const v1::HeartbeatResponse& reply) ABSL_LOCKS_EXCLUDED(mu_);

  // The session is over (`why`: the job was deleted, the rank was taken, ...): a call waiting
  // for the coordinator (a proposal's switch step, the end of an outage) fails with `why` at
  // once, as does every later one that would wait. The first reason stands.
  void Break(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status Fetch(int64_t from_step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fetch's end for a paced job (docs/paced.md): checks and keeps its shorter window.
  absl::Status TakePaced(const v1::GetScheduleResponse& resp, int64_t from_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `changes` this rank lacks (versions >= plans_->size()).
  template <typename Repeated>
  absl::Status Learn(const Repeated& changes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The last step this rank may decide with what it holds: its windows' end, or its answer to a
  // proposal.
  int64_t MayUseThrough() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return answered_ != 0 ? std::min(handed_through_, give_back_at_) : handed_through_;
  }

  CoordinatorClient& coordinator_;
  CoordinatorOutage& outage_;
  const Clock& clock_;
  const std::string job_id_;
  const int32_t rank_;
  const std::string credential_;
  const int64_t size_;

  mutable absl::Mutex mu_;
  std::shared_ptr<const PlanHistory> plans_ ABSL_GUARDED_BY(mu_);
  // Every snapshot plans_ has been (few: one per plan), kept for the references handed out.
  std::vector<std::shared_ptr<const PlanHistory>> snapshots_ ABSL_GUARDED_BY(mu_);
  // The window [start_, start_ + window_.size()).
  int64_t start_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Decision> window_ ABSL_GUARDED_BY(mu_);
  // The last step the coordinator handed this rank (its windows' end); -1 before any.
  int64_t handed_through_ ABSL_GUARDED_BY(mu_) = -1;
  // The proposal answered (0: none), and the step given back to.
  int32_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t give_back_at_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // The rank's pace: a step and when it was reported, about a second ago, and steps a second.
  int64_t pace_step_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time pace_time_ ABSL_GUARDED_BY(mu_);
  double steps_per_second_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_
