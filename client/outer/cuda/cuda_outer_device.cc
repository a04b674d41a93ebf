#include "client/outer/cuda/cuda_outer_device.h"

#include <cuda_runtime_api.h>

#include <memory>

#include "client/comm/nccl/cuda/cuda_local_ops.h"
#include "client/outer/cuda/outer_kernels.h"
#include "common/cuda_check.h"
#include "common/status_util.h"

namespace modelavg::client {

#define MODELAVG_ON_DEVICE()              \
  ScopedCudaDevice on_device_(device_);   \
  MODELAVG_RETURN_IF_ERROR(on_device_.status())

absl::Status CudaOuterKernels::OuterDifference(const StagingChunk* chunks, int64_t num_chunks,
                                               const void* anchor, void* gradient,
                                               int32_t state_code, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchOuterDifference(chunks, num_chunks, anchor, gradient,
                                                      state_code,
                                                      static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaOuterKernels::OuterStep(const StagingChunk* chunks, int64_t num_chunks,
                                         const OuterStepArgs& args, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      LaunchOuterStep(chunks, num_chunks, args, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaOuterKernels::OuterMix(const StagingChunk* chunks, int64_t num_chunks,
                                        const void* local, int32_t state_code, double mix,
                                        void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchOuterMix(chunks, num_chunks, local, state_code, mix,
                                               static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaOuterKernels::FeedbackAdd(float* u, const float* e, int64_t n, double beta,
                                           void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      LaunchFeedbackAdd(u, e, n, beta, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaOuterKernels::FeedbackResidual(const float* u, const float* c, int64_t n,
                                                float* e, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      LaunchFeedbackResidual(u, c, n, e, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaOuterKernels::ScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code,
                                         double scale, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      LaunchScaleCopy(from, to, n, dtype_code, scale, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::StatusOr<LocalDevice> OpenCudaOuterDevice(int index, absl::Duration timeout) {
  LocalDevice d;
  d.ops = std::make_unique<CudaLocalOps>(index, timeout);
  d.kernels = std::make_unique<CudaOuterKernels>(index);
  return d;
}

}  // namespace modelavg::client
