// The host logic of one NCCL averaging call, apart from the CUDA and NCCL calls themselves
// (NcclDeviceOps), so that unit tests drive it with several simulated members on a machine
// without a GPU. NcclCommunicator (nccl_communicator.h) supplies the real operations.
//
// One call, on every member alike:
//   1. local preparation: validate the tensors and the round's options; for the staged path,
//      grow the staging buffer, upload the chunk table (padded layout, staging_layout.h) and
//      launch the gathers, bucket by bucket on the gather stream, each bucket's event recorded
//      (zeros for a member that does not contribute); for the zero-copy path
//      of a committed round (or of a member that does not contribute), copy the caller's buffer
//      to the device backup;
//   2. the layout agreement, at the communicator's first call (and again only where every member
//      knows it is due alike: a round with another divisor — an admission — or a fragment round,
//      RoundOptions::layout_signature != 0): one ncclAllReduce(ncclMax) of kLayoutWords int64
//      holding max/min pairs of (count, dtype, total, divisor, step) and the failed member + 1.
//      A local failure of step 1 is carried in it instead of skipping it. Once the members
//      agreed, each keeps a local fingerprint of the layout (LayoutFingerprint: every tensor's
//      size and dtype, the staging dtype and the agreed staging plan) and later calls compare it
//      with no collective at all. A member whose fingerprint changed, or that fails locally on
//      such a call, cannot tell its peers in band (they are already in the data all-reduce): it
//      fails loudly (ErrorKind::kLayoutMismatch for a changed layout), aborts its communicator
//      and asks for a new generation (SetNewGenerationRequest), so that the coordinator aborts
//      its peers' collective within about a heartbeat;
//   3. the decision, identical on every member (DecideLayout): a member failed locally ->
//      every member returns an error and nobody enters the data collective (the communicator
//      stays usable); totals or dtypes differ -> INVALID_ARGUMENT everywhere (same); steps or
//      divisors differ -> INTERNAL "averaging different rounds" everywhere (same); the padded
//      counts differ (one member reduces in place, or splits its tensors differently) -> every
//      member falls back to the unpadded layout;
//   4. the data ncclAllReduce, bucket by bucket (BucketRanges of the agreed count: the same on
//      every member), each after its own bucket's gather only; with RoundOptions::commit, the commit (a one-int64 ncclSum of 1
//      per member, which completes only once every member's data all-reduce has); then, for the
//      staged path, the scatter back. A failure from step 2 on aborts the communicator (it is
//      broken from then on); the zero-copy path then restores the caller's buffer from the
//      backup when it has one. A failed commit keeps the result aside (the staging buffer, or
//      the zero-copy path's pending buffer) and leaves the tensors as they were before the call:
//      Adopt writes it into them.
//
// What a round costs beyond a plain one (RoundOptions defaults, whose operations are unchanged):
// commit: one one-int64 all-reduce, two 8-byte copies and one host wait; on the zero-copy path
// also one device-to-device copy of the buffer (the backup, enqueued before the all-reduce with
// no wait of its own) and a device buffer of the same size, kept for later calls.
#ifndef MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_
#define MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator.h"
#include "client/comm/nccl/outer_step_args.h"
#include "client/payload/staging_layout.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// What NcclCore needs from CUDA and NCCL. Stream arguments are cudaStream_t.
class NcclDeviceOps {
 public:
  enum class Reduce {
    kLayoutMax,  // int64, ncclMax
    kAverage,    // staging code; the sum of every member's x / divisor (ncclAvg when the
                 // divisor is the communicator's size, see NcclCommunicator::AllReduce)
    kCommitSum,  // int64, ncclSum
  };

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

  // The outer optimizer's passes on CUDA parameters (device_outer_state.h), enqueued on `stream`. In
  // `chunks` (device memory), staging_offset is the element's offset in the state buffers, all of
  // `state_code` (kStageF32 or kStageF64). OuterDifference: gradient[o + i] := anchor[o + i] -
  // tensor[i]; OuterStep: the SGD step of OuterStepArgs, then tensor[i] := anchor[o + i].
  virtual absl::Status OuterDifference(const StagingChunk* /*chunks*/, int64_t /*num_chunks*/,
                                       const void* /*anchor*/, void* /*gradient*/,
                                       int32_t /*state_code*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no outer optimizer kernels");
  }
  virtual absl::Status OuterStep(const StagingChunk* /*chunks*/, int64_t /*num_chunks*/,
                                 const OuterStepArgs& /*args*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no outer optimizer kernels");
  }
  // Streaming sync's mix (Level.mix): tensor[i] := (1 - mix) * tensor[i] + mix * local[o + i]
  // in double, rounded once to the tensor's dtype; `local` in the state dtype `state_code`.
  virtual absl::Status OuterMix(const StagingChunk* /*chunks*/, int64_t /*num_chunks*/,
                                const void* /*local*/, int32_t /*state_code*/, double /*mix*/,
                                void* /*stream*/) {
    return absl::UnimplementedError("this device has no outer optimizer kernels");
  }
  // Compressed payloads (RoundOptions::payload, client/payload/payload_codec.h), enqueued on `stream`.
  // A buffer of `numel` float32 elements is cut into `parts` parts of `part` elements (the last
  // ones zero-padded); part j's encoding lies at byte j * stride of the wire buffer (stride: a
  // multiple of 16 at least EncodedBytes(payload, part)). The arithmetic is the host codec's,
  // so that every member decodes the same bytes to the same floats.
  // EncodeParts: wire part j := encode(in[j * part, (j + 1) * part)).
  virtual absl::Status EncodeParts(Payload /*payload*/, const float* /*in*/, int64_t /*numel*/,
                                   int64_t /*part*/, int /*parts*/, size_t /*stride*/,
                                   void* /*wire*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no payload kernels");
  }
  // out[i] := (sum over j = 0, 1, ... of decode(wire part j)[i], in float32) * scale, i < part.
  virtual absl::Status DecodeSumParts(Payload /*payload*/, const void* /*wire*/, int /*parts*/,
                                      int64_t /*part*/, size_t /*stride*/, float /*scale*/,
                                      float* /*out*/, void* /*stream*/) {
    return absl::UnimplementedError("this device has no payload kernels");
  }
  // out[j * part + i] := decode(wire part j)[i], for the first `numel` elements.
  virtual absl::Status DecodeParts(Payload /*payload*/, const void* /*wire*/, int64_t /*numel*/,
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
  absl::Status Reserve(NcclDeviceOps& ops, size_t bytes, bool* grown = nullptr);
  void Release(NcclDeviceOps& ops);
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
absl::Status UploadChunkTable(NcclDeviceOps& ops, const std::vector<StagingChunk>& chunks,
                              std::vector<StagingChunk>* host, GrowableBuffer* device,
                              void* stream);

// The layout check's int64 words, before and after the ncclMax all-reduce: (count, -count,
// code, -code, total, -total, failed member + 1, divisor, -divisor, step, -step). A step of -1
// (not checked) is encoded as INT64_MIN in both of its words, so that it agrees with any.
inline constexpr int kLayoutWords = 11;
using LayoutSignature = std::array<int64_t, kLayoutWords>;
LayoutSignature EncodeLayout(int64_t count, int32_t staging_code, int64_t total,
                             bool failed_locally, int member, int divisor = 1,
                             int64_t step = -1);

struct LayoutDecision {
  // Non-OK: every member returns an error (this one, or `local` on the member that failed)
  // without entering the data collective.
  absl::Status status;
  // Every member reduces the unpadded layout (count = total).
  bool unpadded = false;
};
// The same on every member, given the same `reduced` (the all-reduced signatures). `step`:
// this member's (for the message).
LayoutDecision DecideLayout(const LayoutSignature& reduced, int64_t count, int64_t total,
                            const absl::Status& local, int64_t step = -1);

// A cheap local summary of one call's layout as its communicator agreed on it: every tensor's
// element count and dtype, the staging dtype `code` and `count`, the elements the data
// all-reduce reduces (the staging plan: padded or not, in place or staged). Not its addresses:
// the same layout in other buffers is the same layout.
uint64_t LayoutFingerprint(absl::Span<const TensorView> tensors, int32_t code, int64_t count);

class NcclCore {
 public:
  // `ops` outlives the core. `member` of `size`; `device`: the CUDA ordinal every tensor must
  // be on.
  // `bucket_bytes`: the data all-reduce's bucket (kStagingBucketBytes; every member of a
  // communicator must use the same).
  NcclCore(NcclDeviceOps* ops, int member, int size, int device,
           size_t bucket_bytes = kStagingBucketBytes);
  ~NcclCore();  // Release()
  // Frees the buffers, streams and events (not the communicator); idempotent.
  void Release();
  NcclCore(const NcclCore&) = delete;
  NcclCore& operator=(const NcclCore&) = delete;

  // Allocates the layout check's buffers (so that a member can always take part in it).
  absl::Status Init();
  // One averaging call (see the top of this file), as Communicator::AllReduceAverage. Not
  // thread-safe: the caller serializes. `outcome` may be null.
  absl::Status Run(absl::Span<const TensorView> tensors, const RoundOptions& options,
                   RoundOutcome* outcome);
  absl::Status Run(absl::Span<const TensorView> tensors) {
    return Run(tensors, RoundOptions{}, nullptr);
  }
  // Communicator::AdoptPendingResult: writes the result the last round kept aside into
  // `tensors` and forgets it. Works on a broken core (local copies only).
  absl::Status Adopt(absl::Span<const TensorView> tensors);
  // Aborts the communicator and makes every later Run return `status`.
  absl::Status Fail(absl::Status status);
  // Called (on the calling thread, once per failure) with the error when a member fails after
  // its communicator agreed on the layout, where its peers cannot learn it in band: moves the
  // job to a new generation, so that their collective is aborted (Client::FailOut). May be
  // empty (single-process uses: the failure is still reported and the communicator aborted).
  void SetNewGenerationRequest(std::function<void(const absl::Status&)> request) {
    request_new_generation_ = std::move(request);
  }
  // Whether the members agreed on a layout (a first call succeeded): later calls with the same
  // fingerprint run no agreement collective.
  bool layout_agreed() const { return agreed_; }

  // Tests (client/comm/fault_injection.h): the faults this core takes. Null: none.
  void set_faults(std::shared_ptr<FaultInjection> faults) { faults_ = std::move(faults); }

  const absl::Status& broken() const { return broken_; }
  bool last_was_zero_copy() const { return last_zero_copy_; }
  bool has_pending_result() const { return pending_ != Pending::kNone; }
  // The staging buffer (tests: a failed growth leaves it empty).
  const GrowableBuffer& staging() const { return staging_; }
  // The zero-copy path's backup of the caller's buffer (committed rounds).
  const GrowableBuffer& backup() const { return backup_; }
  // Bytes this member has handed to NCCL in data collectives (Communicator::bytes_sent): a ring
  // all-reduce of B bytes counts 2 (n - 1) / n B, a compressed round 2 (n - 1) wire parts.
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  // The layout of `tensors` in the staging buffer, cut into this core's buckets.
  StagingLayout MakeLayout(absl::Span<const TensorView> tensors, int32_t code, bool pad) const;
  int64_t BucketElems(int32_t code) const;
  // Step 1 of the staged path with `layout`: the gather (bucket by bucket on the gather stream,
  // each bucket's event recorded), or zeros when `!contribute`.
  absl::Status PrepareStaged(const StagingLayout& layout, int32_t code, bool contribute,
                             void* stream);
  // Makes the device chunk table `layout`'s (uploading it when it differs). `staging_bytes`:
  // the staging capacity the table needs; the staging buffer is grown (and zeroed) only when
  // `may_grow`.
  absl::Status UseTable(const StagingLayout& layout, size_t staging_bytes, bool may_grow,
                        void* stream);
  // The data all-reduce of `count` elements at `buffer`, bucket by bucket on `stream`, each
  // after its gather (when the gathers are pending on the gather stream).
  absl::Status ReduceBuckets(void* buffer, int64_t count, int32_t code, int divisor,
                             void* stream);
  // The data collective of a compressed round (RoundOptions::payload) over `count` float32
  // elements at `buffer`, in place: an all-to-all of every member's encoded parts, a float32 sum
  // of the decoded parts of this member's part divided by `divisor`, an all-gather of the
  // encoded results, and every member decodes the same bytes (bit-identical results).
  absl::Status ReduceCompressed(void* buffer, int64_t count, Payload payload, int divisor,
                                void* stream);
  // Makes `stream`'s later work wait for every gather enqueued so far (nothing when none is
  // pending).
  absl::Status JoinGathers(void* stream);
  // After a failed call: JoinGathers, then waits for them (a deadline, local work only), so
  // that nothing of the call still reads the caller's tensors once it returns.
  void SettleGathers(void* stream);
  // The commit: OK when every member's data all-reduce succeeded.
  // The members confirm the round at `step` (RoundOptions::step).
  absl::Status Commit(void* stream, int64_t step);
  // Copies the backup back into the caller's `bytes` at `data` and waits.
  absl::Status Restore(void* data, size_t bytes, void* stream);
  // After a failure from the data collective on: aborts the communicator and, on the zero-copy
  // path with a backup, restores the caller's `bytes` at `data`. Returns the status to report.
  absl::Status FailAndRestore(absl::Status status, void* data, size_t bytes, bool restore,
                              void* stream);

  // A call after the agreement whose layout or preparation failed on this member only: aborts
  // the communicator, asks for a new generation and returns the error.
  absl::Status FailAlone(absl::Status status);

  enum class Pending { kNone, kStaged, kZeroCopy };

  NcclDeviceOps* const ops_;
  const int member_;
  const int size_;
  const int device_;
  const size_t bucket_bytes_;
  absl::Status broken_;
  bool last_zero_copy_ = false;
  std::shared_ptr<FaultInjection> faults_;
  GrowableBuffer sig_device_;
  GrowableBuffer sig_host_{/*pinned_host=*/true};
  GrowableBuffer staging_;
  GrowableBuffer chunks_device_;
  // The zero-copy path's backup of the caller's buffer, and its kept result.
  GrowableBuffer backup_;
  GrowableBuffer pending_buffer_;
  // A compressed round's wire buffers (send, receive) and its float32 part.
  GrowableBuffer wire_send_;
  GrowableBuffer wire_recv_;
  GrowableBuffer wire_part_;
  int64_t bytes_sent_ = 0;
  // A result kept aside by a failed commit: in staging_ (pending_elems_ elements, padded or not) or in
  // pending_buffer_ (pending_total_ elements of pending_code_).
  Pending pending_ = Pending::kNone;
  bool pending_padded_ = true;
  int32_t pending_code_ = 0;
  int64_t pending_total_ = 0;
  int64_t pending_elems_ = 0;
  // The chunk table on the device (uploaded when it changes) and the staging bytes it spans.
  std::vector<StagingChunk> chunks_host_;
  // The layout the members agreed on (step 2), kept as a local fingerprint.
  bool agreed_ = false;
  uint64_t agreed_fingerprint_ = 0;
  int agreed_divisor_ = 0;
  bool agreed_unpadded_ = false;
  size_t agreed_tensors_ = 0;
  int64_t agreed_total_ = 0;
  std::function<void(const absl::Status&)> request_new_generation_;
  // The pipeline: the gather stream (null: the caller's), the event that orders the gathers after
  // the caller's earlier work, and one event per bucket.
  bool streams_made_ = false;
  void* gather_stream_ = nullptr;
  void* start_event_ = nullptr;
  std::vector<void*> gathered_;
  // Gathers enqueued on gather_stream_ that the caller's stream does not wait for yet.
  bool gathers_pending_ = false;
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

#endif  // MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_
