#include "common/payload_fields.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace modelavg {

std::string PayloadNameList(const std::function<bool(const PayloadInfo&)>& keep) {
  std::vector<const char*> names;
  for (const PayloadInfo& info : kPayloads) {
    if (keep(info)) names.push_back(info.name);
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == names.size() ? " or " : ", ");
    absl::StrAppend(&out, names[i]);
  }
  return out;
}

std::optional<Payload> PayloadNamed(absl::string_view name) {
  for (const PayloadInfo& info : kPayloads) {
    if (name == info.name) return info.payload;
  }
  return std::nullopt;
}

absl::Status CheckPayloadFields(Payload payload, double topk_density, double error_feedback,
                                bool outer, const FieldText& field) {
  const PayloadInfo& info = PayloadInfoOf(payload);
  if (info.topk) {
    if (!(topk_density > 0.0 && topk_density < 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field("topk_density", topk_density), " must be in (0, 1) with payload ", info.name,
          " (the fraction of each block's entries sent)"));
    }
  } else if (topk_density != 0.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field("topk_density", topk_density), " needs payload ",
        PayloadNameList([](const PayloadInfo& i) { return i.topk; }), "; the payload is ",
        info.name, " (set topk_density 0)"));
  }
  if (outer && error_feedback != 0.0 && !info.lossy) {
    return absl::InvalidArgumentError(absl::StrCat(
        field("error_feedback", error_feedback), " needs a compressed payload (",
        PayloadNameList([](const PayloadInfo& i) { return i.lossy; }), "): ", info.name,
        " loses nothing to feed back; set error_feedback 0 or choose a payload"));
  }
  return absl::OkStatus();
}

}  // namespace modelavg
