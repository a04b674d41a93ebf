// The outer optimizer's state of one level on one member (DiLoCo, docs/diloco.md).
//
// Per parameter tensor an anchor A (the parameters as of the level's last averaging step) and,
// with momentum > 0, a momentum buffer M, both in the state dtype (float32 for float16/bfloat16
// parameters, else the parameters' dtype). An outer averaging step is three calls:
//
//   state.PseudoGradient(params, d);     // d := A - x, in the state dtype
//   communicator->AllReduceAverage(d);   // D := mean over the group of d
//   state.Step(d, params);               // PyTorch's SGD on A with gradient D; x := A
//
// The round in the middle is the caller's: it may fail and be retried (the state and the
// parameters change only in Step), or be kept aside and adopted (elastic commit). Every call
// takes a tensor range [first, first + n) of the level's tensor list so that a level can act on
// a fragment of the parameters at a time; the whole list is first = 0, n = all.
#ifndef MODELAVG_CLIENT_OUTER_OUTER_STATE_H_
#define MODELAVG_CLIENT_OUTER_OUTER_STATE_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/outer/outer_rule.h"
#include "client/payload/payload_codec.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

class DeviceOuterState;

// float32 for float16/bfloat16, else `param`.
DType OuterStateDType(DType param);

// Host buffers in the state layout of a parameter list: one contiguous allocation, tensor i at
// a fixed offset, so that a list of state-dtype views over it is reduced in place by Gloo.
class OuterBuffer {
 public:
  // Resizes to the state layout of `params` (the allocation is reused; a fresh buffer is
  // zero-filled).
  void Shape(absl::Span<const TensorView> params);
  // Views of tensors [first, first + n).
  std::vector<TensorView> Views(size_t first, size_t n);
  std::vector<TensorView> Views() { return Views(0, numel_.size()); }
  size_t size() const { return numel_.size(); }
  int64_t numel(size_t i) const { return numel_[i]; }
  DType dtype(size_t i) const { return dtype_[i]; }
  void* data(size_t i) { return bytes_.data() + offset_[i]; }
  const void* data(size_t i) const { return bytes_.data() + offset_[i]; }
  size_t nbytes(size_t i) const { return static_cast<size_t>(numel_[i]) * DTypeSize(dtype_[i]); }
  size_t total_bytes() const { return bytes_.size(); }

 private:
  std::vector<int64_t> numel_;
  std::vector<DType> dtype_;
  std::vector<size_t> offset_;
  // operator new's alignment (16 bytes) covers float64.
  std::vector<uint8_t> bytes_;
};

class OuterLevelState {
 public:
  OuterLevelState(int level, OuterSgd rule);
  ~OuterLevelState();

  // CUDA parameters (NCCL): from now on the state lives in `device` (device_outer_state.h), which takes
  // over a host anchor and momentum this state holds (loaded from a state_dict, received at an
  // admission) and then frees them. has_anchor, has_momentum, CheckLayout, AnchorTensors,
  // MomentumTensors, Load and bytes then answer for the device state; SetAnchor,
  // PseudoGradient and Step (host tensors) fail. Errors: the upload's.
  absl::Status AttachDevice(std::unique_ptr<DeviceOuterState> device);
  DeviceOuterState* device() const { return device_.get(); }

  int level() const { return level_; }
  const OuterSgd& rule() const { return rule_; }
  // The level's rule keeps a momentum buffer (outer_rule.h: OuterRuleKeepsState).
  bool keeps_momentum() const { return OuterRuleKeepsState(OuterRuleParamsOf(rule_)); }
  // A plan update changed the level's optimizer (docs/plan-updates.md): the anchor and momentum
  // stay, and the next outer step uses `rule` (on the device state too, once attached).
  void set_rule(const OuterSgd& rule);
  // A plan update changed the level's payload: the error-feedback residual starts from zero
  // (the device state's too, once attached).
  void ClearResidual();
  bool has_anchor() const;
  // The momentum buffer holds a value (after the first outer step, with momentum > 0).
  bool has_momentum() const;

  // A := params (host tensors), M unset: the level's first averaging step, a plain average.
  absl::Status SetAnchor(absl::Span<const TensorView> params);

  // INVALID_ARGUMENT unless tensors [first, first + params.size()) of the anchor have the
  // state layout of `params` (element counts, dtypes).
  absl::Status CheckLayout(size_t first, absl::Span<const TensorView> params) const;

  // out[i] := A[first + i] - params[i], in the state dtype (`out` in the state layout, e.g. an
  // OuterBuffer shaped by the same params). Changes nothing of the state or the parameters.
  absl::Status PseudoGradient(size_t first, absl::Span<const TensorView> params,
                              absl::Span<const TensorView> out) const;

  // The level's rule (outer_rule.h; PyTorch's SGD: torch.optim.SGD, no weight decay, no
  // dampening) with `mean` (the group's mean pseudo-gradient D) as the gradient of A[first + i]:
  //   M := D if unset, else momentum * M + D;   d := D + momentum * M (nesterov) or M;
  //   A := A - lr * d;   params[i] := A (rounded to the parameters' dtype).
  // Without momentum, d := D and no buffer is kept.
  absl::Status Step(size_t first, absl::Span<const TensorView> mean,
                    absl::Span<const TensorView> params);

  // state_dict / load_state_dict (host copies; see AveragerState).
  std::vector<StateTensor> AnchorTensors() const;
  std::vector<StateTensor> MomentumTensors() const;
  // Sets the anchor and (`momentum` not null) the momentum buffer. INVALID_ARGUMENT when the
  // tensors do not fit each other (counts, dtypes float32/float64, byte sizes) or momentum is
  // given for a rule without momentum. The layout against the parameters is checked at the
  // next outer step.
  absl::Status Load(const std::vector<StateTensor>& anchor,
                    const std::vector<StateTensor>* momentum);

  // Bytes held (anchor + momentum + residual).
  size_t bytes() const;

  // Error feedback (Level.error_feedback, docs/streaming.md): the residual E, a float32 per
  // element of the state's tensors, zero until an outer step keeps one (the residual is a
  // member's own: a replacement starts at zero). AddResidual, NextResidual and SwapResidual
  // act on host states; on CUDA parameters DeviceOuterState keeps the residual with the same
  // rule, and has_residual, ResidualTensors and LoadResidual answer for it once attached
  // (AttachDevice uploads a residual loaded before).
  bool has_residual() const;
  // u[i] := fl32(beta * E[i] + u[i]) (u holds the pseudo-gradient D, float32, in the state
  // layout); nothing without a residual. INVALID_ARGUMENT when the residual's layout differs.
  absl::Status AddResidual(double beta, absl::Span<const TensorView> u) const;
  // The residual E := fl32(U - decode(encode(U))) that sending `u` (float32) in `payload`
  // leaves: decode(encode(U)) is exactly what the peers decode (client/payload/payload_codec.h).
  static OuterBuffer NextResidual(WireFormat format, absl::Span<const TensorView> u);
  // Swaps in `residual` (has_residual: `present`); returns the previous one and whether there
  // was one, to restore it if the round fails.
  std::pair<OuterBuffer, bool> SwapResidual(OuterBuffer residual, bool present);
  // state_dict / load_state_dict: the residual's tensors (empty without one), and setting them
  // (empty: none). INVALID_ARGUMENT unless they are float32 and match the anchor's counts.
  std::vector<StateTensor> ResidualTensors() const;
  absl::Status LoadResidual(const std::vector<StateTensor>& residual);

 private:
  const int level_;
  OuterSgd rule_;
  bool has_anchor_ = false;
  bool has_momentum_ = false;
  OuterBuffer anchor_;
  OuterBuffer momentum_;
  bool has_residual_ = false;
  OuterBuffer residual_;
  std::unique_ptr<DeviceOuterState> device_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_OUTER_STATE_H_
