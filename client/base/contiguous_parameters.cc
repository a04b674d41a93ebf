#include "modelavg/client/contiguous_parameters.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#if MODELAVG_HAVE_CUDA
#include "common/cuda_check.h"
#endif

namespace modelavg::client {

absl::StatusOr<std::unique_ptr<ContiguousParameters>> ContiguousParameters::Create(
    absl::Span<const int64_t> numels, DType dtype, Device device, void* cuda_stream) {
  int64_t total = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("numels[", i, "] is ", numels[i], ": it must be >= 0"));
    }
    total += numels[i];
  }
  const size_t bytes = static_cast<size_t>(total) * DTypeSize(dtype);
  std::unique_ptr<ContiguousParameters> p(new ContiguousParameters());
  if (device.is_host()) {
    p->base_ = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
    if (p->base_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    std::memset(p->base_, 0, bytes);
  } else {
#if MODELAVG_HAVE_CUDA
    ScopedCudaDevice on(device.index);
    MODELAVG_RETURN_IF_ERROR(on.status());
    void* base = nullptr;
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&base, bytes > 0 ? bytes : 1));
    // Owned from here on, freed with cudaFree whatever fails next.
    p->base_ = base;
    p->cuda_ = true;
    // Zeroed on the caller's stream and waited for: whatever stream the caller fills it on
    // next, the zeroing has landed (a cudaMemset on the legacy stream is not ordered with a
    // non-blocking stream, and could land after the caller's first fill).
    MODELAVG_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(base, 0, bytes, static_cast<cudaStream_t>(cuda_stream)));
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(cuda_stream)));
#else
    return absl::UnimplementedError(
        "CUDA parameters need a modelavg built with CUDA (-DMODELAVG_WITH_CUDA=ON)");
#endif
  }
  char* at = static_cast<char*>(p->base_);
  for (int64_t n : numels) {
    p->views_.push_back(TensorView{at, n, dtype, device, cuda_stream});
    at += static_cast<size_t>(n) * DTypeSize(dtype);
  }
  p->flat_ = TensorView{p->base_, total, dtype, device, cuda_stream};
  return p;
}

ContiguousParameters::~ContiguousParameters() {
  if (base_ == nullptr) return;
  if (!cuda_) {
    std::free(base_);
  } else {
#if MODELAVG_HAVE_CUDA
    cudaFree(base_);
#endif
  }
}

}  // namespace modelavg::client
