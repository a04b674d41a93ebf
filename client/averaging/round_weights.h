// The weighted contribution of a paced round (docs/paced.md): a decision that carries `weights`
// asks for the round's result sum_i w_i x_i / W over its contributing members (W: the sum of
// their weights), x_i the member's parameters on a plain level, its pseudo-gradient on an outer
// one.
//
// Where the weight is applied: each contributing member multiplies its contribution by
// s_i = k * w_i / W (k: the contributing members) BEFORE the round, on a copy (WeightedInput),
// and the communicator divides the sum by k as in every round, so that
// sum_i s_i x_i / k = sum_i w_i x_i / W. The communicators, their payload codecs and the
// divisor stay what they are; a payload encodes the weighted contribution, and with error
// feedback a member sends U = beta * E + s_i * D and keeps E = U - decode(encode(U)) (the level
// fills the copy: WeightedInput::Fill's `fill`). The caller's tensors are written only once the
// round has completed (WeightedInput::Finish): a failed round leaves them untouched, and an
// elastic retry weighs the unscaled values again with the retry's own decision.
//
// A decision without weights is not touched here at all: its round is today's, bit for bit.
#ifndef MODELAVG_CLIENT_AVERAGING_ROUND_WEIGHTS_H_
#define MODELAVG_CLIENT_AVERAGING_ROUND_WEIGHTS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_state.h"
#include "client/payload/payload_codec.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// This member's part in a decision's weighting.
struct RoundWeight {
  // The decision carries weights (a paced round); false: an ordinary round, nothing to apply.
  bool weighted = false;
  // This member's weight w_i (0 for a joining member) and the contributing members' sum W.
  double weight = 0;
  double total = 0;
  // The contributing members (Members() less joining): the communicator's divisor.
  int contributors = 0;
  // s_i = k * w_i / W: what this member's contribution is multiplied by (0 when joining).
  double scale = 1;
};

// This member's (`rank`'s) weighting in `decision`. INVALID_ARGUMENT when the weights are not
// one per member of Members(), a weight is not finite or is negative, `rank` is not a member,
// or the contributing members' weights sum to 0 (or overflow) while some contribute.
absl::StatusOr<RoundWeight> WeightOf(const Decision& decision, int32_t rank);

// Whether completing `decision` (of a plan whose levels are `levels`) completes the last round
// of a paced job counted in rounds: the decision averages at the last level, which is paced
// with ScheduleLevel::rounds R > 0, and its round is R - 1 (or later). ModelAverager's
// budget_spent().
bool CompletesPacedBudget(const std::vector<ScheduleLevel>& levels, const Decision& decision);

// to[i][j] := fl(scale * from[i][j]) in `to`'s dtype, the product in double. `from` and `to`
// have the same layout (counts) and may be the same tensors (in place); host memory.
void ScaleInto(absl::Span<const TensorView> from, double scale,
               absl::Span<const TensorView> to);

// Error feedback on a weighted round (a streaming level's outer step, Level.error_feedback):
// u := fl32(scale * d), then u := fl32(beta * E + u) with `state`'s residual E, and *residual :=
// the residual that sending u in `format` leaves, E' = u - decode(encode(u)). `d` (the
// pseudo-gradient, float32) is left unscaled; `u` has its layout.
absl::Status WeighWithFeedback(const OuterLevelState& state, double beta, WireFormat format,
                               absl::Span<const TensorView> d, double scale,
                               absl::Span<const TensorView> u, OuterBuffer* residual);

// The copy of a weighted round's tensors: the round runs on it, and its result is written into
// the caller's tensors only once the round has completed. Host tensors: a host buffer. CUDA
// tensors: the device's buffer for it (OuterDevice::WeightedCopy, one round at a time), weighed by
// OuterKernels::ScaleCopy with the host's arithmetic, so that a member's weighted contribution
// is the same bits on either path.
class WeightedInput {
 public:
  // Fills the level's contribution for `weight.scale` into the copy (same layout as the
  // caller's tensors) — default: the caller's tensors times the scale (ScaleInto).
  using FillFn = std::function<absl::Status(double scale, absl::Span<const TensorView> out)>;

  // `device`: where the copy of CUDA tensors lives (outlives this); null: host tensors only.
  explicit WeightedInput(OuterDevice* device = nullptr) : device_(device) {}

  // Shapes the copy like `tensors` (same counts and dtypes, back to back), fills it and
  // returns its views. `fill` may be empty; it runs on host tensors only (UNIMPLEMENTED for
  // CUDA ones, as without a device).
  absl::StatusOr<std::vector<TensorView>> Fill(const RoundWeight& weight,
                                               absl::Span<const TensorView> tensors,
                                               const FillFn& fill);
  // The tensors a round of `decision` runs on for member `rank`: `tensors` themselves for a
  // decision without weights, else the weighted copy (WeightOf, then Fill with `fill`).
  absl::StatusOr<absl::Span<const TensorView>> For(const Decision& decision, int32_t rank,
                                                  absl::Span<const TensorView> tensors,
                                                  const FillFn& fill);
  // The round completed: copies the result (the weighted mean) into `tensors` (CUDA tensors:
  // on their streams, waited for); nothing to do after For without weights.
  absl::Status Finish(absl::Span<const TensorView> tensors) const;

 private:
  OuterDevice* const device_;
  bool on_device_ = false;
  std::vector<uint8_t> bytes_;
  std::vector<TensorView> views_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_ROUND_WEIGHTS_H_
