// The streaming outer levels of an averager (docs/streaming.md): the outer step of one fragment
// of the parameters at a time, each fragment with its own anchor and momentum, the
// pseudo-gradient sent in the level's payload, the result mixed with the local parameters; with
// sync_delay, the fragment's all-reduce runs in the background from the call at its sync step to
// the call that applies it, sync_delay steps later.
//
// Not thread-safe: ModelAverager calls it under its mutex. A background all-reduce's thread
// touches only its PendingSync's buffer and communicator, never the parameters.
#ifndef MODELAVG_CLIENT_AVERAGING_STREAMING_LEVEL_H_
#define MODELAVG_CLIENT_AVERAGING_STREAMING_LEVEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "client/averaging/outer_level.h"
#include "client/averaging/round_runner.h"
#include "client/comm/communicator.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_state.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// A fragment's all-reduce running in the background (sync_delay > 0): started by the averaging
// call at the sync step s, applied by the call at s + sync_delay. The background thread touches
// only `buffer` (a copy of the parameters or the pseudo-gradient) and the communicator; the
// parameters are written only by the averaging call that applies it.
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
  // (streaming_level_device.cc).
  std::unique_ptr<DevicePendingSync> device;
  int64_t bytes_before = 0;
  // Written by the thread before `done` is notified.
  int64_t bytes_after = 0;
  absl::Status result;
  RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
  // Elastic jobs, a round that failed holding its result (its confirmation was lost): that
  // result, kept apart from `buffer` (still the round's inputs) until the call at apply_step
  // settles the round (StreamingLevel::Settle).
  std::unique_ptr<OuterBuffer> held;
  // Error feedback: the fragment's residual before this sync started (the state holds the one
  // it leaves), restored if the sync is not applied. Null without feedback.
  std::unique_ptr<OuterBuffer> residual_before;
  bool had_residual = false;
  // CUDA parameters: the device state's residual before this sync started (null: none), when
  // `device_residual_swapped`.
  std::unique_ptr<OwnedDeviceBuffer> device_residual_before;
  bool device_residual_swapped = false;
  absl::Notification done;
  std::thread thread;

  ~PendingSync() {
    if (thread.joinable()) thread.join();
  }
};

class StreamingLevel {
 public:
  // Every part outlives it; `pseudo_gradient` is shared with the whole outer levels.
  StreamingLevel(Client* client, OuterDevice* device, OuterBuffer* pseudo_gradient,
                 RoundRunner* rounds, Traffic* traffic);
  // Abandons the background all-reduces in flight.
  ~StreamingLevel();
  StreamingLevel(const StreamingLevel&) = delete;
  StreamingLevel& operator=(const StreamingLevel&) = delete;

  // An averaging step of `decision`'s streaming outer level on `fragment` (the tensors of the
  // decision's fragment; `split_signature`: the split's, for the layout agreement): the
  // fragment's first sync a plain FP32 average that sets its anchor, each later one an outer
  // step on its pseudo-gradient in the level's payload, then the mix. With sync_delay, the
  // all-reduce starts in the background and the call at the apply step finishes it (ApplyDue).
  absl::StatusOr<Decision> Round(const Decision& decision, const Device& device,
                                 absl::Span<const TensorView> fragment, int64_t split_signature);

  // Whether a background all-reduce is due at `step` (or before).
  bool DueBy(int64_t step) const;
  // The background all-reduces due at `step`, oldest first, applied to `params` (the call's):
  // each waits for its round (at most the collective timeout and a margin, then aborted) and
  // writes its result into its fragment. In an elastic job a failed one is settled first as a
  // blocking round would be. `report_step`: the step the client reports once a settle has
  // decided the sync step again. The first error; every due one is taken out either way.
  absl::Status ApplyDue(int64_t step, absl::Span<const TensorView> params, int64_t report_step);
  // Aborts the background all-reduces of generations before `generation` and waits for them to
  // end: their outcomes are in the round notes then.
  void EndBackgroundRoundsBefore(int64_t generation);
  // An admission at a streaming level's step syncs one fragment only: the replacements receive
  // the mean of the contributing members' parameters `params` through `comm` first (the
  // others' parameters do not change).
  absl::Status HandParameters(const Decision& decision, Communicator* comm,
                              absl::Span<const TensorView> params);

  // The fragments' states and the background all-reduces (the checkpoint's).
  FragmentStates& states() { return states_; }
  const FragmentStates& states() const { return states_; }
  std::vector<std::unique_ptr<PendingSync>>& pending() { return pending_; }
  // Aborts and joins the background all-reduces in flight, and forgets them.
  void Abandon();
  // Takes restored states and syncs (load_state_dict), abandoning those in flight.
  void Replace(FragmentStates states, std::vector<std::unique_ptr<PendingSync>> pending);

 private:
  // "outer step at step s (level l, fragment f of F, subgroup g[, device])": where an error
  // happened.
  static std::string Where(const Decision& decision, const Device* device);
  // The record of a sync of `decision`'s fragment that starts now and is applied at its step
  // plus the level's sync_delay (host and device syncs alike).
  std::unique_ptr<PendingSync> NewPendingSync(const Decision& decision, OuterLevelState* state,
                                              bool first) const;
  // Starts the fragment's all-reduce on a background thread and returns (host parameters;
  // CUDA ones go on to StartDevice).
  absl::StatusOr<Decision> Start(const Decision& decision, const Device& device,
                                 absl::Span<const TensorView> fragment, OuterLevelState* state,
                                 bool first, int64_t split_signature);
  absl::Status ApplyOne(std::unique_ptr<PendingSync> p, int64_t step,
                        absl::Span<const TensorView> params, int64_t report_step);
  absl::Status ApplyOneInner(PendingSync* p, int64_t step, absl::Span<const TensorView> params,
                             int64_t report_step);
  // Elastic jobs: the call at a background all-reduce's apply step found it failed. Settles it
  // as a blocking round is settled: keeps the result it holds if a live peer completed it,
  // else runs it again with the sync step's live members and the same inputs.
  absl::Status Settle(PendingSync& p, int64_t report_step);

  // CUDA parameters (streaming_level_device.cc): the round with sync_delay 0, the start of a
  // background one, and the application of its result to the fragment.
  absl::StatusOr<Decision> DeviceRound(const Decision& decision, const Device& device,
                                       absl::Span<const TensorView> fragment,
                                       OuterLevelState* state, bool joining, int64_t first_sync,
                                       int64_t split_signature);
  absl::StatusOr<Decision> StartDevice(const Decision& decision, const Device& device,
                                       absl::Span<const TensorView> fragment,
                                       OuterLevelState* state, bool first,
                                       int64_t split_signature, const std::string& where);
  absl::Status ApplyDevice(PendingSync* p, absl::Span<const TensorView> fragment, double mix);

  Client* const client_;
  OuterDevice* const device_;
  OuterBuffer* const pseudo_gradient_;
  RoundRunner* const rounds_;
  Traffic* const traffic_;
  FragmentStates states_;
  // Background all-reduces not applied yet (at most one per streaming level), in start order.
  std::vector<std::unique_ptr<PendingSync>> pending_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_STREAMING_LEVEL_H_
