// Averaging of CUDA tensors with NCCL (ncclAllReduce with ncclAvg). Only built with
// MODELAVG_HAVE_CUDA.
//
// Bootstrap: the lowest rank of the subgroup calls ncclGetUniqueId and publishes it with
// PublishCommId under the attempt's key (NcclUniqueIdKey); the others fetch it with GetCommId;
// all call ncclCommInitRankConfig with blocking = 0, so that both the init and every collective
// can be abandoned with ncclCommAbort.
// Averaging (the host logic is NcclCore, nccl_core.h; the round protocol round_agreement.h's):
// the first call, and every call where the members know alike that it is due, first all-reduces
// a small int64 layout signature (layout, step, divisor, fragment split), which also carries
// local failures, so that the members always issue the same collectives. When the tensors are back to back in one buffer of one dtype (see
// ContiguousParameters) the all-reduce then runs in place with no copy; otherwise one fused
// gather kernel fills a persistent staging buffer (every tensor at a 16-byte aligned offset) and
// one fused scatter copies the result back; bfloat16 is reduced in float32. The staged path
// gathers bucket by bucket (kStagingBucketBytes) on a stream of its own, and the all-reduce of
// bucket k waits only for bucket k's gather (an event), so that the gathers overlap the
// reduction; the scatter follows the whole reduction. All other work is ordered on the first
// tensor's stream; the host waits by polling cudaStreamQuery and
// ncclCommGetAsyncError against a deadline (never cudaDeviceSynchronize) and aborts the
// communicator on a timeout or a generation change. Every entry point restores the calling
// thread's current CUDA device before returning.
#ifndef MODELAVG_CLIENT_COMM_NCCL_CUDA_NCCL_COMMUNICATOR_H_
#define MODELAVG_CLIENT_COMM_NCCL_CUDA_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/comm/communicator.h"
#include "client/comm/nccl/cuda/cuda_local_ops.h"
#include "client/comm/nccl/cuda/staging_kernels.h"
#include "client/comm/nccl/nccl_core.h"

namespace modelavg::client {

// The device-local operations (memory, copies, kernels, streams, events, the local wait) are
// CudaLocalOps'; this class adds the collectives on its communicator.
class NcclCommunicator : public Communicator, private CudaLocalOps {
 public:
  // Bootstraps the subgroup's communicator on CUDA device `device` (attempt
  // setup.bootstrap_attempt).
  // Errors: FAILED_PRECONDITION (no CUDA device or driver; stale generation), DEADLINE_EXCEEDED
  // (the unique id or a member's init did not arrive within setup.timeout), ABORTED (the
  // generation changed while waiting), INTERNAL (NCCL/CUDA errors, with the call site).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const CommunicatorSetup& setup,
                                                                  int device);
  // Like Create, with a unique id obtained elsewhere (tests, single-process benchmarks).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateWithId(
      const ncclUniqueId& id, int member, int size, int device, absl::Duration timeout,
      std::function<absl::Status()> check_alive);

  // Aborts the communicator if it is broken, finalizes and destroys it otherwise; frees the
  // staging buffers.
  ~NcclCommunicator() override;

  // Errors as Communicator::AllReduceAverage, except that a failure every member learns in the
  // layout check (a member's local failure, different layouts, different rounds) leaves the
  // communicator usable. Every RoundOptions is supported (see nccl_core.h): options.step and the
  // divisor are checked on every call, in the layout check; a member that does not contribute
  // reduces zeros; a divisor other than size() runs ncclAvg's arithmetic for that many members
  // (see AllReduce). The staged path leaves the tensors untouched by a failure. The zero-copy
  // path (one contiguous buffer) reduces the caller's memory in place: in a plain round a
  // failure mid-collective leaves it undefined (the communicator is aborted); with
  // options.commit (elastic jobs) it is first copied to a device backup (one device-to-device
  // copy per call, and a device buffer of the parameters' size kept for later calls) and
  // restored on any failure, so it is untouched too.
  using Communicator::AllReduceAverage;
  absl::Status AllReduceAverage(absl::Span<const TensorView> tensors, const RoundOptions& options,
                                RoundOutcome* outcome) override;
  // Writes the result a failed commit kept aside (staging buffer or pending device buffer)
  // into `tensors`; works on the aborted communicator (local copies only).
  absl::Status AdoptPendingResult(absl::Span<const TensorView> tensors) override;

  // A raw in-place ncclAllReduce of one buffer (ncclAvg, or ncclSum with `sum`), waited for
  // (benchmark baseline; tests of NCCL's arithmetic).
  absl::Status RawAllReduce(void* data, int64_t numel, DType dtype, cudaStream_t stream,
                            bool sum = false);
  absl::Status RawAllReduceAvg(void* data, int64_t numel, DType dtype, cudaStream_t stream) {
    return RawAllReduce(data, numel, dtype, stream);
  }

  // Whether the last AllReduceAverage ran without staging copies.
  bool last_was_zero_copy() const;

  // Bytes handed to NCCL in averaging rounds (NcclCore::bytes_sent).
  int64_t bytes_sent() const override;

  int rank() const override { return member_; }
  int size() const override { return size_; }

  // Generation change (Communicator::Abort). Only records `why`: the thread waiting on the
  // collective sees it at its next poll (tens of microseconds) and fails, which aborts the
  // communicator (ncclCommAbort) on that thread, the one that could still be polling it.
  void Abort(const absl::Status& why) override;

 private:
  // The reason given to Abort(why), or OK.
  absl::Status AbortRequested() const;

  NcclCommunicator(ncclComm_t comm, int member, int size, int device, absl::Duration timeout,
                   std::function<absl::Status()> check_alive);

  // The collectives of DeviceOps (called with mu_ held, from NcclCore).
  // kAverage: ncclAvg when `divisor` is size(), otherwise a ncclRedOpCreatePreMulSum
  // operation with 1/divisor (created and destroyed per call: admission rounds only).
  absl::Status AllReduce(void* buffer, size_t count, Reduce op, int32_t staging_code,
                         int divisor, void* stream) override;
  // The byte collectives of compressed payloads: an all-to-all of ncclSend/ncclRecv pairs in one
  // group, ncclAllGather.
  absl::Status AllToAll(const void* send, void* recv, size_t bytes, void* stream) override;
  absl::Status AllGather(const void* send, void* recv, size_t bytes, void* stream) override;
  // Polls `stream` until it drains or the deadline, watching NCCL's async errors, Abort and
  // the generation (check_alive_) too.
  absl::Status Wait(void* stream, const char* what) override;
  void AbortCommunicator() override;

  // Waits for a non-blocking NCCL call to leave ncclInProgress.
  absl::Status WaitNcclReady(const char* what);

  ncclComm_t comm_;
  const int member_;
  const int size_;
  const std::function<absl::Status()> check_alive_;
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> bytes_sent_{0};
  // Abort(why) from another thread; polled by Wait and WaitNcclReady.
  std::atomic<bool> abort_requested_{false};
  mutable absl::Mutex abort_mu_;
  absl::Status abort_why_ ABSL_GUARDED_BY(abort_mu_);
  mutable absl::Mutex mu_;
  NcclCore core_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_CUDA_NCCL_COMMUNICATOR_H_
