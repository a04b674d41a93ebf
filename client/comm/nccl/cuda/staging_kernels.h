// Fused CUDA kernels that gather many parameter tensors into one flat staging buffer and scatter
// it back, converting dtypes on the way — one launch each, whatever the number of tensors.
// Only built with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_STAGING_KERNELS_H_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_STAGING_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "client/payload/staging_chunk.h"

namespace modelavg::client {

// staging[offset + i] = convert(tensor[i]) for every chunk, on `stream`. `chunks` is device
// memory holding `num_chunks` entries. Returns the launch error.
cudaError_t LaunchGather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                         int32_t staging_dtype, cudaStream_t stream);
// tensor[i] = convert(staging[offset + i]) for every chunk, on `stream`.
cudaError_t LaunchScatter(const StagingChunk* chunks, int64_t num_chunks, const void* staging,
                          int32_t staging_dtype, cudaStream_t stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_STAGING_KERNELS_H_
