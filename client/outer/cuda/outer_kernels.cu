#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "client/comm/nccl/cuda/device_dtype.cuh"
#include "client/outer/cuda/outer_kernels.h"
#include "client/outer/outer_rule.h"

namespace modelavg::client {
namespace {

// Each operation rounded on its own (outer_math.h).
template <typename S>
__device__ __forceinline__ S Sub(S a, S b) { return OuterMath::Sub(a, b); }
__device__ __forceinline__ double Add(double a, double b) { return OuterMath::Add(a, b); }
__device__ __forceinline__ double Mul(double a, double b) { return OuterMath::Mul(a, b); }

// One block per chunk (grid-stride over chunks), threads over its elements.
template <typename S>
__global__ void DifferenceKernel(const StagingChunk* chunks, int64_t num_chunks,
                                 const S* anchor, S* gradient) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const StagingChunk ch = chunks[c];
    const S* a = anchor + ch.staging_offset;
    S* d = gradient + ch.staging_offset;
    for (int64_t i = threadIdx.x; i < ch.numel; i += blockDim.x) {
      d[i] = Sub(a[i], LoadAs<S>(ch.tensor, ch.tensor_dtype, i));
    }
  }
}

// The rule's step (outer_rule.h), element by element, then the parameter element := A.
template <typename S>
__global__ void StepKernel(const StagingChunk* chunks, int64_t num_chunks, const S* gradient,
                           S* anchor, S* momentum, OuterRuleParams rule, bool momentum_set) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const StagingChunk ch = chunks[c];
    const S* d = gradient + ch.staging_offset;
    S* a = anchor + ch.staging_offset;
    S* m = momentum == nullptr ? nullptr : momentum + ch.staging_offset;
    for (int64_t i = threadIdx.x; i < ch.numel; i += blockDim.x) {
      OuterRuleStep(rule, momentum_set, d[i], m == nullptr ? nullptr : m + i, a + i);
      StoreFrom<S>(ch.tensor, ch.tensor_dtype, i, a[i]);
    }
  }
}

// tensor[i] := (1 - mix) * tensor[i] + mix * local[o + i], in double, rounded once to the
// tensor's dtype (the host's LocalCopy::MixInto).
template <typename S>
__global__ void MixKernel(const StagingChunk* chunks, int64_t num_chunks, const S* local,
                          double keep, double mix) {
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const StagingChunk ch = chunks[c];
    const S* l = local + ch.staging_offset;
    for (int64_t i = threadIdx.x; i < ch.numel; i += blockDim.x) {
      const double x = LoadAs<double>(ch.tensor, ch.tensor_dtype, i);
      const double v = Add(Mul(keep, x), Mul(mix, static_cast<double>(l[i])));
      if (ch.tensor_dtype == kStageF64) {
        static_cast<double*>(ch.tensor)[i] = v;
      } else {
        // Through float32, as the host writes float16/bfloat16 from a float.
        StoreFrom<float>(ch.tensor, ch.tensor_dtype, i, static_cast<float>(v));
      }
    }
  }
}

constexpr int kThreads = 512;

__global__ void FeedbackAddKernel(float* u, const float* e, int64_t n, double beta) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    u[i] = __double2float_rn(Add(Mul(beta, static_cast<double>(e[i])), static_cast<double>(u[i])));
  }
}

__global__ void FeedbackResidualKernel(const float* u, const float* c, int64_t n, float* e) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    e[i] = Sub<float>(u[i], c[i]);
  }
}

// to[i] := fl(scale * from[i]) (the host's ScaleInto): the product in double, rounded once to
// float64 or float32, and float16/bfloat16 from that float32.
__global__ void ScaleCopyKernel(const void* from, void* to, int64_t n, int32_t dtype,
                                double scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = Mul(scale, LoadAs<double>(from, dtype, i));
    if (dtype == kStageF64) {
      static_cast<double*>(to)[i] = v;
    } else {
      StoreFrom<float>(to, dtype, i, __double2float_rn(v));
    }
  }
}

unsigned ElementGrid(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

unsigned Grid(int64_t num_chunks) {
  return static_cast<unsigned>(std::min<int64_t>(num_chunks, 65535));
}

template <typename S>
void LaunchStep(const StagingChunk* chunks, int64_t num_chunks, const OuterStepArgs& args,
                cudaStream_t stream) {
  StepKernel<S><<<Grid(num_chunks), kThreads, 0, stream>>>(
      chunks, num_chunks, static_cast<const S*>(args.gradient), static_cast<S*>(args.anchor),
      OuterRuleKeepsState(args.rule) ? static_cast<S*>(args.momentum) : nullptr, args.rule,
      args.momentum_set);
}

}  // namespace

cudaError_t LaunchOuterDifference(const StagingChunk* chunks, int64_t num_chunks,
                                  const void* anchor, void* gradient, int32_t state_code,
                                  cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  if (state_code == kStageF64) {
    DifferenceKernel<double><<<Grid(num_chunks), kThreads, 0, stream>>>(
        chunks, num_chunks, static_cast<const double*>(anchor), static_cast<double*>(gradient));
  } else {
    DifferenceKernel<float><<<Grid(num_chunks), kThreads, 0, stream>>>(
        chunks, num_chunks, static_cast<const float*>(anchor), static_cast<float*>(gradient));
  }
  return cudaGetLastError();
}

cudaError_t LaunchOuterMix(const StagingChunk* chunks, int64_t num_chunks, const void* local,
                           int32_t state_code, double mix, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  const double keep = 1.0 - mix;
  if (state_code == kStageF64) {
    MixKernel<double><<<Grid(num_chunks), kThreads, 0, stream>>>(
        chunks, num_chunks, static_cast<const double*>(local), keep, mix);
  } else {
    MixKernel<float><<<Grid(num_chunks), kThreads, 0, stream>>>(
        chunks, num_chunks, static_cast<const float*>(local), keep, mix);
  }
  return cudaGetLastError();
}

cudaError_t LaunchOuterStep(const StagingChunk* chunks, int64_t num_chunks,
                            const OuterStepArgs& args, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  if (args.state_code == kStageF64) {
    LaunchStep<double>(chunks, num_chunks, args, stream);
  } else {
    LaunchStep<float>(chunks, num_chunks, args, stream);
  }
  return cudaGetLastError();
}

cudaError_t LaunchFeedbackAdd(float* u, const float* e, int64_t n, double beta,
                              cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FeedbackAddKernel<<<ElementGrid(n), kThreads, 0, stream>>>(u, e, n, beta);
  return cudaGetLastError();
}

cudaError_t LaunchFeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                   cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FeedbackResidualKernel<<<ElementGrid(n), kThreads, 0, stream>>>(u, c, n, e);
  return cudaGetLastError();
}

cudaError_t LaunchScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code,
                            double scale, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleCopyKernel<<<ElementGrid(n), kThreads, 0, stream>>>(from, to, n, dtype_code, scale);
  return cudaGetLastError();
}

}  // namespace modelavg::client
