#include "common/outer_fields.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace modelavg {

OuterSgd OuterFromProto(const v1::OuterOptimizer& outer) {
  return OuterSgd{outer.lr(), outer.momentum(), outer.nesterov()};
}

void OuterToProto(const OuterSgd& outer, v1::OuterOptimizer* out) {
  out->set_lr(outer.lr);
  out->set_momentum(outer.momentum);
  out->set_nesterov(outer.nesterov);
}

absl::Status ValidateOuter(const OuterSgd& o, size_t i) {
  if (!std::isfinite(o.lr) || o.lr <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "levels[", i, "].outer.lr must be finite and > 0 (DiLoCo's recipe: 0.7), got ", o.lr));
  }
  if (!(o.momentum >= 0 && o.momentum < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "levels[", i, "].outer.momentum must be in [0, 1) (DiLoCo's recipe: 0.9), got ",
        o.momentum));
  }
  if (o.nesterov && o.momentum == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "levels[", i, "].outer.nesterov needs levels[", i,
        "].outer.momentum > 0 (PyTorch's SGD rule); set a momentum or drop nesterov"));
  }
  return absl::OkStatus();
}

}  // namespace modelavg
