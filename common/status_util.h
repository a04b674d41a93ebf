// Status helpers used everywhere: annotation, and the return-on-error macros. (The conversion to
// and from grpc::Status is the RPC layers' own: proto/status_conversion.h.)
#ifndef MODELAVG_COMMON_STATUS_UTIL_H_
#define MODELAVG_COMMON_STATUS_UTIL_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace modelavg {

// `status` with `context` prepended to its message ("context: message"), its payloads kept; OK
// stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// A status of `cause`'s code and payloads (its kind) with `message` instead of its own: the
// cause told in other words. OK stays OK.
absl::Status Restate(const absl::Status& cause, absl::string_view message);

}  // namespace modelavg

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define MODELAVG_RETURN_IF_ERROR(expr)                 \
  do {                                                 \
    ::absl::Status _modelavg_status = (expr);          \
    if (!_modelavg_status.ok()) return _modelavg_status; \
  } while (0)

#define MODELAVG_CONCAT_INNER(a, b) a##b
#define MODELAVG_CONCAT(a, b) MODELAVG_CONCAT_INNER(a, b)
// `lhs = value of expr` (an absl::StatusOr), or return its error.
#define MODELAVG_ASSIGN_OR_RETURN(lhs, expr) \
  MODELAVG_ASSIGN_OR_RETURN_IMPL(MODELAVG_CONCAT(_modelavg_statusor_, __LINE__), lhs, expr)
#define MODELAVG_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

#endif  // MODELAVG_COMMON_STATUS_UTIL_H_
