#include "common/status_util.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace modelavg {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  // Payloads (the error's kind, client/base/error_kind.h) travel with it.
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace modelavg
