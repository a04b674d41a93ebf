// A fragment's all-reduce running in the background (streaming sync with Level.sync_delay,
// docs/streaming.md): started by the averaging call at the sync step s, applied by the call at
// s + sync_delay. The background thread touches only `buffer` (a copy of the parameters or the
// pseudo-gradient) and the communicator; the parameters are written only by the averaging call
// that applies it.
#ifndef MODELAVG_CLIENT_AVERAGING_PENDING_SYNC_H_
#define MODELAVG_CLIENT_AVERAGING_PENDING_SYNC_H_

#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "client/averaging/device_outer_state.h"
#include "client/averaging/outer_state.h"
#include "client/comm/communicator.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// Whether `level` is an outer level with streaming fields (fragments > 1, sync_delay, mix or a
// compressed payload): its outer state is per fragment.
inline bool StreamingOuterLevel(const ScheduleLevel& level) {
  return level.outer.has_value() && (level.fragments > 1 || level.sync_delay != 0 ||
                                     level.mix != 0 || level.payload != Payload::kFp32);
}

struct PendingSync {
  Decision decision;
  int64_t apply_step = 0;
  // The fragment's first sync: `buffer` holds the parameters (a plain average, the anchor's
  // first value); otherwise the pseudo-gradient.
  bool first = false;
  OuterLevelState* state = nullptr;
  // Null for a sync restored by load_state_dict (already done, its result in `buffer`). Used
  // only while the round runs: once the job moves to a newer generation the communicator may
  // be dropped.
  Communicator* comm = nullptr;
  // The round's options (elastic jobs: committed, at the sync step).
  RoundOptions options;
  std::unique_ptr<OuterBuffer> buffer;
  // CUDA parameters: the sync's device buffer and stream instead of `buffer`
  // (averager_streaming_device.cc).
  std::unique_ptr<DevicePendingSync> device;
  int64_t bytes_before = 0;
  // Written by the thread before `done` is notified.
  int64_t bytes_after = 0;
  absl::Status result;
  RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
  // Elastic jobs, a round that failed holding its result (its confirmation was lost): that
  // result, kept apart from `buffer` (still the round's inputs) until the call at apply_step
  // settles the round (ModelAverager::SettleBackgroundRound).
  std::unique_ptr<OuterBuffer> held;
  absl::Notification done;
  std::thread thread;

  ~PendingSync() {
    if (thread.joinable()) thread.join();
  }
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_PENDING_SYNC_H_
