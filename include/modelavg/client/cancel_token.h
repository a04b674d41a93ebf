// A way to end a blocking call from another thread: once Cancel() is called, the calls that watch
// the token end with CANCELLED as soon as they can (an RPC in flight is cancelled, a backoff
// sleep ends). For a caller that gives up on a call it cannot wait for, e.g. Ctrl-C in the Python
// package while Client::Connect waits for the world (ClientOptions::cancel).
#ifndef MODELAVG_CLIENT_CANCEL_TOKEN_H_
#define MODELAVG_CLIENT_CANCEL_TOKEN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace modelavg::client {

// Thread-safe; one-shot (a cancelled token stays cancelled).
class CancelToken {
 public:
  CancelToken() = default;
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // Runs the registered callbacks (under the token's lock: they must not block or call back).
  void Cancel() {
    absl::MutexLock l(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    for (auto& [id, on_cancel] : callbacks_) on_cancel();
  }

  bool cancelled() const {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }

  // Sleeps up to `d`; returns early, false, once the token is cancelled.
  bool SleepFor(absl::Duration d) const {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&cancelled_), d);
    return !cancelled_;
  }

  // For the code that watches the token: `on_cancel` runs at Cancel() (at once, here, if the
  // token is cancelled already) until Unregister(id) returns. It must not block.
  uint64_t Register(std::function<void()> on_cancel) {
    absl::MutexLock l(&mu_);
    if (cancelled_) on_cancel();
    callbacks_.emplace(next_id_, std::move(on_cancel));
    return next_id_++;
  }
  void Unregister(uint64_t id) {
    absl::MutexLock l(&mu_);
    callbacks_.erase(id);
  }

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

// A retry's wait: cut short by `cancel` (when given) being cancelled, so that the next attempt
// ends at once.
inline void SleepUnlessCancelled(const CancelToken* cancel, absl::Duration d) {
  if (cancel != nullptr) {
    cancel->SleepFor(d);
  } else {
    absl::SleepFor(d);
  }
}


}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_CANCEL_TOKEN_H_
