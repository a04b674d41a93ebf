// spdlog set-up shared by every program: one format, a level chosen by flag or environment.
#ifndef MODELAVG_COMMON_LOGGING_H_
#define MODELAVG_COMMON_LOGGING_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace modelavg {

// Sets the default logger's level ("trace", "debug", "info", "warn", "error", "critical", "off")
// and pattern; output goes to stderr so that stdout stays free for a program's data.
// INVALID_ARGUMENT for an unknown level name.
absl::Status InitLogging(absl::string_view level, absl::string_view name = "modelavg");

}  // namespace modelavg

#endif  // MODELAVG_COMMON_LOGGING_H_
