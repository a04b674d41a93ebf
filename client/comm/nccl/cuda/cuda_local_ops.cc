#include "client/comm/nccl/cuda/cuda_local_ops.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/comm/nccl/cuda/payload_kernels.h"
#include "client/comm/nccl/cuda/finite_kernels.h"
#include "client/comm/nccl/cuda/staging_kernels.h"
#include "client/payload/payload_codec.h"
#include "common/cuda_check.h"
#include "common/status_util.h"

namespace modelavg::client {

#define MODELAVG_ON_DEVICE()              \
  ScopedCudaDevice on_device_(device_);   \
  MODELAVG_RETURN_IF_ERROR(on_device_.status())

absl::Status CudaLocalOps::Malloc(void** p, size_t bytes) {
  MODELAVG_ON_DEVICE();
  *p = nullptr;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(p, bytes > 0 ? bytes : 1));
  return absl::OkStatus();
}

void CudaLocalOps::Free(void* p) {
  ScopedCudaDevice on(device_);
  cudaFree(p);
}

absl::Status CudaLocalOps::MallocHost(void** p, size_t bytes) {
  MODELAVG_ON_DEVICE();
  *p = nullptr;
  // Pinned and, with unified addressing (every 64-bit CUDA platform), mapped: the kernels read
  // and write it through the same pointer.
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMallocHost(p, bytes > 0 ? bytes : 1));
  return absl::OkStatus();
}

void CudaLocalOps::FreeHost(void* p) { cudaFreeHost(p); }

absl::Status CudaLocalOps::Zero(void* p, size_t bytes, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::Copy(void* dst, const void* src, size_t bytes, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::Gather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                                  int32_t staging_code, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchGather(chunks, num_chunks, staging, staging_code,
                                             static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::CheckFinite(const StagingChunk* chunks, int64_t num_chunks,
                                       int32_t* code, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      LaunchCheckFinite(chunks, num_chunks, code, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::WriteFiniteSlots(int32_t* code, void* slots, int members, int member,
                                            int32_t staging_code, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchWriteFiniteSlots(code, slots, members, member,
                                                       staging_code,
                                                       static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::Scatter(const StagingChunk* chunks, int64_t num_chunks,
                                   const void* staging, int32_t staging_code, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchScatter(chunks, num_chunks, staging, staging_code,
                                              static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::AllReduce(void*, size_t, Reduce, int32_t, int, void*) {
  return absl::FailedPreconditionError("CudaLocalOps has no communicator: no collectives");
}

absl::Status CudaLocalOps::Wait(void* stream, const char* what) {
  return WaitLocal(stream, what);
}

absl::Status CudaLocalOps::WaitLocal(void* stream_arg, const char* what) {
  MODELAVG_ON_DEVICE();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_arg);
  const absl::Time deadline = absl::Now() + timeout_;
  for (int polls = 0;; ++polls) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return CudaStatus(q, what, __FILE__, __LINE__);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " did not finish within ", absl::FormatDuration(timeout_)));
    }
    if (polls > 100) absl::SleepFor(absl::Microseconds(20));
  }
}

absl::Status CudaLocalOps::EncodeParts(WireFormat format, const float* in, int64_t numel,
                                       int64_t part, int parts, size_t stride, void* wire,
                                       void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchEncodeParts(static_cast<int32_t>(format.payload),
                                                  format.topk, in, numel, part, parts, stride,
                                                  wire, static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::DecodeSumParts(WireFormat format, const void* wire, int parts,
                                          int64_t part, size_t stride, float scale, float* out,
                                          void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchDecodeSumParts(static_cast<int32_t>(format.payload),
                                                     format.topk, wire, parts, part, stride,
                                                     scale, out,
                                                     static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::DecodeParts(WireFormat format, const void* wire, int64_t numel,
                                       int64_t part, size_t stride, float* out, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(LaunchDecodeParts(static_cast<int32_t>(format.payload),
                                                  format.topk, wire, numel, part, stride, out,
                                                  static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::CreateStream(void** stream) {
  *stream = nullptr;
  MODELAVG_ON_DEVICE();
  cudaStream_t s = nullptr;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = s;
  return absl::OkStatus();
}

void CudaLocalOps::DestroyStream(void* stream) {
  ScopedCudaDevice on(device_);
  if (on.status().ok() && stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

absl::Status CudaLocalOps::CreateEvent(void** event) {
  *event = nullptr;
  MODELAVG_ON_DEVICE();
  cudaEvent_t e = nullptr;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *event = e;
  return absl::OkStatus();
}

void CudaLocalOps::DestroyEvent(void* event) {
  ScopedCudaDevice on(device_);
  if (on.status().ok() && event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

absl::Status CudaLocalOps::RecordEvent(void* event, void* stream) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return absl::OkStatus();
}

absl::Status CudaLocalOps::StreamWaitEvent(void* stream, void* event) {
  MODELAVG_ON_DEVICE();
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                                    static_cast<cudaEvent_t>(event), 0));
  return absl::OkStatus();
}

#undef MODELAVG_ON_DEVICE

}  // namespace modelavg::client
