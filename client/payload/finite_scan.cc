#include "client/payload/finite_scan.h"

#include <cmath>
#include <cstring>

#include "client/base/half.h"

namespace modelavg::client {
namespace {

// Non-finite iff every exponent bit is set. The loop keeps no branch, so that it vectorizes.
template <typename Bits>
bool AllExponentsFinite(const void* data, int64_t n, Bits exponent) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  Bits bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof(Bits));
    bad |= static_cast<Bits>((b & exponent) == exponent);
  }
  return bad == 0;
}

NonFiniteValue Classify(double x) {
  if (std::isnan(x)) return NonFiniteValue::kNaN;
  if (std::isinf(x)) return x > 0 ? NonFiniteValue::kPosInf : NonFiniteValue::kNegInf;
  return NonFiniteValue::kNone;
}

double ElementAt(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DType::kFloat64:
      return static_cast<const double*>(data)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
  }
  return 0;
}

}  // namespace

absl::string_view NonFiniteValueName(NonFiniteValue value) {
  switch (value) {
    case NonFiniteValue::kNone:
      return "finite";
    case NonFiniteValue::kNaN:
      return "NaN";
    case NonFiniteValue::kPosInf:
      return "+Inf";
    case NonFiniteValue::kNegInf:
      return "-Inf";
  }
  return "finite";
}

bool AllFinite(const void* data, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return AllExponentsFinite<uint32_t>(data, n, 0x7f800000u);
    case DType::kFloat64:
      return AllExponentsFinite<uint64_t>(data, n, 0x7ff0000000000000ull);
    case DType::kFloat16:
      return AllExponentsFinite<uint16_t>(data, n, 0x7c00u);
    case DType::kBFloat16:
      return AllExponentsFinite<uint16_t>(data, n, 0x7f80u);
  }
  return true;
}

NonFiniteValue FirstNonFinite(const void* data, DType dtype, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const NonFiniteValue v = Classify(ElementAt(data, dtype, i));
    if (v != NonFiniteValue::kNone) return v;
  }
  return NonFiniteValue::kNone;
}

NonFiniteFinding ScanTensors(absl::Span<const TensorView> tensors) {
  NonFiniteFinding finding;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const TensorView& v = tensors[t];
    if (v.numel <= 0 || AllFinite(v.data, v.dtype, v.numel)) continue;
    finding.tensor = static_cast<int32_t>(t);
    finding.value = FirstNonFinite(v.data, v.dtype, v.numel);
    break;
  }
  return finding;
}

int64_t FindingCode(const NonFiniteFinding& finding) {
  if (!finding.found()) return 0;
  const int64_t tensor = finding.tensor < kMaxCodedTensor ? finding.tensor : kMaxCodedTensor;
  return tensor * 4 + static_cast<int64_t>(finding.value);
}

NonFiniteFinding FindingOfCode(int64_t code) {
  NonFiniteFinding finding;
  if (code <= 0) return finding;
  finding.tensor = static_cast<int32_t>(code / 4);
  const int64_t value = code % 4;
  finding.value = value == 0 ? NonFiniteValue::kNaN : static_cast<NonFiniteValue>(value);
  return finding;
}

}  // namespace modelavg::client
