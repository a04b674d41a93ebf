// The decisions a job hands out (Step, GetSchedule): the schedule's, restricted to the ranks that
// are members at each step (MemberSteps, server/membership/admission.h), with the bounds on a window of
// them. Pure functions: no lock, no clock; Job calls them with what it read under its lock.
#ifndef MODELAVG_SERVER_MEMBERSHIP_DECISIONS_H_
#define MODELAVG_SERVER_MEMBERSHIP_DECISIONS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "modelavg/common/plan_history.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/membership/admission.h"

namespace modelavg::server {

inline constexpr int64_t kMaxScheduleCount = 100000;
// GetSchedule answers stay below gRPC's default 4 MiB receive limit (clients, grpcurl).
inline constexpr int64_t kMaxScheduleReplyBytes = 4 * 1024 * 1024 - 16 * 1024;

// Restricts a decision to the ranks that are members at its step: vacant ranks and replacements
// not admitted yet are left out; replacements admitted at that step are listed as joining.
// O(subgroup size). True if a rank of the subgroup was left out.
bool ApplyMembers(const MemberSteps& view, v1::StepDecision* d);

// Whether `request` asks for a window GetSchedule answers, before anything is built:
// INVALID_ARGUMENT for from_step < 0, count outside [1, kMaxScheduleCount], a rank outside the
// world of job `job_id`, or an answer that would exceed kMaxScheduleReplyBytes (estimated from
// below); CANCELLED once `cancelled` (may be null, polled now and then) says true.
absl::Status CheckDecisionWindow(const PlanHistory& plans, const v1::GetScheduleRequest& request,
                                 const std::string& job_id,
                                 const std::function<bool()>& cancelled);

// The window `request` asks for (checked by CheckDecisionWindow) in `generation`, each decision
// restricted to `members`; a block with no member at a step is left out of a window of every
// subgroup. INVALID_ARGUMENT when the answer built exceeds kMaxScheduleReplyBytes, CANCELLED as
// above; `response` is then empty.
absl::Status DecisionWindow(const PlanHistory& plans, const MemberSteps& members,
                            int64_t generation, const v1::GetScheduleRequest& request,
                            v1::GetScheduleResponse* response,
                            const std::function<bool()>& cancelled);

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_DECISIONS_H_
