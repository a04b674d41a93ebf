// float16 (IEEE binary16) and bfloat16 conversions to and from float32, round to nearest even,
// with infinities and NaNs preserved. Host code; the CUDA kernels use cuda_fp16/cuda_bf16.
#ifndef MODELAVG_CLIENT_BASE_HALF_H_
#define MODELAVG_CLIENT_BASE_HALF_H_

#include <cstdint>
#include <cstring>

#include "modelavg/client/tensor.h"

namespace modelavg::client {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in float32.
    return BitsFloat(FloatBits(static_cast<float>(mant) * 5.9604644775390625e-8f) | sign);
  }
  if (exp == 31) return BitsFloat(sign | 0x7F800000u | (mant << 13));
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {  // Inf stays Inf; NaN stays a (quiet) NaN.
    return sign | 0x7C00u | (x > 0x7F800000u ? (0x200u | ((x >> 13) & 0x3FFu)) : 0u);
  }
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to Inf.
  if (x < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5f lines the half's subnormal unit
    // (2^-24) up with float32's last mantissa bit, so the FPU rounds to nearest even for us.
    const float shifted = BitsFloat(x) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(shifted) - 0x3F000000u);
  }
  // Normal: rebias the exponent and round the 13 dropped bits to nearest even.
  const uint32_t odd = (x >> 13) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
  return sign | static_cast<uint16_t>(x >> 13);
}

inline float BFloat16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// Element i of a host tensor of any floating dtype, as a double, and written from one (rounded to
// the dtype as the conversions above round).
inline double ElementAt(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(t.data)[i];
    case DType::kFloat64:
      return static_cast<const double*>(t.data)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(t.data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(t.data)[i]);
  }
  return 0;
}

inline void SetElementAt(const TensorView& t, int64_t i, double v) {
  switch (t.dtype) {
    case DType::kFloat32:
      static_cast<float*>(t.data)[i] = static_cast<float>(v);
      return;
    case DType::kFloat64:
      static_cast<double*>(t.data)[i] = v;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(t.data)[i] = FloatToHalf(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(t.data)[i] = FloatToBFloat16(static_cast<float>(v));
      return;
  }
}
}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_BASE_HALF_H_
