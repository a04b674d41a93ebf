// A naive re-statement of the DiLoCo rule (JobSpec Level.outer, docs/diloco.md) for the
// trace worker's synthetic update, kept apart from client/ so that the tests compare the library
// with an independent reading of the rule. Double precision, no buffers, no communicators:
//
//   x_r starts at r; before the call of step s: x_r += (r + 1) * (s + 1) * 0.5.
//   The step's decision (NaiveDecide). No averaging: x unchanged. A plain level: x_r := mean of
//   the group's x. An outer level l, first time: x_r := mean, A_l,r := x_r, M_l,r unset.
//   Later: D := mean over the group of (A_l,m - x_m); M := D if unset, else momentum * M + D;
//   g := D + momentum * M if nesterov, else M; A_l,r := A_l,r - lr * g; x_r := A_l,r.
//   Without momentum g := D. Other levels' steps leave A_l alone.
#ifndef MODELAVG_TESTS_REFERENCE_OUTER_REFERENCE_H_
#define MODELAVG_TESTS_REFERENCE_OUTER_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/plan_reference.h"

namespace modelavg::testing {

// average, level, outer (the level has an outer optimizer), value (the rank's parameter after
// the call); plan is 0.
using OuterReferenceStep = PlanReferenceStep;

// expected[s][r] for steps 0 .. steps-1: a job whose plan never changes (plan_reference.h holds
// the rule, for one plan or several).
inline std::vector<std::vector<OuterReferenceStep>> OuterReference(const v1::JobSpec& spec,
                                                                   int64_t steps) {
  return PlanReference({{spec, 0}}, steps);
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_OUTER_REFERENCE_H_
