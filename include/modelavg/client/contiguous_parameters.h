// One allocation holding a model's parameter tensors back to back, so that averaging them is
// a single in-place all-reduce with no staging copies (the NCCL path's zero-copy case).
//
//   auto params = ContiguousParameters::Create({4096 * 1024, 1024, 10 * 1024}, DType::kFloat32,
//                                              Device::Cuda(0), stream);
//   // point the model's parameters at params->views()[i].data ...
//   averager->AverageParameters(params->views());    // one ncclAllReduce, in place
#ifndef MODELAVG_CLIENT_CONTIGUOUS_PARAMETERS_H_
#define MODELAVG_CLIENT_CONTIGUOUS_PARAMETERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

class ContiguousParameters {
 public:
  // Zero-initialised storage for tensors of `numels` elements of `dtype` on `device` (host
  // memory, or cudaMalloc on a CUDA device; `cuda_stream` is recorded in the views, and the
  // zeroing runs on it and has finished when Create returns; the calling thread's current CUDA
  // device is left as it was).
  // Errors: INVALID_ARGUMENT (negative numel), RESOURCE_EXHAUSTED (allocation failed),
  // FAILED_PRECONDITION (no CUDA device), UNIMPLEMENTED (CUDA in a build without CUDA).
  static absl::StatusOr<std::unique_ptr<ContiguousParameters>> Create(
      absl::Span<const int64_t> numels, DType dtype, Device device, void* cuda_stream = nullptr);
  ~ContiguousParameters();

  ContiguousParameters(const ContiguousParameters&) = delete;
  ContiguousParameters& operator=(const ContiguousParameters&) = delete;

  // One view per tensor, back to back.
  absl::Span<const TensorView> views() const { return views_; }
  // The whole allocation as one tensor.
  TensorView flat() const { return flat_; }

 private:
  ContiguousParameters() = default;
  std::vector<TensorView> views_;
  TensorView flat_;
  void* base_ = nullptr;
  bool cuda_ = false;  // base_ came from cudaMalloc
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_CONTIGUOUS_PARAMETERS_H_
