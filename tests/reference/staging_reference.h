// Host reference of the staging kernels' element conversions: load element i of a buffer of
// staging dtype `code` as double, store a double into one. The tests compare the device kernels
// and the simulated members against it.
#ifndef MODELAVG_TESTS_REFERENCE_STAGING_REFERENCE_H_
#define MODELAVG_TESTS_REFERENCE_STAGING_REFERENCE_H_

#include <cstdint>

#include "client/base/half.h"
#include "client/payload/staging_chunk.h"

namespace modelavg::client {

inline double LoadAs(const void* p, int32_t code, int64_t i) {
  switch (code) {
    case kStageF32:
      return static_cast<const float*>(p)[i];
    case kStageF64:
      return static_cast<const double*>(p)[i];
    case kStageF16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    default:
      return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void StoreAs(void* p, int32_t code, int64_t i, double v) {
  switch (code) {
    case kStageF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case kStageF64:
      static_cast<double*>(p)[i] = v;
      break;
    case kStageF16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(static_cast<float>(v));
      break;
    default:
      static_cast<uint16_t*>(p)[i] = FloatToBFloat16(static_cast<float>(v));
      break;
  }
}

}  // namespace modelavg::client

#endif  // MODELAVG_TESTS_REFERENCE_STAGING_REFERENCE_H_
