// The outer levels of an averager (DiLoCo, docs/diloco.md): a level with an outer optimizer
// averages the pseudo-gradient (anchor - parameters) and steps its anchor with PyTorch's SGD on
// the result, on host or CUDA parameters; at an elastic admission every outer state is handed
// to the replacements inside the round. The outer states and the device they live on
// (OuterDevice, shared with the streaming levels) are client/outer/'s.
//
// Not thread-safe: ModelAverager calls them under its mutex.
#ifndef MODELAVG_CLIENT_AVERAGING_OUTER_LEVEL_H_
#define MODELAVG_CLIENT_AVERAGING_OUTER_LEVEL_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/averaging/round_runner.h"
#include "client/comm/communicator.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_state.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// Whether `level` is an outer level with streaming fields (fragments > 1, sync_delay, mix or a
// compressed payload): its outer state is per fragment (StreamingLevel).
inline bool StreamingOuterLevel(const ScheduleLevel& level) {
  return level.outer.has_value() && (level.fragments > 1 || level.sync_delay != 0 ||
                                     level.mix != 0 || level.payload != Payload::kFp32);
}

// Per level, per fragment: the outer states of the streaming outer levels (empty for others).
using FragmentStates = std::vector<std::vector<std::unique_ptr<OuterLevelState>>>;
// The states of `level`'s fragments (`spec` is the level's), made fresh when there are none.
std::vector<std::unique_ptr<OuterLevelState>>& FragmentsOf(FragmentStates& states, int level,
                                                          const ScheduleLevel& spec);

class OuterLevel {
 public:
  // Every part outlives it; `pseudo_gradient` is shared with the streaming levels.
  OuterLevel(Client* client, OuterDevice* device, OuterBuffer* pseudo_gradient,
             RoundRunner* rounds);

  // Fresh states for the job's levels: one per level with an outer optimizer (null for the
  // others).
  static std::vector<std::unique_ptr<OuterLevelState>> FreshStates(const Schedule& schedule);

  // Whether `level` has an outer optimizer (and so a state here).
  bool Has(int level) const;
  const std::vector<std::unique_ptr<OuterLevelState>>& states() const { return states_; }
  void Replace(std::vector<std::unique_ptr<OuterLevelState>> states) {
    states_ = std::move(states);
  }
  // For a plan switch (ModelAverager): the states, leaving none.
  std::vector<std::unique_ptr<OuterLevelState>> TakeStates() { return std::move(states_); }

  // An averaging step of `decision`'s outer level on `params`: the level's first step is a
  // plain average that sets the anchor; each later one averages the pseudo-gradient in a round
  // and steps the anchor, which becomes the parameters. A replacement at its admission step
  // receives the state in the round (HandOver) and contributes no pseudo-gradient.
  absl::StatusOr<Decision> Round(const Decision& decision, const Device& device,
                                 absl::Span<const TensorView> params, RoundWire wire);

  // An admission round (decision.joining not empty): every replacement receives, for each outer
  // state (the whole levels here, each fragment of `fragments`, made if need be), the anchor
  // and momentum of the lowest contributing member of its block at that level, through `comm`.
  // `all`: the parameters the states cover; `layout`: the round's tensors (an NCCL round's
  // device and stream).
  absl::Status HandOver(const Decision& decision, Communicator* comm,
                        absl::Span<const TensorView> all, absl::Span<const TensorView> layout,
                        FragmentStates& fragments);

 private:
  Client* const client_;
  OuterDevice* const device_;
  OuterBuffer* const pseudo_gradient_;
  RoundRunner* const rounds_;
  // Per level: its outer state, or null for a plain level.
  std::vector<std::unique_ptr<OuterLevelState>> states_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_OUTER_LEVEL_H_
