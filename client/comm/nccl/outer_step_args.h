// The arguments of the outer optimizer's step on CUDA parameters (DiLoCo, device_outer_state.h), shared
// by the host logic, the CUDA kernel (nccl_outer_kernels.cu) and the tests' simulated device.
// Plain C++: no CUDA, no Abseil.
#ifndef MODELAVG_CLIENT_COMM_NCCL_OUTER_STEP_ARGS_H_
#define MODELAVG_CLIENT_COMM_NCCL_OUTER_STEP_ARGS_H_

#include <cstdint>

namespace modelavg::client {

// PyTorch's SGD (no weight decay, no dampening) on the anchor A with the group's mean
// pseudo-gradient D as its gradient, element by element, in the state dtype S (the scalars cast
// to S first, each operation rounded on its own, never fused into an FMA):
//   momentum_factor == 0:  A := A + (-lr) * D
//   else:                  M := momentum_set ? M * mu + D : D;
//                          g := nesterov ? D + mu * M : M;   A := A + (-lr) * g
// then the parameter element := A, rounded to the parameter's dtype.
struct OuterStepArgs {
  const void* gradient = nullptr;  // D
  void* anchor = nullptr;          // A
  void* momentum = nullptr;        // M; null without momentum
  int32_t state_code = 0;          // kStageF32 or kStageF64 (staging_chunk.h): S
  double lr = 1.0;
  double momentum_factor = 0.0;    // mu
  bool nesterov = false;
  bool momentum_set = false;       // M holds a value (else it is set to D)
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_OUTER_STEP_ARGS_H_
