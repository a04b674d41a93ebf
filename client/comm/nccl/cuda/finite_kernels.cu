#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

#include "client/comm/nccl/cuda/device_dtype.cuh"
#include "client/comm/nccl/cuda/finite_kernels.h"

namespace modelavg::client {
namespace {

constexpr int kThreads = 256;
constexpr int32_t kMaxCodedTensor = (1 << 20) - 1;  // finite_scan.h

// 0 for a finite element; else 1 NaN, 2 +Inf, 3 -Inf (finite_scan.h's NonFiniteValue).
__device__ __forceinline__ int32_t ValueCode(double x) {
  if (isnan(x)) return 1;
  if (isinf(x)) return x > 0 ? 2 : 3;
  return 0;
}

// Whether the element's exponent bits are all set: the fast test, on the raw bits.
__device__ __forceinline__ bool NonFiniteBits(const void* p, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kStageF32:
      return (static_cast<const uint32_t*>(p)[i] & 0x7f800000u) == 0x7f800000u;
    case kStageF64:
      return (static_cast<const unsigned long long*>(p)[i] & 0x7ff0000000000000ull) ==
             0x7ff0000000000000ull;
    case kStageF16:
      return (static_cast<const uint16_t*>(p)[i] & 0x7c00u) == 0x7c00u;
    default:
      return (static_cast<const uint16_t*>(p)[i] & 0x7f80u) == 0x7f80u;
  }
}

// One block per chunk (grid-stride over chunks): each thread tests its elements and keeps the
// smallest code it found; the block reduces them in shared memory and the first thread makes
// one atomicMin into *code.
__global__ void CheckFiniteKernel(const StagingChunk* chunks, int64_t num_chunks,
                                  int32_t* code) {
  __shared__ int32_t best[kThreads];
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const StagingChunk ch = chunks[c];
    const int32_t tensor = min(ch.tensor_index, kMaxCodedTensor);
    int32_t mine = INT_MAX;
    for (int64_t i = threadIdx.x; i < ch.numel; i += blockDim.x) {
      if (NonFiniteBits(ch.tensor, ch.tensor_dtype, i)) {
        const int32_t v = ValueCode(LoadAs<double>(ch.tensor, ch.tensor_dtype, i));
        mine = min(mine, tensor * 4 + (v == 0 ? 1 : v));
      }
    }
    best[threadIdx.x] = mine;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
      if (threadIdx.x < stride) best[threadIdx.x] = min(best[threadIdx.x], best[threadIdx.x + stride]);
      __syncthreads();
    }
    if (threadIdx.x == 0 && best[0] != INT_MAX) atomicMin(code, best[0]);
    __syncthreads();  // best[] is reused by the block's next chunk
  }
}

__global__ void WriteFiniteSlotsKernel(int32_t* code, void* slots, int members, int member,
                                       int32_t dtype) {
  const int width = dtype == kStageF16 ? 3 : 1;
  const int32_t mine = *code == INT_MAX ? 0 : *code;
  for (int64_t s = threadIdx.x; s < static_cast<int64_t>(members) * width; s += blockDim.x) {
    const int m = static_cast<int>(s / width);
    const int d = static_cast<int>(s % width);  // 0: the most significant digit
    int32_t digit = 0;
    if (m == member) {
      digit = width == 1 ? mine : (mine >> (8 * (width - 1 - d))) & 0xff;
    }
    StoreFrom<double>(slots, dtype, s, static_cast<double>(digit));
  }
  __syncthreads();
  if (threadIdx.x == 0) *code = INT_MAX;
}

}  // namespace

cudaError_t LaunchCheckFinite(const StagingChunk* chunks, int64_t num_chunks, int32_t* code,
                              cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_chunks, 65535));
  CheckFiniteKernel<<<grid, kThreads, 0, stream>>>(chunks, num_chunks, code);
  return cudaGetLastError();
}

cudaError_t LaunchWriteFiniteSlots(int32_t* code, void* slots, int members, int member,
                                   int32_t staging_dtype, cudaStream_t stream) {
  WriteFiniteSlotsKernel<<<1, kThreads, 0, stream>>>(code, slots, members, member,
                                                     staging_dtype);
  return cudaGetLastError();
}

}  // namespace modelavg::client
