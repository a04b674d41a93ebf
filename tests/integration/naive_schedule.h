// A second, deliberately naive transcription of PyTorch's averagers' decision rule
// (torch.distributed.algorithms.model_averaging.averagers), kept apart from common/ so that the
// integration tests compare the library with an independent reading of the rule rather than
// with itself. Only for the small steps and worlds of the tests: no validation, no window, no
// overflow care.
#ifndef MODELAVG_TESTS_INTEGRATION_NAIVE_SCHEDULE_H_
#define MODELAVG_TESTS_INTEGRATION_NAIVE_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::testing {

struct NaiveDecision {
  bool average = false;
  int level = -1;          // index into the spec's levels
  std::vector<int> group;  // the ranks averaged together (rank's own block)
};

// What `rank` does at `step`:
//   PeriodicModelAverager:     step >= warmup_steps and (step - warmup_steps) % period == 0,
//                              with the whole world.
//   HierarchicalModelAverager: step >= warmup_steps; the levels, last to first, the first whose
//                              step % period == 0; the rank's block of group_size ranks.
inline NaiveDecision NaiveDecide(const v1::JobSpec& spec, int64_t step, int rank) {
  NaiveDecision d;
  if (step < spec.warmup_steps()) return d;
  if (spec.mode() == v1::PERIODIC) {
    if ((step - spec.warmup_steps()) % spec.levels(0).period() != 0) return d;
    d.average = true;
    d.level = 0;
    for (int r = 0; r < spec.world_size(); ++r) d.group.push_back(r);
    return d;
  }
  for (int i = spec.levels_size() - 1; i >= 0; --i) {
    if (step % spec.levels(i).period() != 0) continue;
    const int g = spec.levels(i).group_size();
    d.average = true;
    d.level = i;
    const int first = rank / g * g;
    for (int r = first; r < first + g; ++r) d.group.push_back(r);
    return d;
  }
  return d;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_NAIVE_SCHEDULE_H_
