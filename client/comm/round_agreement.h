// The round protocol both backends speak (Gloo on host memory, NCCL on CUDA memory), apart from
// the collectives that carry it: the layout agreement and when it is due, the commit vote of a
// committed round, and the result a member keeps aside when its vote fails. The backends hand in
// their own small all-reduces; what the members agree on, and what each decides from it, is
// here only. docs/architecture.md ("How a round works") walks one round through it.
//
// One round, on every member alike:
//   1. local preparation (the backend's): validate the tensors and the round's options, make the
//      buffers ready. A failure here is not returned yet: it is carried into the agreement.
//   2. the agreement, when it is due (RoundAgreement::Due) — at the communicator's first round,
//      at a fragment round (RoundOptions::layout_signature != 0: each fragment has a layout of
//      its own) and at a round with another divisor than the agreed one (the round after an
//      admission), which every member knows alike, so that the members always issue the same
//      collectives. The members all-reduce (max) their LayoutSignature and each decides the same
//      from the result (DecideLayout): a member failed locally -> every member returns an error
//      and nobody enters the data collective (the communicator stays usable); totals, dtypes or
//      fragment splits differ -> INVALID_ARGUMENT (kLayoutMismatch) everywhere; steps or divisors
//      differ -> INTERNAL "averaging different rounds" (kRoundMismatch) everywhere; members that
//      differ on the finite check -> INVALID_ARGUMENT (kLayoutMismatch) everywhere; the counts
//      the data collective reduces differ (NCCL: one member pads, another reduces in place) ->
//      every member reduces the unpadded layout.
//      Between agreements a member compares a local fingerprint of its layout with the agreed
//      one (CheckUnchanged), with no collective. A member whose layout changed, or that failed
//      locally on such a round, cannot tell its peers in band (they are entering the data
//      collective): it breaks its communicator and fails alone (FailedAlone), asking for a new
//      generation so that its peers are aborted within about a heartbeat.
//   3. the data collective (the backend's).
//   4. a committed round (RoundOptions::commit) then votes (CommitVote): a one-word sum of 1 per
//      member, which completes only once every member's data collective has. A member whose
//      vote fails leaves its tensors as they were before the round, keeps the result aside
//      (KeptResult) and reports RoundOutcome::kFailedHoldingResult; AdoptPendingResult writes it
//      into the tensors later, if a peer turns out to have completed the round.
#ifndef MODELAVG_CLIENT_COMM_ROUND_AGREEMENT_H_
#define MODELAVG_CLIENT_COMM_ROUND_AGREEMENT_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// What one member brings to a round's agreement.
struct RoundLayout {
  // Elements, over every tensor of the round.
  int64_t total = 0;
  // The dtype the round reduces in, as the backend codes it (the same code on every member).
  int32_t dtype = 0;
  // Elements the data collective reduces: `total`, or more where the backend pads its staging
  // layout (NCCL). Members whose counts differ all reduce the unpadded layout.
  int64_t count = 0;
  // What the sum is divided by (RoundOptions::contributors, resolved).
  int divisor = 1;
  // RoundOptions::step; -1: not checked (it agrees with any step).
  int64_t step = -1;
  // RoundOptions::layout_signature (0: not a fragment round).
  int64_t fragment_signature = 0;
  // RoundOptions::check_finite: the data collective carries each member's finite check
  // (finite_check.h), so every member must do it alike.
  bool check_finite = false;
};

// The agreement's int64 words, before and after the max all-reduce: (count, -count, dtype,
// -dtype, total, -total, failed member + 1, divisor, -divisor, step, -step, signature,
// ~signature, check_finite, -check_finite). Each pair's maximum gives the members' maximum and
// minimum at once. A step of -1 is encoded as INT64_MIN in both of its words, so that it agrees
// with any.
inline constexpr int kLayoutWords = 15;
using LayoutSignature = std::array<int64_t, kLayoutWords>;
LayoutSignature EncodeLayout(const RoundLayout& layout, bool failed_locally, int member);

struct LayoutDecision {
  // Non-OK: every member returns an error (this one, or `local` on a member that failed
  // locally) without entering the data collective.
  absl::Status status;
  // Every member reduces the unpadded layout (count = total).
  bool unpadded = false;
};
// The same on every member, given the same `reduced` (the members' words after the max
// all-reduce). `mine`: this member's layout (for the messages and the padding); `local`: its
// local failure, if any.
LayoutDecision DecideLayout(const LayoutSignature& reduced, const RoundLayout& mine,
                            const absl::Status& local);

// A cheap local summary of one round's layout as its communicator agreed on it: the element
// count and dtype of every tensor in `tensors`, the reduction's dtype `code` and `count` (the
// backend's staging plan). Not the addresses: the same layout in other buffers is the same
// layout. A backend passes the tensors its collectives depend on: NCCL all of them (its staging
// pads each); Gloo none (it packs without padding: total and dtype alone).
uint64_t LayoutFingerprint(absl::Span<const TensorView> tensors, int32_t code, int64_t count);

// The commit vote of a committed round: `all_reduce_sum` (the backend's in-place sum
// all-reduce of one int64 over the members) adds every member's vote of 1. OK when all `size`
// members voted: every member's data collective succeeded. Errors: the collective's, INTERNAL
// when it counted another number of votes.
absl::Status CommitVote(int size, absl::FunctionRef<absl::Status(int64_t&)> all_reduce_sum);

// One communicator's agreement state: whether a round's agreement is due, the layout the
// members last agreed on, and what a member does that fails where its peers cannot learn it.
// Not thread-safe: the communicator serializes its rounds.
class RoundAgreement {
 public:
  // This member is `member` of `size`; `backend` ("Gloo", "NCCL") names it in the logs.
  RoundAgreement(int member, int size, absl::string_view backend);

  // Called (on the averaging thread) with the error when this member fails alone (FailedAlone):
  // moves the job to a new generation so that its peers' collective is aborted
  // (CommunicatorSetup::request_new_generation). May be empty.
  void SetNewGenerationRequest(std::function<void(const absl::Status&)> request) {
    request_new_generation_ = std::move(request);
  }

  // Whether this round runs the agreement collective, decided alike on every member: the
  // communicator's first round, a fragment round (`fragment_signature` != 0), or a round with
  // another `divisor` or finite check (RoundOptions::check_finite) than the agreed one.
  bool Due(int64_t fragment_signature, int divisor, bool check_finite = false) const;

  // A round that is not due: OK when its `fingerprint` (LayoutFingerprint; `tensors` tensors of
  // `total` elements) is the agreed layout's. Otherwise INVALID_ARGUMENT (kLayoutMismatch)
  // naming both layouts — except in a world of one, which has no peer to leave in a mismatched
  // collective: *agree_instead is set, OK returned, and the round agrees again.
  absl::Status CheckUnchanged(uint64_t fingerprint, size_t tensors, int64_t total,
                              bool* agree_instead) const;

  // The agreement of one round: this member's words for `mine` (marked failed when `local` is
  // not OK) go through `all_reduce_max` (the backend's in-place max all-reduce of the words),
  // and the members decide alike (DecideLayout). Non-OK: the collective itself failed (the
  // communicator is broken). Otherwise the decision.
  absl::StatusOr<LayoutDecision> Agree(
      const RoundLayout& mine, const absl::Status& local,
      absl::FunctionRef<absl::Status(LayoutSignature&)> all_reduce_max) const;

  // Records the layout the members agreed on in a round that is not a fragment round: later
  // rounds with the same fingerprint and divisor run no agreement. `unpadded`: the decision's.
  void Record(const RoundLayout& agreed, uint64_t fingerprint, bool unpadded, size_t tensors);

  // This member fails in a round that was not agreed, where its peers are entering the data
  // collective and cannot learn it in band: logs it and asks for a new generation. The caller
  // has broken its communicator first. Returns `status`.
  absl::Status FailedAlone(absl::Status status) const;

  // Whether the members agreed on a layout (a first round succeeded).
  bool agreed() const { return agreed_; }
  // Whether the agreed layout is the unpadded one.
  bool unpadded() const { return unpadded_; }

 private:
  const int member_;
  const int size_;
  const std::string backend_;
  std::function<void(const absl::Status&)> request_new_generation_;
  bool agreed_ = false;
  uint64_t fingerprint_ = 0;
  int divisor_ = 0;
  bool check_finite_ = false;
  bool unpadded_ = false;
  size_t tensors_ = 0;
  int64_t total_ = 0;
};

// The result a round kept aside on this member when its commit vote failed
// (RoundOutcome::kFailedHoldingResult): what it is the result of, so that AdoptPendingResult
// writes it only into the layout of that round. The bytes stay where the backend keeps them.
class KeptResult {
 public:
  enum class Form {
    // In the backend's staging layout (packed; NCCL's padded or not, `staged_elems` elements).
    kStaged,
    // The raw bytes of one buffer (the tensors back to back: Gloo's in-place path, NCCL's
    // zero-copy path).
    kOneBuffer,
  };

  // Keeps the result of a round over `total` elements of the dtype `dtype` (the backend's code).
  void Keep(Form form, int64_t total, int32_t dtype, int64_t staged_elems = 0,
            bool padded = false);
  void Forget() { held_ = false; }

  bool held() const { return held_; }
  Form form() const { return form_; }
  int64_t staged_elems() const { return staged_elems_; }
  bool padded() const { return padded_; }

  // OK when a result is kept; FAILED_PRECONDITION otherwise.
  absl::Status CheckHeld() const;
  // OK when tensors of `total` elements of `dtype` (`one_buffer`: back to back in one buffer)
  // can take the kept result; INVALID_ARGUMENT naming both layouts otherwise.
  absl::Status CheckLayout(int64_t total, int32_t dtype, bool one_buffer) const;

 private:
  bool held_ = false;
  Form form_ = Form::kStaged;
  int64_t total_ = 0;
  int32_t dtype_ = 0;
  int64_t staged_elems_ = 0;
  bool padded_ = false;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_ROUND_AGREEMENT_H_
