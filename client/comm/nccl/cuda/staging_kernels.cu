#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "client/comm/nccl/cuda/device_dtype.cuh"
#include "client/comm/nccl/cuda/staging_kernels.h"

namespace modelavg::client {
namespace {

__device__ __forceinline__ int ElemSize(int32_t dtype) {
  return dtype == kStageF64 ? 8 : (dtype == kStageF32 ? 4 : 2);
}

// Copies n elements of equal dtype; 16-byte vectors when both ends are aligned.
__device__ __forceinline__ void CopySame(char* dst, const char* src, int64_t bytes) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) &
                        15) == 0;
  int64_t done = 0;
  if (aligned) {
    const int64_t vecs = bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) d[v] = s[v];
    done = vecs * 16;
  }
  for (int64_t b = done + threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
}

// One block per chunk (grid-stride over chunks). gather: tensor -> staging; else staging ->
// tensor.
template <bool kGather>
__global__ void StagingKernel(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                              int32_t staging_dtype) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const StagingChunk ch = chunks[c];
    char* stage = static_cast<char*>(staging) + ch.staging_offset * ElemSize(staging_dtype);
    if (ch.tensor_dtype == staging_dtype) {
      const int64_t bytes = ch.numel * ElemSize(staging_dtype);
      if (kGather) {
        CopySame(stage, static_cast<const char*>(ch.tensor), bytes);
      } else {
        CopySame(static_cast<char*>(ch.tensor), stage, bytes);
      }
      continue;
    }
    for (int64_t i = threadIdx.x; i < ch.numel; i += blockDim.x) {
      if (kGather) {
        StoreFrom<double>(stage, staging_dtype, i,
                          LoadAs<double>(ch.tensor, ch.tensor_dtype, i));
      } else {
        StoreFrom<double>(ch.tensor, ch.tensor_dtype, i,
                          LoadAs<double>(stage, staging_dtype, i));
      }
    }
  }
}

constexpr int kThreads = 512;

unsigned Grid(int64_t num_chunks) {
  return static_cast<unsigned>(std::min<int64_t>(num_chunks, 65535));
}

}  // namespace

cudaError_t LaunchGather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                         int32_t staging_dtype, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  StagingKernel<true><<<Grid(num_chunks), kThreads, 0, stream>>>(chunks, num_chunks, staging,
                                                                 staging_dtype);
  return cudaGetLastError();
}

cudaError_t LaunchScatter(const StagingChunk* chunks, int64_t num_chunks, const void* staging,
                          int32_t staging_dtype, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  StagingKernel<false><<<Grid(num_chunks), kThreads, 0, stream>>>(
      chunks, num_chunks, const_cast<void*>(staging), staging_dtype);
  return cudaGetLastError();
}

}  // namespace modelavg::client
