// The outer optimizer's state of one level on CUDA parameters (DiLoCo on the NCCL path,
// docs/diloco.md): the device counterpart of OuterLevelState (outer_state.h), whose rule and
// arithmetic it follows exactly. The host logic only: every device operation goes through
// DeviceOps (memory, copies, staging, the payload codec: CudaLocalOps on a GPU) and the outer
// optimizer's passes through OuterKernels (outer_kernels.h: cuda/cuda_outer_device.h on a
// GPU); the unit tests supply a simulated device for both.
//
// Memory: the anchor A and, with momentum, the momentum M, each one buffer of the state dtype
// (float32 for float32/float16/bfloat16 parameters, float64 for float64 ones), and with error
// feedback the residual E (float32), on the parameters' device, or, with `pinned_host`
// (AveragerOptions::backup_device), in pinned host memory that the kernels read and write over
// the bus. The pseudo-gradient D is a device buffer
// of the same layout (the caller's, shared by the levels); its tensors lie back to back in one
// dtype, so NCCL reduces it in place (no staging copy): the difference pass is the gather and
// the step pass the scatter of a staged average, with the optimizer fused into them.
//
// An outer step is RunDeviceOuterStep below: D := A - x (one kernel); the round all-reduces D
// (the caller's: strict or elastic, committed, retried, adopted); SGD on A and x := A (one
// kernel). The state and the parameters change only in the last pass, after the round.
#ifndef MODELAVG_CLIENT_OUTER_DEVICE_OUTER_STATE_H_
#define MODELAVG_CLIENT_OUTER_DEVICE_OUTER_STATE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/comm/nccl/device_ops.h"
#include "client/outer/outer_kernels.h"
#include "client/payload/payload_codec.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// A device buffer that frees itself with the operations it was allocated with.
class OwnedDeviceBuffer {
 public:
  // `pinned_host`: pinned host memory (GrowableBuffer's).
  explicit OwnedDeviceBuffer(DeviceOps* ops, bool pinned_host = false)
      : ops_(ops), buffer_(pinned_host) {}
  ~OwnedDeviceBuffer() { buffer_.Release(*ops_); }
  OwnedDeviceBuffer(const OwnedDeviceBuffer&) = delete;
  OwnedDeviceBuffer& operator=(const OwnedDeviceBuffer&) = delete;
  GrowableBuffer* get() { return &buffer_; }
  const GrowableBuffer& buffer() const { return buffer_; }

 private:
  DeviceOps* const ops_;
  GrowableBuffer buffer_;
};

class DeviceOuterState {
 public:
  // `ops` and `kernels` outlive the state. `level`: for messages.
  DeviceOuterState(DeviceOps* ops, OuterKernels* kernels, int level, OuterSgd rule,
                   bool pinned_host);
  ~DeviceOuterState();  // frees its buffers
  DeviceOuterState(const DeviceOuterState&) = delete;
  DeviceOuterState& operator=(const DeviceOuterState&) = delete;

  const OuterSgd& rule() const { return rule_; }
  void set_rule(const OuterSgd& rule) { rule_ = rule; }
  bool pinned_host() const { return pinned_host_; }
  bool has_anchor() const { return has_anchor_; }
  bool has_momentum() const { return has_momentum_; }

  // INVALID_ARGUMENT unless `params` (CUDA parameters, or views in the state layout) have the
  // anchor's layout (element counts, state dtypes); FAILED_PRECONDITION without an anchor.
  absl::Status CheckLayout(absl::Span<const TensorView> params) const;

  // A := params, M unset (the level's first averaging step, after its plain average). Waits.
  // UNIMPLEMENTED for parameters that mix float64 with other dtypes (one state dtype on CUDA).
  absl::Status SetAnchor(absl::Span<const TensorView> params);
  // Shapes `gradient` (device memory, grown as needed) for `params` and returns D's views: CUDA
  // tensors on the parameters' device and stream, back to back in the state dtype.
  absl::StatusOr<std::vector<TensorView>> GradientViews(absl::Span<const TensorView> params,
                                                        GrowableBuffer* gradient);
  // D := A - params into `gradient` (shaped by GradientViews), enqueued on the parameters'
  // stream (no wait: the round that follows orders after it). Changes nothing of the state.
  absl::Status PseudoGradient(absl::Span<const TensorView> params, const GrowableBuffer& gradient);
  // PyTorch's SGD with `gradient` (the group's mean D) on A, then params := A. Waits.
  absl::Status Step(absl::Span<const TensorView> params, const GrowableBuffer& gradient);

  // Streaming sync (docs/streaming.md), where one state covers one fragment's tensors:
  // Snapshot: `local` (grown as needed) := params in the state dtype (x_local of a mix, or the
  // parameters a background first sync averages). Waits, so that the parameters may change
  // once it returns. Needs no anchor.
  absl::Status Snapshot(absl::Span<const TensorView> params, GrowableBuffer* local);
  // params := (1 - mix) * params + mix * local (local: Snapshot's of the same params). Waits.
  absl::Status Mix(absl::Span<const TensorView> params, const GrowableBuffer& local, double mix);
  // A := mean (a buffer in the state layout of `params`: a background first sync's result), M
  // unset, then params := A. Waits.
  absl::Status SetAnchorFrom(absl::Span<const TensorView> params, const GrowableBuffer& mean);

  // Host copies (state_dict, the admission hand-over), in the state dtype; waits.
  absl::StatusOr<std::vector<StateTensor>> AnchorTensors() const;
  absl::StatusOr<std::vector<StateTensor>> MomentumTensors() const;
  // Sets A (and M, `momentum` not null) from host tensors (one state dtype: float32 or float64,
  // counts and byte sizes matching). Nothing changes on an error. Waits.
  absl::Status Load(const std::vector<StateTensor>& anchor,
                    const std::vector<StateTensor>* momentum);

  // Error feedback (Level.error_feedback, docs/streaming.md): the residual E, a float32 per
  // element of the state's tensors, on the device (pinned host memory with `pinned_host`), none
  // until an outer step keeps one (a member's own: a replacement starts at zero). The host
  // rule exactly (OuterLevelState::AddResidual, NextResidual, SwapResidual); float32 states only
  // (a compressed payload takes no float64).
  bool has_residual() const { return residual_ != nullptr; }
  // U := fl32(beta * E + D) in place in `gradient` (D, shaped by GradientViews for the anchor's
  // parameters), enqueued on the last parameters' stream; nothing without a residual.
  // INVALID_ARGUMENT when the residual's size is not the state's.
  absl::Status AddResidual(double beta, const GrowableBuffer& gradient);
  // The residual E' := U - decode(encode(U)) that sending `gradient` (U) in `format` leaves:
  // the whole buffer encoded and decoded as one part into scratch buffers (blocks of 1024 of
  // the whole buffer, as the compressed round cuts its parts at block boundaries: exactly what
  // the peers decode). Waits. Changes nothing of the state.
  absl::StatusOr<std::unique_ptr<OwnedDeviceBuffer>> NextResidual(WireFormat format,
                                                                   const GrowableBuffer& gradient);
  // Swaps in `residual` (null: none); returns the previous one, to restore if the round fails.
  std::unique_ptr<OwnedDeviceBuffer> SwapResidual(std::unique_ptr<OwnedDeviceBuffer> residual);
  // A plan update changed the level's payload: the residual starts from zero.
  void ClearResidual() { residual_.reset(); }
  // state_dict: the residual's tensors in the anchor's layout (float32; empty without one).
  absl::StatusOr<std::vector<StateTensor>> ResidualTensors() const;
  // load_state_dict: sets the residual (empty: none). INVALID_ARGUMENT unless the tensors are
  // float32 with the anchor's counts; FAILED_PRECONDITION without an anchor. Nothing changes
  // on an error. Waits.
  absl::Status LoadResidual(const std::vector<StateTensor>& residual);

  // Bytes held (anchor + momentum + residual), wherever they are.
  size_t bytes() const;

 private:
  // The layout of `params` (state dtype of every tensor; UNIMPLEMENTED when they differ).
  absl::Status Shape(absl::Span<const TensorView> params, int32_t* code) const;
  // Makes the device chunk table that of `params` (pad-free staging layout in the state dtype).
  absl::Status UseTable(absl::Span<const TensorView> params, int32_t code, void* stream);
  // After the anchor was written for `params`: remembers their layout, the dtype and stream.
  void AnchorSetFor(absl::Span<const TensorView> params, int32_t code, void* stream);
  absl::Status Download(const GrowableBuffer& from, std::vector<StateTensor>* out) const;
  // Bytes of one state buffer (A or M).
  size_t bytes_per_buffer() const;
  // Elements of the state's tensors.
  int64_t elems() const;

  DeviceOps* const ops_;
  OuterKernels* const kernels_;
  const int level_;
  OuterSgd rule_;
  const bool pinned_host_;
  bool has_anchor_ = false;
  bool has_momentum_ = false;
  // The state layout: element counts, one state code.
  std::vector<int64_t> numel_;
  int32_t code_ = kStageF32;
  GrowableBuffer anchor_;
  GrowableBuffer momentum_;
  // Error feedback's residual (null: none) and NextResidual's scratch (the encoding, the
  // decoded values).
  std::unique_ptr<OwnedDeviceBuffer> residual_;
  GrowableBuffer feedback_wire_;
  GrowableBuffer feedback_decoded_;
  GrowableBuffer chunks_device_;
  std::vector<StagingChunk> chunks_host_;
  // The stream of the last call with parameters (state_dict copies run on it).
  void* stream_ = nullptr;
};

// Error feedback on a device outer step (Level.error_feedback, docs/streaming.md): beta 0 is
// none; `format` is the pseudo-gradient's payload.
struct DeviceFeedback {
  double beta = 0;
  WireFormat format;
};

// One averaging step of an outer level on CUDA parameters, as ModelAverager takes it (and the
// tests, with the simulated device): `first_step` is the level's first averaging step (a plain
// average of the parameters, after which A := x); `joining`: this member is admitted at this step
// and contributes no pseudo-gradient (it receives the level's state within `round`, from its
// donor, then steps). Otherwise D := A - x, `round` all-reduces D, and the SGD step writes A into
// the parameters. `round` averages the tensors it is given in place (OK: they hold the average),
// mixing `layout_signature` into the layout agreement (RoundOptions::layout_signature): 0 for the
// parameters, kOuterRoundSignature for the pseudo-gradient's buffer, whose layout differs from
// the parameters' that the level's first round averaged on the same communicator (every member
// takes the same steps, so all agree on it afresh alike).
// A state without an anchor outside the first step is FAILED_PRECONDITION (the caller says why).
// With `feedback` (an outer step of a contributing member): U := beta E + D is what the round
// sends, and once it has succeeded E := U - decode(encode(U)); a failed round leaves E as it was.
absl::Status RunDeviceOuterStep(
    DeviceOuterState* state, GrowableBuffer* gradient, absl::Span<const TensorView> params,
    bool first_step, bool joining,
    const std::function<absl::Status(absl::Span<const TensorView>, int64_t layout_signature)>&
        round,
    const DeviceFeedback& feedback = {});

inline constexpr int64_t kOuterRoundSignature = 0x6f75746572;  // "outer"

// One sync of a fragment of a streaming outer level with sync_delay 0 on CUDA parameters
// (docs/streaming.md): `state` is the fragment's (its own anchor and momentum), `params` the
// fragment's tensors. RunDeviceOuterStep (the first sync a plain FP32 average, later D := A - x,
// `round` of D, SGD), then, with `mix` != 0, params := (1 - mix) A' + mix x_local, x_local the
// parameters passed (kept in `local`; a replacement's, the block's mean it received in the
// round). The pseudo-gradient's round (layout_signature kOuterRoundSignature) is where the
// caller applies the level's payload. Parameters and state change only after the round.
absl::Status RunDeviceStreamingStep(
    DeviceOuterState* state, GrowableBuffer* gradient, GrowableBuffer* local,
    absl::Span<const TensorView> params, bool first_step, bool joining, double mix,
    const std::function<absl::Status(absl::Span<const TensorView>, int64_t layout_signature)>&
        round,
    const DeviceFeedback& feedback = {});

// A fragment's sync with sync_delay > 0 on CUDA parameters, between the call at its sync step s
// (Fill) and the call at s + sync_delay (Apply): its own device buffer (the fragment's
// parameters at s for its first sync, else D := A - x at s, in the state dtype) and its own
// stream, on which the background all-reduce of that buffer runs. Fill waits for the buffer, so
// the parameters may change once it returns; nothing of the parameters or the state changes
// until Apply, which is called on the averaging thread only.
class DevicePendingSync {
 public:
  // `ops` and `state` outlive it.
  DevicePendingSync(DeviceOps* ops, DeviceOuterState* state, bool first);
  ~DevicePendingSync();  // frees the buffer and the stream (after its round has ended)
  DevicePendingSync(const DevicePendingSync&) = delete;
  DevicePendingSync& operator=(const DevicePendingSync&) = delete;

  bool first() const { return first_; }
  // Fills the buffer from the fragment's `params` and returns its views, on the sync's own
  // stream: what the background round averages in place. FAILED_PRECONDITION without an
  // anchor (not first), INVALID_ARGUMENT for another layout than the anchor's. With `feedback`
  // (not first), the buffer holds U = beta E + D and `*next_residual` the residual
  // U - decode(encode(U)) the round leaves (the caller swaps it into the state).
  absl::StatusOr<std::vector<TensorView>> Fill(
      absl::Span<const TensorView> params, const DeviceFeedback& feedback = {},
      std::unique_ptr<OwnedDeviceBuffer>* next_residual = nullptr);
  // Once the round has succeeded: A := the mean (first) or PyTorch's SGD with the mean D, then
  // params := (1 - mix) A' + mix x_local, x_local the `params` passed now (kept in `local`).
  absl::Status Apply(absl::Span<const TensorView> params, double mix, GrowableBuffer* local);
  // The round's result, host copies in the state dtype (state_dict); waits.
  absl::StatusOr<std::vector<StateTensor>> ResultTensors() const;
  // A sync restored by load_state_dict (its round done, its result on the host, in the state
  // dtype): uploads `result` as the round's result for the fragment's `params`. Waits.
  // INVALID_ARGUMENT when the result does not fit the parameters.
  absl::Status LoadResult(absl::Span<const TensorView> params,
                          absl::Span<const TensorView> result);

 private:
  DeviceOps* const ops_;
  DeviceOuterState* const state_;
  const bool first_;
  GrowableBuffer buffer_;
  std::vector<int64_t> numel_;
  bool f64_ = false;
  void* stream_ = nullptr;
  bool stream_made_ = false;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_DEVICE_OUTER_STATE_H_
