// The wait between two attempts of a call that the session retries while the coordinator is
// unreachable (Join, Leave): on the session's clock, cut short once a CancelToken is cancelled.
#ifndef MODELAVG_CLIENT_SESSION_RETRY_WAIT_H_
#define MODELAVG_CLIENT_SESSION_RETRY_WAIT_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/client/cancel_token.h"

namespace modelavg::client {

// Waits `d` on `clock`, or until `cancel` (when not null) is cancelled.
inline void SleepUnlessCancelled(const Clock& clock, CancelToken* cancel, absl::Duration d) {
  absl::Mutex mu;
  bool cancelled = false;
  const uint64_t id = cancel != nullptr ? cancel->Register([&] {
    absl::MutexLock l(&mu);
    cancelled = true;
  })
                                        : 0;
  {
    absl::MutexLock l(&mu);
    clock.AwaitWithDeadline(mu, absl::Condition(&cancelled), clock.Now() + d);
  }
  if (cancel != nullptr) cancel->Unregister(id);
}

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_RETRY_WAIT_H_
