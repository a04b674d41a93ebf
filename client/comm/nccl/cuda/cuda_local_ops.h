// The device operations of DeviceOps (device_ops.h) on one CUDA device, without a
// communicator: memory, copies, streams and events, the staging, payload and finite check
// kernels, and the local wait. What the averager's outer state on CUDA parameters (device_outer_state.h)
// runs on, apart from any communicator, since that state outlives every generation's
// communicators; here the collective operations (AllReduce, Wait) fail with FAILED_PRECONDITION.
// NcclCommunicator (nccl_communicator.h) builds on it and supplies the collectives. Only built
// with MODELAVG_HAVE_CUDA.
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_CUDA_LOCAL_OPS_H_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_CUDA_LOCAL_OPS_H_

#include "absl/time/time.h"
#include "client/comm/nccl/device_ops.h"

namespace modelavg::client {

class CudaLocalOps : public DeviceOps {
 public:
  // Every call runs on CUDA device `device` (restoring the thread's current device after);
  // WaitLocal gives up after `timeout`.
  CudaLocalOps(int device, absl::Duration timeout) : device_(device), timeout_(timeout) {}

  int device() const { return device_; }
  absl::Duration timeout() const { return timeout_; }

  absl::Status Malloc(void** p, size_t bytes) override;
  void Free(void* p) override;
  absl::Status MallocHost(void** p, size_t bytes) override;
  void FreeHost(void* p) override;
  absl::Status Zero(void* p, size_t bytes, void* stream) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes, void* stream) override;
  absl::Status Gather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                      int32_t staging_code, void* stream) override;
  absl::Status Scatter(const StagingChunk* chunks, int64_t num_chunks, const void* staging,
                       int32_t staging_code, void* stream) override;
  // The finite check's kernels (finite_kernels.h).
  absl::Status CheckFinite(const StagingChunk* chunks, int64_t num_chunks, int32_t* code,
                           void* stream) override;
  absl::Status WriteFiniteSlots(int32_t* code, void* slots, int members, int member,
                                int32_t staging_code, void* stream) override;
  absl::Status AllReduce(void* buffer, size_t count, Reduce op, int32_t staging_code,
                         int divisor, void* stream) override;
  absl::Status Wait(void* stream, const char* what) override;
  absl::Status WaitLocal(void* stream, const char* what) override;
  void AbortCommunicator() override {}
  // The codec kernels of compressed payloads (payload_kernels.h).
  absl::Status EncodeParts(WireFormat format, const float* in, int64_t numel, int64_t part,
                           int parts, size_t stride, void* wire, void* stream) override;
  absl::Status DecodeSumParts(WireFormat format, const void* wire, int parts, int64_t part,
                              size_t stride, float scale, float* out, void* stream) override;
  absl::Status DecodeParts(WireFormat format, const void* wire, int64_t numel, int64_t part,
                           size_t stride, float* out, void* stream) override;
  // A non-blocking stream (a streaming level's background all-reduce runs on one).
  absl::Status CreateStream(void** stream) override;
  void DestroyStream(void* stream) override;
  // An event without timing.
  absl::Status CreateEvent(void** event) override;
  void DestroyEvent(void* event) override;
  absl::Status RecordEvent(void* event, void* stream) override;
  absl::Status StreamWaitEvent(void* stream, void* event) override;

 private:
  const int device_;
  const absl::Duration timeout_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_CUDA_LOCAL_OPS_H_
