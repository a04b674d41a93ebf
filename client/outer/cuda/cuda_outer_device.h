// The outer states' device on CUDA (OuterDevice's LocalDeviceFactory, outer_device.h): the
// device operations of CudaLocalOps and the outer optimizer's kernels (outer_kernels.h) on one
// CUDA device. Only built with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_OUTER_CUDA_CUDA_OUTER_DEVICE_H_
#define MODELAVG_CLIENT_OUTER_CUDA_CUDA_OUTER_DEVICE_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/outer/outer_device.h"
#include "client/outer/outer_kernels.h"

namespace modelavg::client {

// The kernels of outer_kernels.h on CUDA device `device` (restoring the thread's current device
// after each launch).
class CudaOuterKernels : public OuterKernels {
 public:
  explicit CudaOuterKernels(int device) : device_(device) {}
  absl::Status OuterDifference(const StagingChunk* chunks, int64_t num_chunks, const void* anchor,
                               void* gradient, int32_t state_code, void* stream) override;
  absl::Status OuterStep(const StagingChunk* chunks, int64_t num_chunks,
                         const OuterStepArgs& args, void* stream) override;
  absl::Status OuterMix(const StagingChunk* chunks, int64_t num_chunks, const void* local,
                        int32_t state_code, double mix, void* stream) override;
  absl::Status FeedbackAdd(float* u, const float* e, int64_t n, double beta,
                           void* stream) override;
  absl::Status FeedbackResidual(const float* u, const float* c, int64_t n, float* e,
                                void* stream) override;
  absl::Status ScaleCopy(const void* from, void* to, int64_t n, int32_t dtype_code, double scale,
                         void* stream) override;

 private:
  const int device_;
};

// CUDA device `index`: CudaLocalOps (waits give up after `timeout`) and CudaOuterKernels.
absl::StatusOr<LocalDevice> OpenCudaOuterDevice(int index, absl::Duration timeout);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_CUDA_CUDA_OUTER_DEVICE_H_
