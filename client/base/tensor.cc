#include "modelavg/client/tensor.h"

#include "absl/strings/str_cat.h"

namespace modelavg::client {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

std::string Device::ToString() const {
  return is_host() ? std::string("host") : absl::StrCat("cuda:", index);
}

absl::Status ValidateTensorView(size_t index, const TensorView& t) {
  if (t.numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", index, " has numel ", t.numel, ": it must be >= 0"));
  }
  if (t.numel > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", index, " has ", t.numel, " elements but a null data pointer"));
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
