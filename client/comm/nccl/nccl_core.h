// The host logic of one NCCL averaging call, apart from the CUDA and NCCL calls themselves
// (DeviceOps, device_ops.h), so that unit tests drive it with several simulated members
// on a machine without a GPU. NcclCommunicator (cuda/nccl_communicator.h) supplies the real
// operations. The round protocol (the layout agreement and when it is due, the commit vote, the
// kept result) is round_agreement.h's, which Gloo speaks too; what is NCCL's is below.
//
// One call, on every member alike, in named phases (NcclCore::Run):
//   1. ValidateRound, PlanLayout, PrepareBuffers — the local preparation: validate the tensors
//      and the round's options; decide whether the agreement is due and, between agreements,
//      compare the layout's fingerprint (every tensor's size and dtype, the staging dtype and the
//      agreed staging plan) with the agreed one; for the staged path, grow the staging buffer,
//      upload the chunk table (padded layout, staging_layout.h) and launch the gathers, bucket by
//      bucket on the gather stream, each bucket's event recorded (zeros for a member that does
//      not contribute); for the zero-copy path of a committed round (or of a member that does not
//      contribute), copy the caller's buffer to the device backup. A failure here is carried into
//      the agreement;
//   2. AgreeOnLayout — the agreement when it is due: one ncclAllReduce(ncclMax) of the
//      LayoutSignature words, and the decision every member takes alike. Where the padded counts
//      differ (one member reduces in place, or splits its tensors differently) every member falls
//      back to the unpadded layout and stages again. Where it is not due, a member whose
//      fingerprint changed, or that failed locally, aborts its communicator and fails alone
//      (ErrorKind::kLayoutMismatch for a changed layout), asking for a new generation
//      (SetNewGenerationRequest) so that the coordinator aborts its peers' collective within
//      about a heartbeat;
//   3. ReduceData — the data ncclAllReduce, bucket by bucket (BucketRanges of the agreed count:
//      the same on every member), each after its own bucket's gather only (or the compressed
//      round's all-to-all and all-gather);
//   4. CommitRound — with RoundOptions::commit, the commit vote (a one-int64 ncclSum of 1 per
//      member, which completes only once every member's data all-reduce has);
//   5. CopyBack — for the staged path, the scatter back.
// With RoundOptions::check_finite (finite_check.h) the round is staged (no zero-copy): each
// bucket's gather is followed on the gather stream by CheckFinite over the caller's tensors of
// that bucket, and the last one by WriteFiniteSlots, which puts this member's code in the slots
// after the data, reduced with the last bucket; their copy to the host rides with the data
// collective's wait, and the members' verdict (DecideFinite) comes before the commit vote and
// the scatter. A compressed round reduces its slots apart, in one small float32 all-reduce, and
// stages the unpadded layout.
// A failure from step 2's collective on aborts the communicator (it is broken from then on); the
// zero-copy path then restores the caller's buffer from the backup when it has one. A failed
// commit keeps the result aside (the staging buffer, or the zero-copy path's pending buffer) and
// leaves the tensors as they were before the call: Adopt writes it into them.
//
// What a round costs beyond a plain one (RoundOptions defaults, whose operations are unchanged):
// commit: one one-int64 all-reduce, two 8-byte copies and one host wait; on the zero-copy path
// also one device-to-device copy of the buffer (the backup, enqueued before the all-reduce with
// no wait of its own) and a device buffer of the same size, kept for later calls.
#ifndef MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_
#define MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/comm/communicator.h"
#include "client/comm/nccl/device_ops.h"
#include "client/comm/round_agreement.h"
#include "client/payload/staging_layout.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

class NcclCore {
 public:
  // `ops` outlives the core. `member` of `size`; `device`: the CUDA ordinal every tensor must
  // be on.
  // `bucket_bytes`: the data all-reduce's bucket (kStagingBucketBytes; every member of a
  // communicator must use the same).
  NcclCore(DeviceOps* ops, int member, int size, int device,
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
    agreement_.SetNewGenerationRequest(std::move(request));
  }
  // Whether the members agreed on a layout (a first call succeeded): later calls with the same
  // fingerprint run no agreement collective.
  bool layout_agreed() const { return agreement_.agreed(); }

  const absl::Status& broken() const { return broken_; }
  bool last_was_zero_copy() const { return last_zero_copy_; }
  bool has_pending_result() const { return kept_.held(); }
  // The staging buffer (tests: a failed growth leaves it empty).
  const GrowableBuffer& staging() const { return staging_; }
  // The zero-copy path's backup of the caller's buffer (committed rounds).
  const GrowableBuffer& backup() const { return backup_; }
  // Bytes this member has handed to NCCL in data collectives (Communicator::bytes_sent): a ring
  // all-reduce of B bytes counts 2 (n - 1) / n B, a compressed round 2 (n - 1) wire parts.
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  // One call as its phases hand it on (Run).
  struct Round {
    absl::Span<const TensorView> tensors;
    const RoundOptions* options = nullptr;
    RoundOutcome* outcome = nullptr;
    // The first tensor's stream: all of the call's work is ordered on it.
    void* stream = nullptr;
    // What this member proposes: total, staging code, count, divisor, step, signature.
    RoundLayout proposal;
    // The caller's tensors are one buffer of one dtype, reduced in place.
    bool zero_copy = false;
    // Whether this call runs the agreement collective.
    bool agree = false;
    // The zero-copy path's buffer is backed up first (restored on a failure).
    bool backup = false;
    // The staging layout in force: the unpadded one.
    bool unpadded = false;
    // Whether the staged layout may be padded: FP32 rounds only. A compressed round stages the
    // tensors back to back, so that its blocks run across tensor boundaries exactly as the
    // host's packed buffer's (OuterLevelState::NextResidual, error feedback).
    bool pad = true;
    // total elements of the staging code.
    size_t bytes = 0;
    // The staged path's layout.
    StagingLayout layout;
    // A failure of the local preparation, carried into the agreement.
    absl::Status local;
    // The finite check's slots: elements of the staging code after the data (in a compressed
    // round, float32 elements of slots_device_).
    int64_t slots = 0;
  };

  // Phase 1: the tensors (device, views), the divisor, the payload's dtype; the zero-copy path.
  void ValidateRound(Round& r) const;
  // Phase 1: whether the agreement is due; between agreements, the staging layout the agreed
  // plan gives and the fingerprint's comparison; the padded layout where it is due.
  void PlanLayout(Round& r) const;
  // Phase 1: the staged path's gathers, the zero-copy path's backup.
  void PrepareBuffers(Round& r);
  // Phase 2: the agreement and its decision, or a member failing alone. Non-OK: the call ends
  // with that status.
  absl::Status AgreeOnLayout(Round& r);
  // Phase 3: the data collective, waited for. Non-OK: the call ends with that status.
  absl::Status ReduceData(Round& r, void* buffer);
  // Phase 4: the commit vote; a failure keeps the result aside.
  absl::Status CommitRound(Round& r, void* buffer);
  // Phase 5: the staged path's scatter back into the caller's tensors.
  absl::Status CopyBack(Round& r);

  // The layout of `tensors` in the staging buffer, cut into this core's buckets.
  StagingLayout MakeLayout(absl::Span<const TensorView> tensors, int32_t code, bool pad) const;
  int64_t BucketElems(int32_t code) const;
  // The staged path with `layout`: the gather (bucket by bucket on the gather stream, each
  // bucket's event recorded), or zeros when `!contribute`.
  absl::Status PrepareStaged(const StagingLayout& layout, int32_t code, bool contribute,
                             void* stream, bool check_finite = false);
  // The finite check's device code word (INT32_MAX: no finding), set up at the first checked
  // round, and the pinned buffer the slots come back to the host in.
  absl::Status PrepareFiniteCheck(size_t host_bytes, void* stream);
  // After the data collective's wait: the members' verdict from the slots in slots_host_.
  absl::Status FiniteVerdict(const Round& r) const;
  // Makes the device chunk table `layout`'s (uploading it when it differs). `staging_bytes`:
  // the staging capacity the table needs; the staging buffer is grown (and zeroed) only when
  // `may_grow`.
  absl::Status UseTable(const StagingLayout& layout, size_t staging_bytes, bool may_grow,
                        void* stream);
  // The agreement's max all-reduce of the words, through the pinned and device signature
  // buffers, waited for.
  absl::Status AllReduceMax(LayoutSignature& words, int32_t code, int divisor, void* stream);
  // The data all-reduce of `count` elements at `buffer`, bucket by bucket on `stream`, each
  // after its gather (when the gathers are pending on the gather stream); `tail` more elements
  // (the finite check's slots) are reduced with the last bucket.
  absl::Status ReduceBuckets(void* buffer, int64_t count, int32_t code, int divisor,
                             void* stream, int64_t tail = 0);
  // The data collective of a compressed round (RoundOptions::payload) over `count` float32
  // elements at `buffer`, in place: an all-to-all of every member's encoded parts, a float32 sum
  // of the decoded parts of this member's part divided by `divisor`, an all-gather of the
  // encoded results, and every member decodes the same bytes (bit-identical results).
  absl::Status ReduceCompressed(void* buffer, int64_t count, WireFormat format, int divisor,
                                void* stream);
  // Makes `stream`'s later work wait for every gather enqueued so far (nothing when none is
  // pending).
  absl::Status JoinGathers(void* stream);
  // After a failed call: JoinGathers, then waits for them (a deadline, local work only), so
  // that nothing of the call still reads the caller's tensors once it returns.
  void SettleGathers(void* stream);
  // The commit vote (CommitVote over a one-int64 ncclSum): OK when every member's data
  // all-reduce succeeded.
  absl::Status Commit(void* stream);
  // Copies the backup back into the caller's `bytes` at `data` and waits.
  absl::Status Restore(void* data, size_t bytes, void* stream);
  // After a failure from the data collective on: aborts the communicator and, on the zero-copy
  // path with a backup, restores the caller's `bytes` at `data`. Returns the status to report.
  absl::Status FailAndRestore(absl::Status status, void* data, size_t bytes, bool restore,
                              void* stream);
  // A failure once the result is in the staging buffer: the communicator is broken, the result
  // kept there for Adopt.
  absl::Status KeepStaged(Round& r, absl::Status failure);

  DeviceOps* const ops_;
  const int member_;
  const int size_;
  const int device_;
  const size_t bucket_bytes_;
  absl::Status broken_;
  bool last_zero_copy_ = false;
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
  // The finite check: the device code word, the pinned host copy of the reduced slots, and a
  // compressed round's slots (float32, reduced apart).
  GrowableBuffer finite_code_;
  GrowableBuffer slots_host_{/*pinned_host=*/true};
  GrowableBuffer slots_device_;
  // A scan was enqueued without the slots' write that resets the code word (a failed call).
  bool finite_code_dirty_ = false;
  int64_t bytes_sent_ = 0;
  // A result kept aside by a failed commit: in staging_ (kStaged: staged_elems() elements,
  // padded or not) or in pending_buffer_ (kOneBuffer).
  KeptResult kept_;
  // The chunk table on the device (uploaded when it changes) and the staging bytes it spans.
  std::vector<StagingChunk> chunks_host_;
  // The layout the members agreed on (phase 2), kept as a local fingerprint, and whether that
  // round's layout could be padded (Round::pad).
  RoundAgreement agreement_;
  bool agreed_pad_ = true;
  // The pipeline: the gather stream (null: the caller's), the event that orders the gathers after
  // the caller's earlier work, and one event per bucket.
  bool streams_made_ = false;
  void* gather_stream_ = nullptr;
  void* start_event_ = nullptr;
  std::vector<void*> gathered_;
  // Gathers enqueued on gather_stream_ that the caller's stream does not wait for yet.
  bool gathers_pending_ = false;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_NCCL_NCCL_CORE_H_
