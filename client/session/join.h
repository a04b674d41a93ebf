// Joining a job (the first half of Client::Connect): the options checked, the Join retried with
// backoff while the coordinator is unreachable (until join_timeout, on the session's clock), the
// reply checked against the schedule of the spec it carries, and, for a replacement admitted into
// a running elastic job, the view of the generation it was admitted into.
#ifndef MODELAVG_CLIENT_SESSION_JOIN_H_
#define MODELAVG_CLIENT_SESSION_JOIN_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/client/client.h"
#include "modelavg/client/membership_view.h"
#include "modelavg/common/plan_history.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

class CoordinatorClient;

// INVALID_ARGUMENT naming the first field of `options` that cannot work, and what it must be.
absl::Status ValidateOptions(const ClientOptions& options);

// What the coordinator's Join reply says, checked.
struct Joined {
  Schedule schedule;  // of the spec the reply carries (the job's first plan)
  // The job's plans: `schedule` and the updates since (docs/plan-updates.md).
  PlanHistory plans{schedule};
  int32_t rank = 0;
  int64_t generation = 0;
  // The job's heartbeat timeout in force (after the coordinator's defaults).
  absl::Duration heartbeat_timeout;
  std::string incarnation;
  // This membership's credential.
  std::string credential;
  bool elastic = false;
  // A replacement admitted into a running elastic job: its admission step; -1 for a member of
  // the world that started it.
  int64_t admission_step = -1;
};

// Joins the job as `options` say (options.worker_id set) and blocks until the world is
// complete; `host` is this machine's name. Errors: those of Client::Connect.
absl::StatusOr<Joined> JoinJob(CoordinatorClient& coordinator, const ClientOptions& options,
                               const std::string& host, const Clock& clock);

// A replacement (Joined::admission_step > 0): who averages from which step, as the members of
// the generation it was admitted into. ABORTED when the job changed meanwhile (so that `reader`
// is no live member of it any more).
absl::StatusOr<MembershipView> ReadAdmission(CoordinatorClient& coordinator,
                                             const std::string& job_id,
                                             const ViewReader& reader);

// This machine's name ("unknown-host" when it has none).
std::string HostName();

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_JOIN_H_
