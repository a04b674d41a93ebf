// libFuzzer target: the coordinator's --jobs_file parser (JSON, JSON array, protobuf text
// format, one spec or a list). Properties: it never crashes, a refusal says why, and every spec
// it returns passes the validation CreateJob applies, with unique job ids.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "common/job_spec.h"
#include "server/jobs_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::vector<modelavg::v1::JobSpec>> jobs =
      modelavg::server::ParseJobsFile(text, "fuzz.json");
  if (!jobs.ok()) {
    if (jobs.status().code() != absl::StatusCode::kInvalidArgument ||
        jobs.status().message().empty()) {
      __builtin_trap();
    }
    return 0;
  }
  std::set<std::string> ids;
  for (const modelavg::v1::JobSpec& spec : *jobs) {
    if (!modelavg::ScheduleSpecFromProto(spec).ok()) __builtin_trap();
    if (!ids.insert(spec.job_id()).second) __builtin_trap();
  }
  return 0;
}
