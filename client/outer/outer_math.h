// The arithmetic of the outer rules (outer_rule.h), for the host and the CUDA kernel alike.
// Plain C++ that nvcc also compiles: no Abseil, no CUDA headers.
#ifndef MODELAVG_CLIENT_OUTER_OUTER_MATH_H_
#define MODELAVG_CLIENT_OUTER_OUTER_MATH_H_

#if defined(__CUDACC__)
#define MODELAVG_OUTER_HD __host__ __device__ __forceinline__
#else
#define MODELAVG_OUTER_HD inline
#endif

namespace modelavg::client {

// Arithmetic in the state dtype S (float or double), each operation rounded on its own: the
// host (and PyTorch's CPU kernels) never fuse a multiply and an add, and neither may the
// device, or its steps would differ from the host's in the last bit.
struct OuterMath {
#if defined(__CUDA_ARCH__)
  static __device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ double Mul(double a, double b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ double Add(double a, double b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ double Sub(double a, double b) { return __dsub_rn(a, b); }
#else
  template <typename S>
  static S Mul(S a, S b) { return a * b; }
  template <typename S>
  static S Add(S a, S b) { return a + b; }
  template <typename S>
  static S Sub(S a, S b) { return a - b; }
#endif
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_OUTER_MATH_H_
