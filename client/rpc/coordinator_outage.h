// Whether the coordinator is reachable, as this client's heartbeats and calls find it, and the
// bound on how long work that needs it waits through an outage.
//
// While the coordinator is unreachable a worker keeps training: decisions come from the local
// schedule (through the decisions the coordinator handed it: client/session/decision_window.h),
// existing communicators keep averaging, heartbeats retry with backoff. Only work that needs the
// coordinator (bootstrapping a communicator, a Join, a step past what it was handed) waits for
// it, retrying through
// Retry() until the outage has lasted ClientOptions.coordinator_outage_timeout; then it fails
// with UNAVAILABLE naming the coordinator and how long it has been gone. Thread-safe.
#ifndef MODELAVG_CLIENT_RPC_COORDINATOR_OUTAGE_H_
#define MODELAVG_CLIENT_RPC_COORDINATOR_OUTAGE_H_

#include <algorithm>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace modelavg::client {

class CoordinatorOutage {
 public:
  // Times outages and waits between retries on `clock` (not owned; outlives this).
  CoordinatorOutage(std::string coordinator, absl::Duration timeout,
                    const Clock* clock = Clock::Real())
      : coordinator_(std::move(coordinator)), timeout_(timeout), clock_(clock) {}

  // A reply came: ends an outage (logged with its length).
  void NoteReachable();
  // A call failed for want of the coordinator: starts an outage if none (logged once, then
  // every 30 s while it lasts).
  void NoteUnreachable(const absl::Status& error);

  // Zero while reachable; otherwise how long the coordinator has been unreachable.
  absl::Duration OutageLength() const;
  // The outage has lasted longer than the timeout.
  bool Exceeded() const { return OutageLength() > timeout_; }
  absl::Duration timeout() const { return timeout_; }

  // UNAVAILABLE: the coordinator at <address> has not answered for <length>
  // (coordinator_outage_timeout ...; last error ...): <what> needs it.
  absl::Status Error(absl::string_view what, const absl::Status& last) const;

  // A failure that says the coordinator is out of reach (UNAVAILABLE, or DEADLINE_EXCEEDED
  // while an outage is known) rather than that it refused the call.
  bool IsOutage(const absl::Status& status) const;

  // Runs `call` (returning absl::Status or absl::StatusOr<T>) and retries it with backoff while
  // it fails for want of the coordinator, until the outage has lasted the timeout; then returns
  // Error(what, last). Other results are returned as they are.
  template <typename F>
  auto Retry(absl::string_view what, F call) -> decltype(call()) {
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      auto result = call();
      const absl::Status status = StatusOf(result);
      if (status.ok()) {
        NoteReachable();
        return result;
      }
      if (!IsOutage(status)) return result;
      NoteUnreachable(status);
      if (Exceeded()) return Error(what, status);
      clock_->SleepFor(std::min(backoff, std::max(absl::Milliseconds(1),
                                                timeout_ - OutageLength())));
      // Short: the sooner the coordinator is seen back, the sooner training needs nothing else.
      backoff = std::min(backoff * 2, absl::Milliseconds(250));
    }
  }

 private:
  static const absl::Status& StatusOf(const absl::Status& s) { return s; }
  template <typename T>
  static absl::Status StatusOf(const T& s) {
    return s.status();
  }

  const std::string coordinator_;
  const absl::Duration timeout_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  bool out_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time since_ ABSL_GUARDED_BY(mu_);
  absl::Time next_log_ ABSL_GUARDED_BY(mu_);
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_RPC_COORDINATOR_OUTAGE_H_
