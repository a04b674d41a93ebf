// The host logic of one NCCL averaging call, apart from the CUDA and NCCL calls themselves
// (NcclDeviceOps), so that unit tests drive it with several simulated members on a machine
// without a GPU. NcclCommunicator (nccl_communicator.h) supplies the real operations.
//
// One call, on every member alike:
//   1. local preparation: validate the tensors; for the staged path, grow the staging buffer,
//      upload the chunk table (padded layout, staging_layout.h) and launch the gather;
//   2. the layout check, run on EVERY call: one ncclAllReduce(ncclMax) of 8 int64 holding
//      (count, -count, dtype, -dtype, total, -total, failed member + 1, 0). Whether a member
//      takes part never depends on its own history, so the members always issue the same
//      collectives; a local failure of step 1 is carried in it instead of skipping it;
//   3. the decision, identical on every member (DecideLayout): a member failed locally ->
//      every member returns an error and nobody enters the data collective (the communicator
//      stays usable); totals or dtypes differ -> INVALID_ARGUMENT everywhere (same); the padded
//      counts differ (one member reduces in place, or splits its tensors differently) -> every
//      member falls back to the unpadded layout;
//   4. the data ncclAllReduce and, for the staged path, the scatter back. A failure from step 2
//      on aborts the communicator (it is broken from then on).
#ifndef MODELAVG_CLIENT_NCCL_CORE_H_
#define MODELAVG_CLIENT_NCCL_CORE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/communicator_cache.h"
#include "client/staging_layout.h"
#include "client/tensor.h"

namespace modelavg::client {

// What NcclCore needs from CUDA and NCCL. Stream arguments are cudaStream_t.
class NcclDeviceOps {
 public:
  enum class Reduce { kLayoutMax /* int64, ncclMax */, kAverage /* staging code, ncclAvg */ };

  virtual ~NcclDeviceOps() = default;
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
  // An in-place ncclAllReduce of `count` elements; returns once NCCL has accepted it.
  virtual absl::Status AllReduce(void* buffer, size_t count, Reduce op, int32_t staging_code,
                                 void* stream) = 0;
  // Waits until `stream` has drained (deadline, NCCL async errors, generation check).
  virtual absl::Status Wait(void* stream, const char* what) = 0;
  // ncclCommAbort (once).
  virtual void AbortCommunicator() = 0;
};

// A device (or pinned) allocation that only grows. After a failed growth it holds nothing:
// never a freed or null pointer with an old size recorded.
class GrowableBuffer {
 public:
  explicit GrowableBuffer(bool pinned_host = false) : pinned_host_(pinned_host) {}
  // Ensures capacity() >= bytes; `*grown` says whether it (re)allocated.
  absl::Status Reserve(NcclDeviceOps& ops, size_t bytes, bool* grown = nullptr);
  void Release(NcclDeviceOps& ops);
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  const bool pinned_host_;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// The layout check's 8 int64, before and after the ncclMax all-reduce.
inline constexpr int kLayoutWords = 8;
using LayoutSignature = std::array<int64_t, kLayoutWords>;
LayoutSignature EncodeLayout(int64_t count, int32_t staging_code, int64_t total,
                             bool failed_locally, int member);

struct LayoutDecision {
  // Non-OK: every member returns an error (this one, or `local` on the member that failed)
  // without entering the data collective.
  absl::Status status;
  // Every member reduces the unpadded layout (count = total).
  bool unpadded = false;
};
// The same on every member, given the same `reduced` (the all-reduced signatures).
LayoutDecision DecideLayout(const LayoutSignature& reduced, int64_t count, int64_t total,
                            const absl::Status& local);

class NcclCore {
 public:
  // `ops` outlives the core. `device`: the CUDA ordinal every tensor must be on.
  NcclCore(NcclDeviceOps* ops, int member, int device);
  ~NcclCore();  // Release()
  // Frees the buffers (not the communicator); idempotent.
  void Release();
  NcclCore(const NcclCore&) = delete;
  NcclCore& operator=(const NcclCore&) = delete;

  // Allocates the layout check's buffers (so that a member can always take part in it).
  absl::Status Init();
  // One averaging call (see the top of this file). Not thread-safe: the caller serializes.
  absl::Status Run(absl::Span<const TensorView> tensors);
  // Aborts the communicator and makes every later Run return `status`.
  absl::Status Fail(absl::Status status);

  const absl::Status& broken() const { return broken_; }
  bool last_was_zero_copy() const { return last_zero_copy_; }
  // The staging buffer (tests: a failed growth leaves it empty).
  const GrowableBuffer& staging() const { return staging_; }

 private:
  // Step 1 of the staged path with `layout`.
  absl::Status PrepareStaged(const StagingLayout& layout, int32_t code, void* stream);

  NcclDeviceOps* const ops_;
  const int member_;
  const int device_;
  absl::Status broken_;
  bool last_zero_copy_ = false;
  GrowableBuffer sig_device_;
  GrowableBuffer sig_host_{/*pinned_host=*/true};
  GrowableBuffer staging_;
  GrowableBuffer chunks_device_;
  // The chunk table on the device (uploaded when it changes) and the staging bytes it spans.
  std::vector<StagingChunk> chunks_host_;
};

// The coordinator key of the NCCL unique id of bootstrap attempt `attempt` (0, 1, ...) of one
// subgroup in one generation: every attempt publishes a fresh id under its own key.
std::string NcclUniqueIdKey(int32_t attempt);

// Bootstrap step shared by every member: the subgroup's leader (member 0) draws an id with
// `draw` and publishes it under NcclUniqueIdKey(setup.bootstrap_attempt); the others fetch it
// (waiting at most setup.timeout). Returns the id's bytes.
absl::StatusOr<std::string> ExchangeNcclUniqueId(
    const CommunicatorSetup& setup, const std::function<absl::StatusOr<std::string>()>& draw);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_NCCL_CORE_H_
