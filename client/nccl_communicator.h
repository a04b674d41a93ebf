// Averaging of CUDA tensors with NCCL (ncclAllReduce with ncclAvg). Only built with
// MODELAVG_HAVE_CUDA.
//
// Bootstrap: the lowest rank of the subgroup calls ncclGetUniqueId and publishes it with
// PublishCommId; the others fetch it with GetCommId; all call ncclCommInitRankConfig with
// blocking = 0, so that both the init and every collective can be abandoned with ncclCommAbort.
// Averaging: when the tensors are back to back in one buffer of one dtype (see
// ContiguousParameters) the all-reduce runs in place with no copy; otherwise one fused gather
// kernel fills a persistent staging buffer and one fused scatter copies the result back. All
// work is ordered on the first tensor's stream; the host waits by polling cudaStreamQuery and
// ncclCommGetAsyncError against a deadline (never cudaDeviceSynchronize) and aborts the
// communicator on a timeout or a generation change.
#ifndef MODELAVG_CLIENT_NCCL_COMMUNICATOR_H_
#define MODELAVG_CLIENT_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/communicator.h"
#include "client/communicator_cache.h"
#include "client/staging_kernels.h"

namespace modelavg::client {

class NcclCommunicator : public Communicator {
 public:
  // Bootstraps the subgroup's communicator on CUDA device `device`.
  // Errors: FAILED_PRECONDITION (no CUDA device or driver; stale generation), DEADLINE_EXCEEDED
  // (the unique id or a member's init did not arrive within setup.timeout), ABORTED (the
  // generation changed while waiting), INTERNAL (NCCL/CUDA errors, with the call site).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const CommunicatorSetup& setup,
                                                                  int device);
  // Like Create, with a unique id obtained elsewhere (tests, single-process benchmarks).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateWithId(
      const ncclUniqueId& id, int member, int size, int device, absl::Duration timeout,
      std::function<absl::Status()> check_alive);

  // Aborts the communicator if it is broken, destroys it otherwise; frees the staging buffer.
  ~NcclCommunicator() override;

  // Errors as Communicator::AllReduceAverage. The zero-copy path (one contiguous buffer)
  // reduces the caller's memory in place: a failure mid-collective leaves it undefined (the
  // communicator is aborted); the staged path leaves it untouched.
  absl::Status AllReduceAverage(absl::Span<const TensorView> tensors) override;

  // A raw in-place ncclAllReduce(ncclAvg) of one buffer, waited for (benchmark baseline).
  absl::Status RawAllReduceAvg(void* data, int64_t numel, DType dtype, cudaStream_t stream);

  // Whether the last AllReduceAverage ran without staging copies.
  bool last_was_zero_copy() const { return last_zero_copy_; }

  int rank() const override { return member_; }
  int size() const override { return size_; }

  // Generation change (see Communicator::Abort). Only records `why`: the thread waiting on the
  // collective notices it at its next poll (tens of microseconds) and calls ncclCommAbort
  // itself, since it could still be polling a communicator freed from here.
  void Abort(const absl::Status& why) override;

 private:
  // The Abort reason, or OK.
  absl::Status AbortRequested() const;
  NcclCommunicator(ncclComm_t comm, int member, int size, int device, absl::Duration timeout,
                   std::function<absl::Status()> check_alive);
  // Waits until `stream` has drained, failing (and aborting) on an NCCL error, the deadline or a
  // generation change.
  absl::Status Wait(cudaStream_t stream, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for a non-blocking NCCL call to leave ncclInProgress.
  absl::Status WaitNcclReady(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckLayout(int64_t numel, int32_t dtype, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Fail(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Run(absl::Span<const TensorView> tensors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ncclComm_t comm_;
  const int member_;
  const int size_;
  const int device_;
  const absl::Duration timeout_;
  const std::function<absl::Status()> check_alive_;
  absl::Mutex mu_;
  // Set by Abort from another thread; polled by Wait / WaitNcclReady.
  std::atomic<bool> abort_requested_{false};
  mutable absl::Mutex abort_mu_;
  absl::Status abort_why_ ABSL_GUARDED_BY(abort_mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool last_zero_copy_ = false;
  // Layout verified across the members.
  bool layout_checked_ ABSL_GUARDED_BY(mu_) = false;
  int64_t checked_numel_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t checked_dtype_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t* sig_device_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t* sig_host_ ABSL_GUARDED_BY(mu_) = nullptr;  // pinned
  // Persistent staging and the chunk table of the last layout (device + pinned host copy).
  void* staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  StagingChunk* chunks_device_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t chunks_capacity_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<StagingChunk> chunks_host_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_NCCL_COMMUNICATOR_H_
