// The coordinator's --jobs_file: jobs declared at start-up.
#ifndef MODELAVG_SERVER_JOBS_FILE_H_
#define MODELAVG_SERVER_JOBS_FILE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

// Parses a jobs file: a JobSpecList ({"jobs": [...]}) or a single JobSpec, as JSON (proto3 JSON
// mapping; a top-level array of JobSpecs is accepted too) or as protobuf text format. Each spec is
// validated as CreateJob would, and job ids must be unique. INVALID_ARGUMENT naming `name` (the
// file) and the problem.
absl::StatusOr<std::vector<v1::JobSpec>> ParseJobsFile(const std::string& contents,
                                                       const std::string& name);

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_JOBS_FILE_H_
