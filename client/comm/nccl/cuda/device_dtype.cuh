// Elements of the staging dtypes (staging_chunk.h) read into and
// written from a compute type S on the device, for the CUDA kernels (staging, outer optimizer).
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_DEVICE_DTYPE_CUH_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_DEVICE_DTYPE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "client/payload/staging_chunk.h"

namespace modelavg::client {

template <typename S>
__device__ __forceinline__ S LoadAs(const void* p, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kStageF32:
      return static_cast<S>(static_cast<const float*>(p)[i]);
    case kStageF64:
      return static_cast<S>(static_cast<const double*>(p)[i]);
    case kStageF16:
      return static_cast<S>(__half2float(static_cast<const __half*>(p)[i]));
    default:
      return static_cast<S>(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
  }
}

template <typename S>
__device__ __forceinline__ void StoreFrom(void* p, int32_t dtype, int64_t i, S v) {
  switch (dtype) {
    case kStageF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case kStageF64:
      static_cast<double*>(p)[i] = static_cast<double>(v);
      break;
    case kStageF16:
      static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v));
      break;
    default:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      break;
  }
}

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_DEVICE_DTYPE_CUH_
