// CUDA and NCCL error checks that *return* an absl::Status naming the call site, instead of
// aborting the process. Include only in code built with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_COMMON_CUDA_CHECK_H_
#define MODELAVG_COMMON_CUDA_CHECK_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace modelavg {

inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // No driver or no device is an environment fact, not a bug: say so plainly.
  const absl::StatusCode code = (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
                                    ? absl::StatusCode::kFailedPrecondition
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, " failed at ", file, ":", line, ": ",
                                         cudaGetErrorName(err), " (", cudaGetErrorString(err),
                                         ")"));
}

inline absl::Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line) {
  if (res == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode code = (res == ncclInvalidArgument || res == ncclInvalidUsage)
                                    ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(expr, " failed at ", file, ":", line, ": ",
                                         ncclGetErrorString(res), " (", ncclGetLastError(nullptr),
                                         ")"));
}

// Sets the calling thread's current CUDA device for a scope and restores the previous one: the
// library never leaves a trainer's thread on another device.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice", __FILE__, __LINE__);
    }
  }
  ~ScopedCudaDevice() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      cudaSetDevice(previous_);
    }
  }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  // cudaSetDevice's result.
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace modelavg

#define MODELAVG_CUDA_RETURN_IF_ERROR(expr)                                           \
  do {                                                                                \
    ::absl::Status _s = ::modelavg::CudaStatus((expr), #expr, __FILE__, __LINE__);    \
    if (!_s.ok()) return _s;                                                          \
  } while (0)

#define MODELAVG_NCCL_RETURN_IF_ERROR(expr)                                           \
  do {                                                                                \
    ::absl::Status _s = ::modelavg::NcclStatus((expr), #expr, __FILE__, __LINE__);    \
    if (!_s.ok()) return _s;                                                          \
  } while (0)

#endif  // MODELAVG_COMMON_CUDA_CHECK_H_
