// The outer optimizer's passes on a device (DeviceOuterState, device_outer_state.h), as an
// interface: CudaOuterKernels (cuda/cuda_outer_device.h) launches the CUDA kernels
// (cuda/outer_kernels.cu), the unit tests supply a simulated device. Every pass is enqueued on
// `stream` (a cudaStream_t). In `chunks` (device memory, staging_chunk.h), staging_offset is
// the element's offset in the state buffers, all of `state_code` (kStageF32 or kStageF64).
#ifndef MODELAVG_CLIENT_OUTER_OUTER_KERNELS_H_
#define MODELAVG_CLIENT_OUTER_OUTER_KERNELS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "client/outer/outer_rule.h"
#include "client/payload/staging_chunk.h"

namespace modelavg::client {

class OuterKernels {
 public:
  virtual ~OuterKernels() = default;
  // gradient[o + i] := anchor[o + i] - tensor[i], in the state dtype.
  virtual absl::Status OuterDifference(const StagingChunk* chunks, int64_t num_chunks,
                                       const void* anchor, void* gradient, int32_t state_code,
                                       void* stream) = 0;
  // The rule's step of `args` (outer_rule.h) on every state element, then
  // tensor[i] := anchor[o + i].
  virtual absl::Status OuterStep(const StagingChunk* chunks, int64_t num_chunks,
                                 const OuterStepArgs& args, void* stream) = 0;
  // Streaming sync's mix (Level.mix): tensor[i] := (1 - mix) * tensor[i] + mix * local[o + i]
  // in double, rounded once to the tensor's dtype; `local` in the state dtype `state_code`.
  virtual absl::Status OuterMix(const StagingChunk* chunks, int64_t num_chunks,
                                const void* local, int32_t state_code, double mix,
                                void* stream) = 0;
  // Error feedback (Level.error_feedback, docs/streaming.md) on `n` float32 elements, with the
  // host's arithmetic (OuterLevelState::AddResidual, NextResidual).
  // FeedbackAdd: u[i] := fl32(beta * e[i] + u[i]), the product and the sum in double.
  virtual absl::Status FeedbackAdd(float* u, const float* e, int64_t n, double beta,
                                   void* stream) = 0;
  // FeedbackResidual: e[i] := u[i] - c[i] in float32 (c: decode(encode(u))).
  virtual absl::Status FeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                        void* stream) = 0;
  // A paced round's weighted copy (client/averaging/round_weights.h) of one tensor of `n`
  // elements of staging dtype `dtype_code`: to[i] := fl(scale * from[i]), the product in double,
  // rounded once to float64 or float32, float16/bfloat16 from that float32 (the host's
  // ScaleInto, SetElementAt). `from` and `to` may be the same.
  virtual absl::Status ScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code,
                                 double scale, void* stream) = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_OUTER_KERNELS_H_
