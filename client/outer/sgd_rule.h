// PyTorch's SGD as an outer rule (torch.optim.SGD: no weight decay, no dampening), one element
// at a time, on the host and in the CUDA kernel alike (outer_rule.h). In the state dtype S, the
// hyperparameters cast to S first (as PyTorch's CPU kernels cast them), each operation rounded
// on its own:
//   no momentum (m null):  A := A + (-lr) * D
//   else:                  M := momentum_set ? M * mu + D : D;
//                          g := nesterov ? D + mu * M : M;   A := A + (-lr) * g
// (PyTorch's buf.mul_(momentum).add_(grad); grad.add(buf, alpha=momentum);
// param.add_(grad, alpha=-lr)).
#ifndef MODELAVG_CLIENT_OUTER_SGD_RULE_H_
#define MODELAVG_CLIENT_OUTER_SGD_RULE_H_

#include "client/outer/outer_math.h"

namespace modelavg::client {

struct SgdRule {
  // Keeps the momentum buffer M with momentum > 0.
  template <typename Params>
  static MODELAVG_OUTER_HD bool KeepsState(const Params& p) {
    return p.momentum != 0;
  }
  template <typename S, typename Params>
  static MODELAVG_OUTER_HD void Step(const Params& p, bool momentum_set, S d, S* m, S* a) {
    using M = OuterMath;
    const S lr = static_cast<S>(p.lr);
    const S mu = static_cast<S>(p.momentum);
    S g = d;
    if (m != nullptr) {
      const S buf = momentum_set ? M::Add(M::Mul(*m, mu), d) : d;
      *m = buf;
      g = p.nesterov ? M::Add(d, M::Mul(mu, buf)) : buf;
    }
    *a = M::Add(*a, M::Mul(-lr, g));
  }
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_SGD_RULE_H_
