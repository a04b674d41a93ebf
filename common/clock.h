// A clock that can be replaced in tests, so that timeouts are tested without sleeping.
//
// Code whose decisions depend on time (a timeout that has passed, a backoff before the next
// attempt, a wait for something bounded by a deadline) reads Now() and waits through its Clock:
// the real one in production, a FakeClock in tests, which moves only when the test says so.
#ifndef MODELAVG_COMMON_CLOCK_H_
#define MODELAVG_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace modelavg {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // With `mu` held: waits until `condition` holds or this clock reads `deadline` or later,
  // releasing `mu` meanwhile (absl::Mutex::AwaitWithDeadline on this clock). Returns whether
  // `condition` holds.
  virtual bool AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                 absl::Time deadline) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // Waits until this clock has moved on by `d`.
  void SleepFor(absl::Duration d) const;

  // The process-wide real clock.
  static Clock* Real();
};

// A clock that moves only when told to (Advance). Its waits end when their condition holds or
// once the clock has been moved to their deadline; they look at the clock every millisecond.
// With `advance_on_wait`, a wait whose condition does not hold moves the clock to its deadline
// at once instead of waiting for it: a retry loop with backoff then runs through its whole
// timeout in no time. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000),
                     bool advance_on_wait = false)
      : advance_on_wait_(advance_on_wait), now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  bool AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                         absl::Time deadline) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // How many waits have begun on this clock so far.
  int waits() const {
    absl::MutexLock lock(&mu_);
    return waits_;
  }
  // Blocks until at least `n` waits have begun on this clock (a test moves the clock once the
  // code under test waits on it), at most `timeout` of real time. Whether they have.
  bool AwaitWaits(int n, absl::Duration timeout) const;

 private:
  const bool advance_on_wait_;
  mutable absl::Mutex mu_;
  mutable absl::Time now_ ABSL_GUARDED_BY(mu_);
  mutable int waits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace modelavg

#endif  // MODELAVG_COMMON_CLOCK_H_
