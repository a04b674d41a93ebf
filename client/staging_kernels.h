// Fused CUDA kernels that gather many parameter tensors into one flat staging buffer and scatter
// it back, converting dtypes on the way — one launch each, whatever the number of tensors.
// Only built with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_STAGING_KERNELS_H_
#define MODELAVG_CLIENT_STAGING_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace modelavg::client {

// dtype codes shared with the kernels (same order as DType).
enum StagingDTypeCode : int32_t { kStageF32 = 0, kStageF64 = 1, kStageF16 = 2, kStageBF16 = 3 };

// One piece of work: `numel` elements of tensor memory at `tensor` (dtype `tensor_dtype`)
// that sit at element `staging_offset` of the staging buffer. Large tensors are split into
// several chunks so that blocks get even work.
struct StagingChunk {
  void* tensor;
  int64_t staging_offset;
  int64_t numel;
  int32_t tensor_dtype;
  int32_t pad;
};

// Elements per chunk (a block's work).
inline constexpr int64_t kStagingChunkElems = 1 << 16;

// staging[offset + i] = convert(tensor[i]) for every chunk, on `stream`. `chunks` is device
// memory holding `num_chunks` entries. Returns the launch error.
cudaError_t LaunchGather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                         int32_t staging_dtype, cudaStream_t stream);
// tensor[i] = convert(staging[offset + i]) for every chunk, on `stream`.
cudaError_t LaunchScatter(const StagingChunk* chunks, int64_t num_chunks, const void* staging,
                          int32_t staging_dtype, cudaStream_t stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_STAGING_KERNELS_H_
