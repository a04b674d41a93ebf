// The outer optimizer's rules (DiLoCo, docs/diloco.md): what one outer step does to one element
// of a level's state, each written once for the host (outer_state.cc) and the CUDA kernel
// (cuda/outer_kernels.cu), so that both compute the same bits; and the table of them.
// Plain C++ that nvcc also compiles: no Abseil, no CUDA headers (OuterRuleParamsOf, the host's
// reading of a level's optimizer, apart).
//
// A rule is a struct (sgd_rule.h) with
//   template <typename Params> static MODELAVG_OUTER_HD bool KeepsState(const Params&);
//   template <typename S, typename Params>
//   static MODELAVG_OUTER_HD void Step(const Params&, bool state_set, S d, S* m, S* a);
// Step moves the anchor element *a with the group's mean pseudo-gradient d, in the state dtype
// S (float or double), keeping its one state element in *m (null where KeepsState is false;
// state_set: *m holds a value, else the step sets it), every operation through OuterMath.
// A new rule is its own header and one entry in each of the three places marked below.
#ifndef MODELAVG_CLIENT_OUTER_OUTER_RULE_H_
#define MODELAVG_CLIENT_OUTER_OUTER_RULE_H_

#include <cstdint>

#include "client/outer/outer_math.h"
#include "client/outer/sgd_rule.h"
#if !defined(__CUDACC__)
#include "modelavg/common/schedule.h"
#endif

namespace modelavg::client {

// (1) The rules.
enum class OuterRuleKind : int32_t {
  kSgd = 0,
};

// A level's rule and its hyperparameters, as the host and the kernel read them.
struct OuterRuleParams {
  OuterRuleKind kind = OuterRuleKind::kSgd;
  double lr = 1.0;
  double momentum = 0.0;  // mu
  bool nesterov = false;
};

#if !defined(__CUDACC__)
// (2) A level's optimizer (the job's OuterOptimizer) as a rule.
inline OuterRuleParams OuterRuleParamsOf(const OuterSgd& optimizer) {
  OuterRuleParams p;
  p.kind = OuterRuleKind::kSgd;
  p.lr = optimizer.lr;
  p.momentum = optimizer.momentum;
  p.nesterov = optimizer.nesterov;
  return p;
}
#endif

// (3) Each rule's entry.
#define MODELAVG_OUTER_RULES(X) X(OuterRuleKind::kSgd, SgdRule)

// Whether `p`'s rule keeps a state element per anchor element (the level's momentum buffer).
MODELAVG_OUTER_HD bool OuterRuleKeepsState(const OuterRuleParams& p) {
#define MODELAVG_OUTER_RULE_KEEPS(rule_kind, Rule) \
  if (p.kind == rule_kind) return Rule::KeepsState(p);
  MODELAVG_OUTER_RULES(MODELAVG_OUTER_RULE_KEEPS)
#undef MODELAVG_OUTER_RULE_KEEPS
  return false;
}

// `p`'s rule's step on one element (see above); `m` null where the rule keeps no state.
template <typename S>
MODELAVG_OUTER_HD void OuterRuleStep(const OuterRuleParams& p, bool state_set, S d, S* m, S* a) {
#define MODELAVG_OUTER_RULE_STEP(rule_kind, Rule) \
  if (p.kind == rule_kind) return Rule::Step(p, state_set, d, m, a);
  MODELAVG_OUTER_RULES(MODELAVG_OUTER_RULE_STEP)
#undef MODELAVG_OUTER_RULE_STEP
}

// The arguments of one outer step on CUDA parameters (device_outer_state.h), shared by the host
// logic, the CUDA kernel (cuda/outer_kernels.cu) and the tests' simulated device: the rule's
// step on the anchor A with the group's mean pseudo-gradient D as its gradient, element by
// element, in the state dtype S, then the parameter element := A, rounded to the parameter's
// dtype.
struct OuterStepArgs {
  OuterRuleParams rule;
  const void* gradient = nullptr;  // D
  void* anchor = nullptr;          // A
  void* momentum = nullptr;        // M: the rule's state; null where it keeps none
  int32_t state_code = 0;          // kStageF32 or kStageF64 (staging_chunk.h): S
  bool momentum_set = false;       // M holds a value (else the step sets it)
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_OUTER_RULE_H_
