#include "common/logging.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "spdlog/logger.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace modelavg {

absl::Status InitLogging(absl::string_view level, absl::string_view name) {
  const std::string level_name(level);
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level_name);
  // from_str maps anything unknown to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level_name != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown log level \"", level,
                     "\"; use trace, debug, info, warn, error, critical or off"));
  }
  // Not registered by name, so InitLogging may be called again (tests, reconfiguration).
  auto logger = std::make_shared<spdlog::logger>(
      std::string(name), std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ " + std::string(name) + "[%P:%t] %v");
  logger->set_level(parsed);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

}  // namespace modelavg
