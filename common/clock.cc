#include "common/clock.h"

namespace modelavg {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  bool AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                         absl::Time deadline) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu.AwaitWithDeadline(condition, deadline);
  }
};

}  // namespace

void Clock::SleepFor(absl::Duration d) const {
  static const bool kNever = false;
  absl::Mutex mu;
  absl::MutexLock lock(&mu);
  AwaitWithDeadline(mu, absl::Condition(&kNever), Now() + d);
}

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

bool FakeClock::AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                                  absl::Time deadline) const {
  {
    absl::MutexLock lock(&mu_);
    ++waits_;
  }
  while (!condition.Eval()) {
    {
      absl::MutexLock lock(&mu_);
      if (now_ >= deadline) return false;
      if (advance_on_wait_) {
        now_ = deadline;
        return false;
      }
    }
    mu.AwaitWithTimeout(condition, absl::Milliseconds(1));
  }
  return true;
}

bool FakeClock::AwaitWaits(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waits_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

}  // namespace modelavg
