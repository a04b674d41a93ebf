// The CUDA side of the finite check (client/comm/finite_check.h): a reduction kernel that finds
// the smallest finding code of a non-finite element in the caller's tensors, and the kernel that
// writes a member's slots from it. Only built with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_FINITE_KERNELS_H_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_FINITE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "client/payload/staging_chunk.h"

namespace modelavg::client {

// For every chunk (device memory, `num_chunks` entries), the code tensor_index * 4 + value
// (1 NaN, 2 +Inf, 3 -Inf; tensor indices from (1 << 20) - 1 on coded as it) of each non-finite
// element, min-reduced into the int32 at `code` (device memory; unchanged where all are finite),
// on `stream`. One block per chunk; each block reduces in shared memory and makes one atomic.
cudaError_t LaunchCheckFinite(const StagingChunk* chunks, int64_t num_chunks, int32_t* code,
                              cudaStream_t stream);
// The `members` slots at `slots` (staging dtype `staging_dtype`; three base-256 digits a member
// in float16, one element otherwise): *code (INT32_MAX: none, written as 0) at `member`, zeros
// elsewhere; then *code := INT32_MAX. One block, on `stream`.
cudaError_t LaunchWriteFiniteSlots(int32_t* code, void* slots, int members, int member,
                                   int32_t staging_dtype, cudaStream_t stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_FINITE_KERNELS_H_
