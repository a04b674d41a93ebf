// CUDA kernels of the outer optimizer on CUDA parameters (DiLoCo, device_outer_state.h): one launch per
// pass over a chunk table (staging_chunk.h), whatever the number of tensors. Only built with
// MODELAVG_HAVE_CUDA. Their arithmetic is the host's (the rule's step of outer_rule.h is the same
// code; the tests' simulated device restates it): every operation rounded on its own (no FMA),
// conversions round to nearest even.
#ifndef MODELAVG_CLIENT_OUTER_CUDA_OUTER_KERNELS_H_
#define MODELAVG_CLIENT_OUTER_CUDA_OUTER_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "client/outer/outer_rule.h"
#include "client/payload/staging_chunk.h"

namespace modelavg::client {

// gradient[o + i] = anchor[o + i] - S(tensor[i]) for every chunk (o its staging_offset), in the
// state dtype S of `state_code`. `chunks` is device memory. Returns the launch error.
cudaError_t LaunchOuterDifference(const StagingChunk* chunks, int64_t num_chunks,
                                  const void* anchor, void* gradient, int32_t state_code,
                                  cudaStream_t stream);
// tensor[i] = (1 - mix) * tensor[i] + mix * local[o + i] (streaming sync's Level.mix), in
// double, rounded once to the tensor's dtype; `local` in the state dtype of `state_code`.
cudaError_t LaunchOuterMix(const StagingChunk* chunks, int64_t num_chunks, const void* local,
                           int32_t state_code, double mix, cudaStream_t stream);
// The rule's step of `args` (outer_rule.h) on every chunk's state elements, then
// tensor[i] = anchor[o + i] rounded to the tensor's dtype.
cudaError_t LaunchOuterStep(const StagingChunk* chunks, int64_t num_chunks,
                            const OuterStepArgs& args, cudaStream_t stream);
// Error feedback (docs/streaming.md) on `n` float32 elements: u[i] = fl32(beta * e[i] + u[i]),
// the product and the sum in double (OuterLevelState::AddResidual's arithmetic).
cudaError_t LaunchFeedbackAdd(float* u, const float* e, int64_t n, double beta,
                              cudaStream_t stream);
// e[i] = u[i] - c[i] in float32 (OuterLevelState::NextResidual's, c = decode(encode(u))).
cudaError_t LaunchFeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                   cudaStream_t stream);
// A paced round's weighted copy of one tensor (round_weights.h): to[i] = scale * from[i] in
// double, rounded once to float64 or float32 (float16/bfloat16 from that float32, as the host's
// SetElementAt writes them), `n` elements of staging dtype `dtype_code`; in place allowed.
cudaError_t LaunchScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code,
                            double scale, cudaStream_t stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_CUDA_OUTER_KERNELS_H_
