// A second, deliberately naive transcription of PyTorch's averagers' decision rule
// (torch.distributed.algorithms.model_averaging.averagers), kept apart from common/ so that the
// integration tests compare the library with an independent reading of the rule rather than
// with itself. Only for the small steps and worlds of the tests: no validation, no window, no
// overflow care.
#ifndef MODELAVG_TESTS_REFERENCE_NAIVE_SCHEDULE_H_
#define MODELAVG_TESTS_REFERENCE_NAIVE_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::testing {

// The ranks `rank` averages with at a level of group size `g` (JobSpec.replica_size S, 0 or 1:
// none): those of its block [g * (rank / g), g * (rank / g) + g) that hold its shard rank % S.
inline std::vector<int> NaiveGroup(const v1::JobSpec& spec, int g, int rank) {
  const int s = spec.replica_size() > 1 ? spec.replica_size() : 1;
  std::vector<int> group;
  for (int r = rank / g * g; r < rank / g * g + g; ++r) {
    if (r % s == rank % s) group.push_back(r);
  }
  return group;
}

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
// With sharded replicas (replica_size S > 1) the group is the ranks of that block (the world,
// periodic) that hold the rank's shard (NaiveGroup).
inline NaiveDecision NaiveDecide(const v1::JobSpec& spec, int64_t step, int rank) {
  NaiveDecision d;
  if (step < spec.warmup_steps()) return d;
  if (spec.mode() == v1::PERIODIC) {
    if ((step - spec.warmup_steps()) % spec.levels(0).period() != 0) return d;
    d.average = true;
    d.level = 0;
    d.group = NaiveGroup(spec, spec.world_size(), rank);
    return d;
  }
  for (int i = spec.levels_size() - 1; i >= 0; --i) {
    if (step % spec.levels(i).period() != 0) continue;
    d.average = true;
    d.level = i;
    d.group = NaiveGroup(spec, spec.levels(i).group_size(), rank);
    return d;
  }
  return d;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_NAIVE_SCHEDULE_H_
