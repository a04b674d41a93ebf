#include "client/comm/nccl/cuda/payload_kernels.h"

#include <algorithm>
#include <cstdint>


namespace modelavg::client {
namespace {

constexpr int kThreads = 256;

// half.h's conversions, on the device: round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t ToBFloat16(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float FromBFloat16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ int64_t Int8Blocks(int64_t n) {
  return (n + kWireInt8Block - 1) / kWireInt8Block;
}

// Element i of part j (zero past numel).
__device__ __forceinline__ float Input(const float* in, int64_t numel, int64_t part, int64_t j,
                                       int64_t i) {
  const int64_t e = j * part + i;
  return e < numel ? in[e] : 0.0f;
}

// Element i of wire part `p` decoded (p: the part's first byte).
__device__ __forceinline__ float Decoded(int32_t payload, const uint8_t* p, int64_t part,
                                         int64_t i) {
  if (payload == kWireBf16) return FromBFloat16(reinterpret_cast<const uint16_t*>(p)[i]);
  if (payload == kWireInt8) {
    const float scale = reinterpret_cast<const float*>(p)[i / kWireInt8Block];
    const int8_t q = reinterpret_cast<const int8_t*>(p + Int8Blocks(part) * 4)[i];
    return __fmul_rn(static_cast<float>(q), scale);
  }
  return reinterpret_cast<const float*>(p)[i];
}

// The element-wise encodings: FP32 as it is, BF16 rounded (ToBFloat16).
template <typename Wire>
__device__ __forceinline__ Wire Encoded(float x);
template <>
__device__ __forceinline__ float Encoded<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ uint16_t Encoded<uint16_t>(float x) {
  return ToBFloat16(x);
}

// Every element of every part, each into its Wire element (float: FP32, uint16_t: BF16).
template <typename Wire>
__global__ void EncodeElementwiseKernel(const float* in, int64_t numel, int64_t part, int parts,
                                        size_t stride, uint8_t* wire) {
  const int64_t total = part * parts;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = k / part, i = k % part;
    reinterpret_cast<Wire*>(wire + j * stride)[i] = Encoded<Wire>(Input(in, numel, part, j, i));
  }
}

// One CUDA block per INT8 block (of one part): its largest |x|, its scale, its values.
__global__ void EncodeInt8Kernel(const float* in, int64_t numel, int64_t part,
                                 int64_t blocks_per_part, size_t stride, uint8_t* wire) {
  __shared__ float max_abs[kThreads];
  __shared__ int finite[kThreads];
  const int64_t j = blockIdx.x / blocks_per_part;
  const int64_t b = blockIdx.x % blocks_per_part;
  const int64_t lo = b * kWireInt8Block;
  const int64_t hi = min(part, lo + kWireInt8Block);
  float m = 0.0f;
  int ok = 1;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float x = Input(in, numel, part, j, i);
    ok &= isfinite(x) ? 1 : 0;
    m = fmaxf(m, fabsf(x));
  }
  max_abs[threadIdx.x] = m;
  finite[threadIdx.x] = ok;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      max_abs[threadIdx.x] = fmaxf(max_abs[threadIdx.x], max_abs[threadIdx.x + w]);
      finite[threadIdx.x] &= finite[threadIdx.x + w];
    }
    __syncthreads();
  }
  uint8_t* p = wire + j * stride;
  float scale = __fdiv_rn(max_abs[0], 127.0f);
  if (!finite[0]) scale = __int_as_float(0x7fc00000);  // NaN: the block decodes as NaN
  if (threadIdx.x == 0) reinterpret_cast<float*>(p)[b] = scale;
  int8_t* q = reinterpret_cast<int8_t*>(p + blocks_per_part * 4);
  const bool zero = !(scale > 0.0f);
  const float inv = zero ? 0.0f : __fdiv_rn(1.0f, scale);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    if (zero) {
      q[i] = 0;
      continue;
    }
    float v = rintf(__fmul_rn(Input(in, numel, part, j, i), inv));
    v = fminf(127.0f, fmaxf(-127.0f, v));
    q[i] = static_cast<int8_t>(v);
  }
}

__global__ void DecodeSumKernel(int32_t payload, const uint8_t* wire, int parts, int64_t part,
                                size_t stride, float scale, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < part;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < parts; ++j) acc = __fadd_rn(acc, Decoded(payload, wire + j * stride, part, i));
    out[i] = __fmul_rn(acc, scale);
  }
}

__global__ void DecodeKernel(int32_t payload, const uint8_t* wire, int64_t numel, int64_t part,
                             size_t stride, float* out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < numel;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / part, i = e % part;
    out[e] = Decoded(payload, wire + j * stride, part, i);
  }
}

unsigned Grid(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

}  // namespace

cudaError_t LaunchEncodeParts(int32_t payload, const float* in, int64_t numel, int64_t part,
                              int parts, size_t stride, void* wire, cudaStream_t stream) {
  if (part <= 0 || parts <= 0) return cudaSuccess;
  // The bytes past each part's encoding: zeros, so that the wire is the same on every run.
  cudaError_t e = cudaMemsetAsync(wire, 0, stride * parts, stream);
  if (e != cudaSuccess) return e;
  uint8_t* w = static_cast<uint8_t*>(wire);
  switch (payload) {
    case kWireBf16:
      EncodeElementwiseKernel<uint16_t><<<Grid(part * parts), kThreads, 0, stream>>>(
          in, numel, part, parts, stride, w);
      break;
    case kWireInt8: {
      const int64_t blocks = (part + kWireInt8Block - 1) / kWireInt8Block;
      EncodeInt8Kernel<<<static_cast<unsigned>(blocks * parts), kThreads, 0, stream>>>(
          in, numel, part, blocks, stride, w);
      break;
    }
    default:
      EncodeElementwiseKernel<float><<<Grid(part * parts), kThreads, 0, stream>>>(
          in, numel, part, parts, stride, w);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDecodeSumParts(int32_t payload, const void* wire, int parts, int64_t part,
                                 size_t stride, float scale, float* out, cudaStream_t stream) {
  if (part <= 0) return cudaSuccess;
  DecodeSumKernel<<<Grid(part), kThreads, 0, stream>>>(
      payload, static_cast<const uint8_t*>(wire), parts, part, stride, scale, out);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeParts(int32_t payload, const void* wire, int64_t numel, int64_t part,
                              size_t stride, float* out, cudaStream_t stream) {
  if (numel <= 0 || part <= 0) return cudaSuccess;
  DecodeKernel<<<Grid(numel), kThreads, 0, stream>>>(payload, static_cast<const uint8_t*>(wire),
                                                     numel, part, stride, out);
  return cudaGetLastError();
}

}  // namespace modelavg::client
