#include "client/comm/finite_check.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"

namespace modelavg::client {

namespace {

double SlotAt(const void* slots, int32_t code, int64_t i) {
  switch (code) {
    case kStageF64:
      return static_cast<const double*>(slots)[i];
    case kStageF16:
      return HalfToFloat(static_cast<const uint16_t*>(slots)[i]);
    default:
      return static_cast<const float*>(slots)[i];
  }
}

void SetSlot(void* slots, int32_t code, int64_t i, double v) {
  switch (code) {
    case kStageF64:
      static_cast<double*>(slots)[i] = v;
      break;
    case kStageF16:
      static_cast<uint16_t*>(slots)[i] = FloatToHalf(static_cast<float>(v));
      break;
    default:
      static_cast<float*>(slots)[i] = static_cast<float>(v);
  }
}

}  // namespace

int FiniteSlotWidth(int32_t staging_code) { return staging_code == kStageF16 ? 3 : 1; }

void WriteFiniteSlots(void* slots, int32_t staging_code, int members, int member, int64_t code) {
  const int width = FiniteSlotWidth(staging_code);
  for (int i = 0; i < members; ++i) {
    int64_t rest = i == member ? code : 0;
    for (int d = 0; d < width; ++d) {
      // Least significant digit last; one element holds the whole code where width is 1.
      const int64_t digit = width == 1 ? rest : rest % 256;
      SetSlot(slots, staging_code, static_cast<int64_t>(i) * width + (width - 1 - d),
              static_cast<double>(digit));
      rest = width == 1 ? 0 : rest / 256;
    }
  }
}

std::vector<int64_t> ReadFiniteSlots(const void* slots, int32_t staging_code, int members,
                                     double scale) {
  const int width = FiniteSlotWidth(staging_code);
  std::vector<int64_t> codes(members, 0);
  for (int i = 0; i < members; ++i) {
    int64_t code = 0;
    for (int d = 0; d < width; ++d) {
      const double v = SlotAt(slots, staging_code, static_cast<int64_t>(i) * width + d);
      // A slot is reduced with the data: a NaN there would mean the slots themselves were
      // overwritten, which no member does; read it as a finding of the member.
      if (!std::isfinite(v)) {
        code = 1;
        break;
      }
      code = code * (width == 1 ? 1 : 256) + static_cast<int64_t>(std::llround(v / scale));
    }
    codes[i] = code;
  }
  return codes;
}

absl::Status DecideFinite(absl::Span<const int64_t> codes, int64_t step) {
  for (size_t m = 0; m < codes.size(); ++m) {
    if (codes[m] <= 0) continue;
    const NonFiniteFinding f = FindingOfCode(codes[m]);
    int others = 0;
    for (size_t o = m + 1; o < codes.size(); ++o) others += codes[o] > 0 ? 1 : 0;
    NonFiniteDetail detail;
    detail.step = step;
    detail.tensor = f.tensor;
    detail.value = std::string(NonFiniteValueName(f.value));
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "member ", m, " of this subgroup contributed non-finite values: ", detail.value,
        " in tensor ", f.tensor, f.tensor >= kMaxCodedTensor ? " or later" : "",
        " of the round (its first tensor holding one)",
        others > 0 ? absl::StrCat(", and ", others, " more member(s) did too") : "",
        "; no member kept the round's result: every member's tensors are as before the call"));
    s = SetErrorKind(std::move(s), ErrorKind::kNonFinite, static_cast<int32_t>(m));
    return SetNonFiniteDetail(std::move(s), detail);
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
