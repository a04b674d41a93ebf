// Checks of a request's own fields against the job's schedule, apart from the job's state: each
// returns INVALID_ARGUMENT saying what is wrong and what to do, or OK. Pure functions; Job
// calls them first (server/job/job.h).
#ifndef MODELAVG_SERVER_JOB_REQUEST_CHECKS_H_
#define MODELAVG_SERVER_JOB_REQUEST_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

// Limits on what a worker may store (GetSchedule's: server/membership/decisions.h).
inline constexpr size_t kMaxCommIdBytes = 4096;
inline constexpr size_t kMaxCommIdKeyLength = 256;

// `rank` is in [0, world_size) of job `job_id`.
absl::Status CheckRank(int32_t rank, int32_t world_size, const std::string& job_id);
// A reported step is >= 0.
absl::Status CheckStep(int64_t step);
// A Join's worker_id (set, bounded, no control character), host (bounded, no control character),
// world_size (0 or the job's) and rank.
absl::Status CheckJoinRequest(const v1::JoinRequest& request, int32_t world_size,
                              const std::string& job_id);
// The level, subgroup, rank and key length of a PublishCommId or GetCommId.
absl::Status CheckCommRequest(const Schedule& schedule, int32_t level, int32_t subgroup,
                              int32_t rank, const std::string& key, const std::string& job_id);
// A published unique_id is set and at most kMaxCommIdBytes.
absl::Status CheckCommIdBlob(const std::string& unique_id);
// The reporter and every rank a peer failure report names.
absl::Status CheckPeerReport(const v1::ReportPeerFailureRequest& request, int32_t world_size,
                             const std::string& job_id);
// A non-finite report's rank, step (>= 0), level (one of the schedule's), tensor (>= 0), value
// ("NaN", "+Inf", "-Inf") and payload (at most kMaxNonFinitePayloadLength characters).
absl::Status CheckNonFiniteReport(const v1::ReportNonFiniteRequest& request,
                                  const Schedule& schedule, const std::string& job_id);
inline constexpr size_t kMaxNonFinitePayloadLength = 64;

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOB_REQUEST_CHECKS_H_
