// One element of PyTorch's SGD step (torch.optim.SGD, no dampening, no weight decay) as the
// naive DiLoCo and streaming references (outer_reference.h, streaming_reference.h) restate it,
// kept apart from client/: with D the averaged pseudo-gradient of the element,
//   M := D if unset, else momentum * M + D;  g := D + momentum * M if nesterov, else M;
//   A := A - lr * g.  Without momentum g := D and M stays unset.
#ifndef MODELAVG_TESTS_REFERENCE_NAIVE_OUTER_SGD_H_
#define MODELAVG_TESTS_REFERENCE_NAIVE_OUTER_SGD_H_

#include <optional>

#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::testing {

// Returns A' for anchor `a` and pseudo-gradient `d`; updates `*momentum`.
inline double NaiveOuterSgd(const v1::OuterOptimizer& o, double d,
                            std::optional<double>* momentum, double a) {
  const double mu = o.momentum();
  double g = d;
  if (mu != 0) {
    const double buf = momentum->has_value() ? mu * **momentum + d : d;
    *momentum = buf;
    g = o.nesterov() ? d + mu * buf : buf;
  }
  return a - o.lr() * g;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_NAIVE_OUTER_SGD_H_
