#include "common/status_util.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace modelavg {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return Restate(status, absl::StrCat(context, ": ", status.message()));
}

absl::Status Restate(const absl::Status& cause, absl::string_view message) {
  if (cause.ok()) return cause;
  absl::Status out(cause.code(), message);
  // Payloads (the error's kind, client/base/error_kind.h) travel with it.
  cause.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace modelavg
