// A level's outer optimizer (Level.outer, docs/diloco.md) in the job spec: reading it from the
// proto, writing it back and validating it, in one place, so that a new outer rule or
// hyperparameter is written here once (docs/architecture.md, "a new outer rule") and job_spec.cc
// and schedule.cc, which call these, do not change.
#ifndef MODELAVG_COMMON_OUTER_FIELDS_H_
#define MODELAVG_COMMON_OUTER_FIELDS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg {

// The level's outer optimizer as the job spec holds it.
OuterSgd OuterFromProto(const v1::OuterOptimizer& outer);

// Writes `outer` into `out` (every field).
void OuterToProto(const OuterSgd& outer, v1::OuterOptimizer* out);

// INVALID_ARGUMENT naming the field of levels[`level`].outer that is out of range, with the
// published recipe's value.
absl::Status ValidateOuter(const OuterSgd& outer, size_t level);

}  // namespace modelavg

#endif  // MODELAVG_COMMON_OUTER_FIELDS_H_
