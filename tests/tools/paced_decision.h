// A paced round's decision as the client's weighting tests craft it (client/averaging/
// round_weights.h): shared by the Gloo and the simulated NCCL paced tests.
#ifndef MODELAVG_TESTS_TOOLS_PACED_DECISION_H_
#define MODELAVG_TESTS_TOOLS_PACED_DECISION_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "modelavg/common/schedule.h"

namespace modelavg::testing {

// Round 2 at step 65 of level 0, ranks 0..n-1 of one subgroup with these weights (the docs'
// worked example's round 2: 20, 29, 45 steps).
inline Decision PacedDecision(std::vector<double> weights) {
  Decision d;
  d.step = 65;
  d.average = true;
  d.level = 0;
  d.round = 2;
  d.subgroup = SubgroupRange{0, 0, static_cast<int32_t>(weights.size())};
  for (int32_t r = 0; r < static_cast<int32_t>(weights.size()); ++r) d.members.push_back(r);
  d.weights = std::move(weights);
  return d;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_PACED_DECISION_H_
