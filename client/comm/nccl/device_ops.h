// What the NCCL round (nccl_core.h) needs from CUDA and NCCL, as an interface (DeviceOps):
// NcclCommunicator supplies the real operations (cuda/), tests a simulated device. Also the
// device buffers that only grow (GrowableBuffer) and the staging chunk table's upload.
#ifndef MODELAVG_CLIENT_COMM_NCCL_DEVICE_OPS_H_
#define MODELAVG_CLIENT_COMM_NCCL_DEVICE_OPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// What NcclCore needs from CUDA and NCCL. Stream arguments are cudaStream_t.
class DeviceOps {
 public:
  enum class Reduce {
    kLayoutMax,  // int64, ncclMax
    kAverage,    // staging code; the sum of every member's x / divisor (ncclAvg when the
                 // divisor is the communicator's size, see NcclCommunicator::AllReduce)
    kCommitSum,  // int64, ncclSum
  };

  virtual ~DeviceOps() = default;
  virtual absl::Status Malloc(void** p, size_t bytes) = 0;      // device memory
  virtual void Free(void* p) = 0;
  virtual absl::Status MallocHost(void** p, size_t bytes) = 0;  // pinned host memory
  virtual void FreeHost(void* p) = 0;
  // Enqueued on `stream`.
  virtual absl::Status Zero(void* p, size_t bytes, void* stream) = 0;
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes, void* stream) = 0;
  virtual absl::Status Gather(const StagingChunk* chunks, int64_t num_chunks, void* staging,
                              int32_t staging_code, void* stream) = 0;
  virtual absl::Status Scatter(const StagingChunk* chunks, int64_t num_chunks,
                               const void* staging, int32_t staging_code, void* stream) = 0;
  // The finite check (client/comm/finite_check.h), enqueued on `stream`. CheckFinite: the
  // smallest finding code (finite_scan.h: tensor_index * 4 + value) of a non-finite element of
  // the caller's tensors in `chunks`, min-reduced into the int32 at `code` (device memory, left
  // as it is where every element is finite). WriteFiniteSlots: the members' slots at `slots`
  // (FiniteSlotWidth elements each, of `staging_code`): the code at `code` (INT32_MAX: none) as
  // `member`'s, zeros as the others', then *code := INT32_MAX for the next round.
  virtual absl::Status CheckFinite(const StagingChunk* /*chunks*/, int64_t /*num_chunks*/,
                                   int32_t* /*code*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no finite check kernels");
  }
  virtual absl::Status WriteFiniteSlots(int32_t* /*code*/, void* /*slots*/, int /*members*/,
                                        int /*member*/, int32_t /*staging_code*/,
                                        void* /*stream*/) {
    return absl::UnimplementedError("this device has no finite check kernels");
  }
  // An in-place ncclAllReduce of `count` elements; returns once NCCL has accepted it.
  // `divisor` (kAverage only; >= 1): what the sum is divided by.
  virtual absl::Status AllReduce(void* buffer, size_t count, Reduce op, int32_t staging_code,
                                 int divisor, void* stream) = 0;
  // Waits until `stream` has drained (deadline, NCCL async errors, generation check).
  virtual absl::Status Wait(void* stream, const char* what) = 0;
  // Waits until `stream` has drained, for local work only (copies, kernels): a deadline, but no
  // NCCL call and no generation check, so that it works on an aborted communicator (restoring
  // the backup, adopting a kept result).
  virtual absl::Status WaitLocal(void* stream, const char* what) = 0;
  // ncclCommAbort (once).
  virtual void AbortCommunicator() = 0;

  // Compressed payloads (RoundOptions::payload and topk, client/payload/payload_codec.h),
  // enqueued on `stream`. A buffer of `numel` float32 elements is cut into `parts` parts of
  // `part` elements (the last ones zero-padded); part j's encoding in `format` lies at byte
  // j * stride of the wire buffer (stride: a multiple of 16 at least EncodedBytes(format,
  // part)). The bytes and the arithmetic are the host codec's, bit for bit, so that every
  // member decodes the same bytes to the same floats.
  // EncodeParts: wire part j := encode(in[j * part, (j + 1) * part)).
  virtual absl::Status EncodeParts(WireFormat /*format*/, const float* /*in*/, int64_t /*numel*/,
                                   int64_t /*part*/, int /*parts*/, size_t /*stride*/,
                                   void* /*wire*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no payload kernels");
  }
  // out[i] := (sum over j = 0, 1, ... of decode(wire part j)[i], in float32) * scale, i < part.
  virtual absl::Status DecodeSumParts(WireFormat /*format*/, const void* /*wire*/, int /*parts*/,
                                      int64_t /*part*/, size_t /*stride*/, float /*scale*/,
                                      float* /*out*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no payload kernels");
  }
  // out[j * part + i] := decode(wire part j)[i], for the first `numel` elements.
  virtual absl::Status DecodeParts(WireFormat /*format*/, const void* /*wire*/, int64_t /*numel*/,
                                   int64_t /*part*/, size_t /*stride*/, float* /*out*/,
                                   void* /*stream*/) {
    return absl::UnimplementedError("this device has no payload kernels");
  }
  // The byte collectives of a compressed round: AllToAll sends bytes [j * bytes, (j + 1) *
  // bytes) of `send` to member j and receives member j's into the same range of `recv`;
  // AllGather puts member j's `bytes` of `send` at j * bytes of `recv`. Return once NCCL has
  // accepted them (Wait reports their completion).
  virtual absl::Status AllToAll(const void* /*send*/, void* /*recv*/, size_t /*bytes*/,
                                void* /*stream*/) {
    return absl::UnimplementedError("this communicator has no all-to-all");
  }
  virtual absl::Status AllGather(const void* /*send*/, void* /*recv*/, size_t /*bytes*/,
                                 void* /*stream*/) {
    return absl::UnimplementedError("this communicator has no all-gather");
  }

  // The staged path's pipeline: a stream of its own for the gathers (cudaStream_t,
  // non-blocking) and events between it and the caller's stream (cudaEvent_t, no timing).
  // A device without streams of its own keeps these defaults: *stream = nullptr means "none",
  // and the pipeline then runs on the caller's stream, in order.
  virtual absl::Status CreateStream(void** stream) {
    *stream = nullptr;
    return absl::OkStatus();
  }
  virtual void DestroyStream(void* /*stream*/) {}
  virtual absl::Status CreateEvent(void** event) {
    *event = nullptr;
    return absl::OkStatus();
  }
  virtual void DestroyEvent(void* /*event*/) {}
  // Enqueued on `stream`: the event fires once the work enqueued on it before has run.
  virtual absl::Status RecordEvent(void* /*event*/, void* /*stream*/) { return absl::OkStatus(); }
  // `stream`'s later work waits until `event` (as last recorded) fires.
  virtual absl::Status StreamWaitEvent(void* /*stream*/, void* /*event*/) {
    return absl::OkStatus();
  }
};

// The staged path's bucket: the data all-reduce runs in pieces of this many bytes (one piece
// per bucket), each gathered on a stream of its own, so that bucket k + 1 is gathered while
// bucket k is reduced. Large enough that NCCL runs each piece at full bandwidth.
inline constexpr size_t kStagingBucketBytes = size_t{32} << 20;

// A device (or pinned) allocation that only grows. After a failed growth it holds nothing:
// never a freed or null pointer with an old size recorded.
class GrowableBuffer {
 public:
  explicit GrowableBuffer(bool pinned_host = false) : pinned_host_(pinned_host) {}
  // Ensures capacity() >= bytes; `*grown` says whether it (re)allocated.
  absl::Status Reserve(DeviceOps& ops, size_t bytes, bool* grown = nullptr);
  void Release(DeviceOps& ops);
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  const bool pinned_host_;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Uploads a staging chunk table to `device` (grown as needed) on `stream`. The upload may read
// the host table asynchronously: `host` keeps it, unchanged until the next upload (every call
// waits on the stream before that); it is cleared when the upload fails.
absl::Status UploadChunkTable(DeviceOps& ops, const std::vector<StagingChunk>& chunks,
                              std::vector<StagingChunk>* host, GrowableBuffer* device,
                              void* stream);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_DEVICE_OPS_H_
