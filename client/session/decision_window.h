// The decisions of one rank, prefetched in windows: an ordinary step costs no RPC. Every
// decision fetched from the coordinator is checked against the local schedule (a pure function of
// the spec the rank joined with); during a coordinator outage the local schedule stands in.
#ifndef MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_
#define MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

class CoordinatorClient;
class CoordinatorOutage;

class DecisionWindow {
 public:
  // `coordinator`, `outage` and `schedule` outlive this. `size`: decisions per GetSchedule call.
  DecisionWindow(CoordinatorClient& coordinator, CoordinatorOutage& outage,
                 const Schedule& schedule, std::string job_id, int32_t rank, int64_t size)
      : coordinator_(coordinator),
        outage_(outage),
        schedule_(schedule),
        job_id_(std::move(job_id)),
        rank_(rank),
        size_(size) {}

  // The decision at `step` (>= 0, not checked here), fetching the window that starts at `step`
  // when `step` is outside the current one. Thread-safe.
  // Errors: INTERNAL (the coordinator disagrees with the local schedule), the RPC errors.
  absl::StatusOr<Decision> At(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status Fetch(int64_t from_step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  CoordinatorClient& coordinator_;
  CoordinatorOutage& outage_;
  const Schedule& schedule_;
  const std::string job_id_;
  const int32_t rank_;
  const int64_t size_;

  absl::Mutex mu_;
  // The window [start_, start_ + window_.size()).
  int64_t start_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Decision> window_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_DECISION_WINDOW_H_
