// A member's compute pace (docs/paced.md): the steps per second of its own time outside the
// averaging calls. A paced level plans each member's sync steps from it, and the wait inside a
// round must not count (with it, every member of a step-locked start would measure the slowest
// one's pace, and pacing would never start). Each AverageParameters call is one step: the step's
// compute time is from the end of the previous call to the start of this one. Once the member
// has taken a paced round, the pace is over the steps since the start of its previous round: a
// round is planned from the paces at the end of the one before it, and the member's pace at
// that moment alone would mispredict the next round (on shared cores, a slow member runs faster
// while the fast ones wait at the round); the whole previous round is what the next repeats.
//
// Thread-safe: the averaging thread marks the calls, the heartbeat thread reads the pace.
#ifndef MODELAVG_CLIENT_SESSION_PACE_TRACKER_H_
#define MODELAVG_CLIENT_SESSION_PACE_TRACKER_H_

#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace modelavg::client {

class PaceTracker {
 public:
  // `clock` outlives it. `window`: how far back the pace looks, in time, until a paced round
  // has been taken (the steps whose compute started within `window` of the latest call's start;
  // at least the newest step); from then on, back to the start of the previous round. At most
  // kMaxSamples steps are kept (the oldest go first).
  explicit PaceTracker(const Clock& clock, absl::Duration window = absl::Seconds(2));

  // An averaging call starts: the time since the previous call ended was one step's compute.
  // Nothing is measured before the first call has ended.
  void CallStarted() ABSL_LOCKS_EXCLUDED(mu_);
  // The averaging call ends (whatever its result): the next step's compute starts. `paced_round`:
  // the call took a paced level's round (Decision::round >= 0).
  void CallEnded(bool paced_round = false) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the steps measured (the trainer restored a checkpoint, a pause it asked for): the
  // next step's compute starts at the next CallEnded.
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);

  // Steps per second of compute over the window: the steps measured there divided by their
  // compute time; 0 until a step has been measured (HeartbeatRequest.compute_steps_per_second:
  // 0 = not measured).
  double steps_per_second() const ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kMaxSamples = size_t{1} << 16;

 private:
  // Drops the steps that left the window.
  void Prune(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Sample {
    absl::Time started;  // when the step's compute started (the previous call's end)
    absl::Duration compute;
  };

  const Clock& clock_;
  const absl::Duration window_;
  mutable absl::Mutex mu_;
  // The end of the last call, while no call is in progress; InfinitePast: none (or in a call).
  absl::Time ended_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::deque<Sample> samples_ ABSL_GUARDED_BY(mu_);
  // The ends of the last two paced rounds taken (the front: the previous round's start);
  // InfinitePast: none yet.
  absl::Time round_ends_[2] ABSL_GUARDED_BY(mu_) = {absl::InfinitePast(), absl::InfinitePast()};
  absl::Duration total_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_PACE_TRACKER_H_
