// Finding non-finite values (NaN, +Inf, -Inf) in a member's contribution to a round, on the host:
// the fast test of a range (every element finite?) that the staging copy runs as it copies
// (PackDivided with a finding), the slow look at the first bad element that only a range found
// bad pays, and a finding's code, which travels in the round's own data to the other members
// (client/comm/finite_check.h). Finite values are never taken for bad ones: the largest floats,
// denormals and zeros of either sign are finite.
#ifndef MODELAVG_CLIENT_PAYLOAD_FINITE_SCAN_H_
#define MODELAVG_CLIENT_PAYLOAD_FINITE_SCAN_H_

#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// What a non-finite element holds.
enum class NonFiniteValue : int32_t { kNone = 0, kNaN = 1, kPosInf = 2, kNegInf = 3 };
// "NaN", "+Inf", "-Inf" ("finite" for kNone).
absl::string_view NonFiniteValueName(NonFiniteValue value);

// A member's first tensor (index in the round's list) holding a non-finite element, and what
// that tensor's first non-finite element holds. tensor -1: every element is finite.
struct NonFiniteFinding {
  int32_t tensor = -1;
  NonFiniteValue value = NonFiniteValue::kNone;
  bool found() const { return tensor >= 0; }
};

// Whether every one of the `n` elements at `data` (of `dtype`) is finite. One pass, vectorized
// for float32 and float64 (a test of the exponent bits).
bool AllFinite(const void* data, DType dtype, int64_t n);
// What the first non-finite element of the `n` at `data` holds (kNone: all finite).
NonFiniteValue FirstNonFinite(const void* data, DType dtype, int64_t n);
// The first tensor of `tensors` (host memory) with a non-finite element: one pass over them, for
// the rounds that make no staging copy.
NonFiniteFinding ScanTensors(absl::Span<const TensorView> tensors);

// A finding as a small integer (0: none; else tensor * 4 + value), exact in float32 and after a
// division by a member count and back: tensor indices from kMaxCodedTensor on are coded as it.
inline constexpr int32_t kMaxCodedTensor = (1 << 20) - 1;
int64_t FindingCode(const NonFiniteFinding& finding);
NonFiniteFinding FindingOfCode(int64_t code);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_PAYLOAD_FINITE_SCAN_H_
