#include "client/session/pace_tracker.h"

#include <algorithm>

namespace modelavg::client {

PaceTracker::PaceTracker(const Clock& clock, absl::Duration window)
    : clock_(clock), window_(window) {}

void PaceTracker::CallStarted() {
  const absl::Time now = clock_.Now();
  absl::MutexLock l(&mu_);
  if (ended_ == absl::InfinitePast()) return;  // the first call: no step measured before it
  const absl::Duration compute = std::max(now - ended_, absl::ZeroDuration());
  samples_.push_back(Sample{ended_, compute});
  total_ += compute;
  ended_ = absl::InfinitePast();
  Prune(now);
}

void PaceTracker::Prune(absl::Time now) {
  // The window: the steps since the start of the previous paced round (the current one's while
  // only one round has ended), else those whose compute started within window_ of now; and
  // always the newest (a step longer than the window is still a measure).
  const absl::Time anchor =
      round_ends_[0] != absl::InfinitePast() ? round_ends_[0] : round_ends_[1];
  const absl::Time from = anchor == absl::InfinitePast() ? now - window_ : anchor;
  while (samples_.size() > 1 &&
         (samples_.front().started < from || samples_.size() > kMaxSamples)) {
    total_ -= samples_.front().compute;
    samples_.pop_front();
  }
}

void PaceTracker::CallEnded(bool paced_round) {
  const absl::Time now = clock_.Now();
  absl::MutexLock l(&mu_);
  ended_ = now;
  if (paced_round) {
    round_ends_[0] = round_ends_[1];
    round_ends_[1] = now;
    Prune(now);
  }
}

void PaceTracker::Reset() {
  absl::MutexLock l(&mu_);
  samples_.clear();
  total_ = absl::ZeroDuration();
  ended_ = absl::InfinitePast();
  round_ends_[0] = round_ends_[1] = absl::InfinitePast();
}

double PaceTracker::steps_per_second() const {
  absl::MutexLock l(&mu_);
  // No step, or steps of no measurable compute (a clock that did not move): not measured.
  if (samples_.empty() || total_ <= absl::ZeroDuration()) return 0;
  return static_cast<double>(samples_.size()) / absl::ToDoubleSeconds(total_);
}

}  // namespace modelavg::client
