// A naive re-statement of a job whose plan changed while it ran (UpdateJob,
// docs/plan-updates.md), for the trace worker's synthetic update, kept apart from common/ and
// client/ so that the tests compare the library with an independent reading of the rule:
//
//   x_r starts at r; before the call of step s: x_r += (r + 1) * (s + 1) * 0.5.
//   Plan v is in force from its switch step E_v on; the decision at step s is PyTorch's
//   averager of the plan in force at s (NaiveDecide), its level indexing that plan's levels.
//   No averaging: x unchanged. A plain level: x_r := mean of the group's x. An outer level l
//   (DiLoCo, docs/diloco.md), first time: x_r := mean, A_l,r := x_r, M_l,r unset. Later:
//   D := mean over the group of (A_l,m - x_m); M := D if unset, else momentum * M + D;
//   g := D + momentum * M if nesterov, else M; A_l,r := A_l,r - lr * g; x_r := A_l,r. Without
//   momentum g := D. Other levels' steps leave A_l alone.
//   At E_v, level l keeps its outer state (anchor, momentum) iff both plans give it an outer
//   optimizer and the same group size; otherwise its state is dropped, and its first averaging
//   step from E_v on is a plain average that sets the anchor again. The outer step uses the
//   optimizer of the plan in force.
#ifndef MODELAVG_TESTS_REFERENCE_PLAN_REFERENCE_H_
#define MODELAVG_TESTS_REFERENCE_PLAN_REFERENCE_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/naive_outer_sgd.h"
#include "tests/reference/naive_schedule.h"

namespace modelavg::testing {

struct PlanReferenceStep {
  bool average = false;
  int level = -1;
  bool outer = false;  // the level has an outer optimizer
  int plan = 0;        // the version in force
  double value = 0;    // the rank's parameter after the call
};

// `plans`: (spec, switch step), version 0 first (switch step 0). expected[s][r].
inline std::vector<std::vector<PlanReferenceStep>> PlanReference(
    const std::vector<std::pair<v1::JobSpec, int64_t>>& plans, int64_t steps) {
  const int world = plans[0].first.world_size();
  int most_levels = 0;
  for (const auto& [spec, at] : plans) most_levels = std::max(most_levels, spec.levels_size());
  std::vector<double> x(world);
  for (int r = 0; r < world; ++r) x[r] = r;
  std::vector<std::vector<std::optional<double>>> anchor(
      most_levels, std::vector<std::optional<double>>(world));
  std::vector<std::vector<std::optional<double>>> momentum = anchor;
  std::vector<std::vector<PlanReferenceStep>> out;
  size_t v = 0;
  for (int64_t s = 0; s < steps; ++s) {
    while (v + 1 < plans.size() && s >= plans[v + 1].second) {
      const v1::JobSpec& prev = plans[v].first;
      const v1::JobSpec& next = plans[v + 1].first;
      for (int l = 0; l < most_levels; ++l) {
        const bool keep = l < prev.levels_size() && l < next.levels_size() &&
                          prev.levels(l).has_outer() && next.levels(l).has_outer() &&
                          prev.levels(l).group_size() == next.levels(l).group_size();
        if (keep) continue;
        for (int r = 0; r < world; ++r) {
          anchor[l][r].reset();
          momentum[l][r].reset();
        }
      }
      ++v;
    }
    const v1::JobSpec& spec = plans[v].first;
    for (int r = 0; r < world; ++r) x[r] += (r + 1) * (s + 1) * 0.5;
    std::vector<double> next = x;
    std::vector<PlanReferenceStep> row(world);
    auto next_anchor = anchor;
    auto next_momentum = momentum;
    for (int r = 0; r < world; ++r) {
      const NaiveDecision d = NaiveDecide(spec, s, r);
      row[r].plan = static_cast<int>(v);
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

#endif  // MODELAVG_TESTS_REFERENCE_PLAN_REFERENCE_H_
