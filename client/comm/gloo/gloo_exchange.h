// The collectives modelavg runs on Gloo's pairs itself, with Gloo's own point-to-point
// operations (unbound buffers: the same sends, receives, timeouts and aborts as Gloo's
// collectives), where Gloo's all-reduce costs round trips that averaging does not need:
//
//  * DirectAverage: every member sends its whole contribution to every other member and each
//    sums the same contributions in member order, so that every member ends with the same bits.
//    One hop instead of the ring's 2 (n - 1); for two members the same bytes as the ring. The
//    buffer travels in pieces, a window of them in flight, so that each piece is reduced (and
//    written where the caller wants it) while the next ones arrive.
//    With the finite check, every member's code travels as one word after its pieces, and no
//    piece is written before every code is known (a non-finite code: none is).
//  * ScatterGatherAverage, for more than two members: member m owns the m-th of n equal ranges of
//    the buffer; every member sends each peer that peer's range of its contribution, each owner
//    sums its range's contributions in member order (DirectAverage's additions, so the same
//    bits) and sends the mean of its range to every peer. The ring's bytes (2 (n - 1) / n times
//    the buffer) in 2 hops instead of 2 (n - 1); the all-to-all of DirectAverage sends n - 1
//    times the buffer in one.
//  * The commit vote of a committed round: one word from every member to every other (one hop;
//    a one-word all-reduce on Gloo's ring costs 2 (n - 1)), sent as soon as this member holds
//    every contribution, so that it travels while the last pieces are reduced and written.
//
// Both throw what Gloo throws (gloo::IoException for a broken pair, a timeout or an abort); the
// communicator turns it into a status (FromGlooException).
#ifndef MODELAVG_CLIENT_COMM_GLOO_GLOO_EXCHANGE_H_
#define MODELAVG_CLIENT_COMM_GLOO_GLOO_EXCHANGE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "modelavg/client/tensor.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace modelavg::client {

// The bytes a DirectAverage piece carries (the last one of a buffer may carry fewer), and how
// many pieces are in flight from each peer at once.
inline constexpr size_t kDirectPieceBytes = 256 * 1024;
inline constexpr int kDirectWindow = 8;

// Buffers DirectAverage reuses from one call to the next (one per communicator).
struct DirectScratch {
  // Each peer's pieces in flight: kDirectWindow pieces per peer.
  std::vector<std::vector<double>> recv;
  // One piece: the sum being formed; zeros (the contribution of a member that contributes none).
  std::vector<double> sum;
  std::vector<double> zeros;
  // ScatterGatherAverage: the whole result (every owner's mean in place).
  std::vector<double> gather;
};

// One direct all-reduce average on `context` (this member is context.rank of context.size).
struct DirectPlan {
  // Elements of `dtype` (kFloat32 or kFloat64: what the sum is formed in).
  int64_t total = 0;
  DType dtype = DType::kFloat32;
  // What the sum is divided by.
  int divisor = 1;
  // This member's contribution, `total` elements, or null: zeros (a member admitted at this
  // round). Read until `write` is called for a piece; only then may that piece change.
  const void* source = nullptr;
  // Gloo's slot tag for the data (the vote uses tag + 1, the finite check's codes tag + 2).
  uint32_t tag = 0;
  // Bounds the whole exchange: every wait ends by then (Gloo then fails the pairs).
  std::chrono::steady_clock::time_point deadline;
  // Committed rounds: the vote's word, the same on every member (0: no vote). Sent once this
  // member holds every contribution; the exchange returns true only when every member sent it.
  uint64_t vote = 0;
  // The finite check (finite_check.h): this member's code (FindingCode: 0 when its
  // contribution is finite) goes to every peer as one word (tag + 2) after its pieces, and every
  // member's code is known before the first piece is written. When any is not 0, nothing is
  // reduced or written (every member reads the same codes, so all refuse alike): the exchange
  // still runs to its end (the vote included), so that the mesh stays in step. With the check,
  // each contribution is divided before it is added (as the checked ring does: the mean of the
  // largest floats is no false Inf).
  bool check_finite = false;
  int64_t finite_code = 0;
};

// What happened: how far the exchange got, for the caller to undo or keep.
struct DirectProgress {
  // Elements [0, written) have been passed to `write`.
  int64_t written = 0;
  // Every contribution arrived and every element's mean is known (this member holds the
  // result: what a committed round keeps when its vote fails): elements [0, written) were
  // passed to `write`, the rest are at `rest` (elements [written, total) of the result: the
  // last piece's sum in DirectScratch::sum, or ScatterGatherAverage's gathered result).
  bool holding = false;
  const void* rest = nullptr;
  // With the finite check, once known: every member's code in member order (this member's
  // included). A code that is not 0 means nothing was written and nothing is held.
  std::vector<int64_t> codes;
};

// Runs `plan`: `prepare(begin, n)` is called before elements [begin, begin + n) of the source
// are first sent (to fill them: a pack), in order; `write(begin, n, result)` with each piece's
// result (the sum over members in member order, divided by the divisor; `result` valid for the
// call only), in order, once that piece of the source has been sent to every peer. Returns
// normally when every piece was written, or, with the finite check, when a code refused the round
// (progress->codes; nothing written) (and, with a vote, every member voted); throws what Gloo
// throws otherwise, with *progress saying how far it got.
void DirectAverage(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
                   absl::FunctionRef<void(int64_t, int64_t)> prepare,
                   absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
                   DirectProgress* progress);

// The same contract as DirectAverage (the same results, bit for bit, for the same plan), by
// ranges: `prepare` is called for the whole source (in pieces, in order) before anything is
// sent, and `write` once every mean has arrived, in pieces, in order. Needs `total` >= n.
void ScatterGatherAverage(gloo::Context& context, const DirectPlan& plan, DirectScratch* scratch,
                          absl::FunctionRef<void(int64_t, int64_t)> prepare,
                          absl::FunctionRef<void(int64_t, int64_t, const void*)> write,
                          DirectProgress* progress);

// ScatterGatherAverage's ranges: member m of n owns elements [ScatterRangeStart(total, m, n),
// ScatterRangeStart(total, m + 1, n)), n ranges within one element of each other.
inline int64_t ScatterRangeStart(int64_t total, int m, int n) { return total * m / n; }
// Elements member `m` sends in a complete scatter-gather exchange: every other owner's range,
// then its own range's mean to each of the n - 1 others.
inline int64_t ScatterGatherSentElements(int64_t total, int m, int n) {
  const int64_t mine = ScatterRangeStart(total, m + 1, n) - ScatterRangeStart(total, m, n);
  return total - mine + (n - 1) * mine;
}

// The commit vote alone (after Gloo's ring): sends `word` to every peer and receives theirs
// (tag: Gloo's slot tag). Returns normally when every peer sent `word`; throws what Gloo throws,
// or gloo::IoException when a peer sent another word.
void ExchangeVote(gloo::Context& context, uint32_t tag, uint64_t word,
                  std::chrono::steady_clock::time_point deadline);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_GLOO_EXCHANGE_H_
