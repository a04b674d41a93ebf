// Validation of the wire-level JobSpec and conversions between the schedule's types and the
// protobuf messages. The schedule itself (schedule.h) knows nothing of protobuf.
#ifndef MODELAVG_COMMON_JOB_SPEC_H_
#define MODELAVG_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg {

// Longest job id, and the longest timeouts a spec may ask for.
inline constexpr size_t kMaxJobIdLength = 128;
inline constexpr int64_t kMaxHeartbeatTimeoutMs = 3600 * 1000;
inline constexpr int64_t kMaxJoinTimeoutMs = 24 * 3600 * 1000;
// The shortest timeouts a job may have. A member beats every 100 ms (ClientOptions::
// heartbeat_interval); below 500 ms one late beat (a pause of the trainer's process, a
// retransmission on a busy link) declares a live member dead, and the whole world can be
// declared dead within a few beats. A Join waits for the rest of the world, which takes at least
// a round trip to every worker and the workers' own start.
inline constexpr int64_t kMinHeartbeatTimeoutMs = 500;
inline constexpr int64_t kMinJoinTimeoutMs = 1000;

// INVALID_ARGUMENT unless `job_id` is 1-128 characters of [A-Za-z0-9._-].
absl::Status ValidateJobId(absl::string_view job_id);

// Validates everything in a JobSpec (job id, mode, schedule, timeouts, pacing) and returns its
// schedule spec. INVALID_ARGUMENT naming the field and the value otherwise.
absl::StatusOr<ScheduleSpec> ScheduleSpecFromProto(const v1::JobSpec& spec);

// A paced job's pacing (GetJob's PacingStatus) for people, as the CLI and the status page show
// it: {"group paces", "50.2, 24.9 steps/s"}, {"round 7", "sync steps 140, 70 (+20, +10);
// weights 20, 20, 10, 10"}, ... (the last rounds, newest first), {"idle saved", "48%"}.
std::vector<std::pair<std::string, std::string>> PacingRows(const v1::PacingStatus& pacing);

// The schedule spec as the wire message's mode/world/warm-up/levels (other fields untouched).
void ScheduleSpecToProto(const ScheduleSpec& spec, v1::JobSpec* out);

// Replaces the contents of `out` with `d` and the generation it belongs to.
void DecisionToProto(const Decision& d, int64_t generation, v1::StepDecision* out);

// The inverse: a decision received from the coordinator.
Decision DecisionFromProto(const v1::StepDecision& d);

}  // namespace modelavg

#endif  // MODELAVG_COMMON_JOB_SPEC_H_
