// Leaving a job (Client::Leave and Client::FailOut): the LeaveRequest of this rank's membership
// sent to the coordinator. An orderly departure is retried with backoff while the coordinator is
// unreachable (a restart at the end of a job), for at most ClientOptions.leave_timeout on the
// session's clock; a worker whose averaging failed tries once.
#ifndef MODELAVG_CLIENT_SESSION_LEAVE_H_
#define MODELAVG_CLIENT_SESSION_LEAVE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/clock.h"
#include "modelavg/client/cancel_token.h"
#include "modelavg/client/client.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

class CoordinatorClient;
class CoordinatorOutage;

// Tells the coordinator that the rank of `request` (job, rank, generation and credential set)
// leaves because of `reason`: in order when `failure` is OK, otherwise as a failure (the
// coordinator counts it dead; the reason carries the failure's message). Errors: those of
// Client::Leave.
absl::Status SendLeave(CoordinatorClient& coordinator, CoordinatorOutage& outage,
                       const Clock& clock, const ClientOptions& options,
                       v1::LeaveRequest request, absl::string_view reason,
                       const absl::Status& failure, CancelToken* cancel);

// Client::FailOut's departure: one attempt, saying that the rank failed with `failure`. A
// coordinator that does not take it is logged: the peers then count the rank dead at its
// heartbeat timeout.
void SendFailOut(CoordinatorClient& coordinator, const ClientOptions& options,
                 v1::LeaveRequest request, const absl::Status& failure);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_LEAVE_H_
