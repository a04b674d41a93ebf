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
#ifndef MODELAVG_TESTS_INTEGRATION_OUTER_REFERENCE_H_
#define MODELAVG_TESTS_INTEGRATION_OUTER_REFERENCE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"
#include "tests/integration/naive_outer_sgd.h"
#include "tests/integration/naive_schedule.h"

namespace modelavg::testing {

struct OuterReferenceStep {
  bool average = false;
  int level = -1;
  bool outer = false;  // the level has an outer optimizer
  double value = 0;    // the rank's parameter after the call
};

// expected[s][r] for steps 0 .. steps-1.
inline std::vector<std::vector<OuterReferenceStep>> OuterReference(const v1::JobSpec& spec,
                                                                   int64_t steps) {
  const int world = spec.world_size();
  const int levels = spec.levels_size();
  std::vector<double> x(world);
  for (int r = 0; r < world; ++r) x[r] = r;
  // [level][rank]
  std::vector<std::vector<std::optional<double>>> anchor(
      levels, std::vector<std::optional<double>>(world));
  std::vector<std::vector<std::optional<double>>> momentum = anchor;
  std::vector<std::vector<OuterReferenceStep>> out;
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) x[r] += (r + 1) * (s + 1) * 0.5;
    std::vector<double> next = x;
    std::vector<OuterReferenceStep> row(world);
    std::vector<std::vector<std::optional<double>>> next_anchor = anchor, next_momentum = momentum;
    for (int r = 0; r < world; ++r) {
      const NaiveDecision d = NaiveDecide(spec, s, r);
      row[r].average = d.average;
      row[r].level = d.level;
      if (!d.average) continue;
      const v1::Level& level = spec.levels(d.level);
      row[r].outer = level.has_outer();
      const double n = static_cast<double>(d.group.size());
      if (!level.has_outer() || !anchor[d.level][r].has_value()) {
        double sum = 0;
        for (int m : d.group) sum += x[m];
        next[r] = sum / n;
        if (level.has_outer()) next_anchor[d.level][r] = next[r];
        continue;
      }
      double sum = 0;
      for (int m : d.group) sum += *anchor[d.level][m] - x[m];
      std::optional<double> m = momentum[d.level][r];
      const double a = NaiveOuterSgd(level.outer(), sum / n, &m, *anchor[d.level][r]);
      next_momentum[d.level][r] = m;
      next_anchor[d.level][r] = a;
      next[r] = a;
    }
    x = next;
    anchor = next_anchor;
    momentum = next_momentum;
    for (int r = 0; r < world; ++r) row[r].value = x[r];
    out.push_back(row);
  }
  return out;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_OUTER_REFERENCE_H_
