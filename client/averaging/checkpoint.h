// An averager's checkpoint (ModelAverager::state_dict and load_state_dict): the outer state of
// every outer level (anchors and momenta), of every fragment of a streaming level, and the
// background all-reduces not applied yet, as host copies (AveragerState); and the same, checked
// against the job's spec, built back into the levels' states.
//
// Not thread-safe: ModelAverager calls it under its mutex.
#ifndef MODELAVG_CLIENT_AVERAGING_CHECKPOINT_H_
#define MODELAVG_CLIENT_AVERAGING_CHECKPOINT_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/averaging/outer_level.h"
#include "client/averaging/streaming_level.h"
#include "client/outer/outer_state.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"

namespace modelavg::client {

class Checkpoint {
 public:
  // `client` outlives it (the job's spec, for the checks).
  explicit Checkpoint(const Client* client) : client_(client) {}

  // The state at `step`. Waits for the background all-reduces in flight (each at most the
  // collective timeout and a margin; one that has not ended by then is aborted and saved as
  // failed).
  AveragerState Save(int64_t step, const OuterLevel& outer, StreamingLevel& streaming) const;

  // The levels' states built from `state`, apart from the averager's: nothing changes on an
  // error. The errors of ModelAverager::load_state_dict.
  struct Restored {
    std::vector<std::unique_ptr<OuterLevelState>> outer;
    FragmentStates fragments;
    std::vector<std::unique_ptr<PendingSync>> pending;
  };
  absl::StatusOr<Restored> Restore(const AveragerState& state) const;

 private:
  // The streaming levels' part of Save and Restore.
  void SaveStreaming(StreamingLevel& streaming, AveragerState* out) const;
  absl::Status RestoreStreaming(const AveragerState& state, Restored* restored) const;

  const Client* const client_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_CHECKPOINT_H_
