#include "client/comm/finite_check.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/base/error_kind.h"

namespace modelavg::client {

void WriteFiniteSlots(void* slots, DType dtype, int members, int member, int64_t code) {
  if (dtype == DType::kFloat64) {
    double* s = static_cast<double*>(slots);
    for (int i = 0; i < members; ++i) s[i] = i == member ? static_cast<double>(code) : 0.0;
  } else {
    float* s = static_cast<float*>(slots);
    for (int i = 0; i < members; ++i) s[i] = i == member ? static_cast<float>(code) : 0.0f;
  }
}

std::vector<int64_t> ReadFiniteSlots(const void* slots, DType dtype, int members,
                                     double scale) {
  std::vector<int64_t> codes(members, 0);
  for (int i = 0; i < members; ++i) {
    const double v = dtype == DType::kFloat64 ? static_cast<const double*>(slots)[i]
                                              : static_cast<const float*>(slots)[i];
    // A slot is reduced with the data: a NaN there would mean the slots themselves were
    // overwritten, which no member ever does; read it as a finding of the member.
    codes[i] = std::isfinite(v) ? static_cast<int64_t>(std::llround(v / scale)) : 1;
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
