// The finite check of a round (RoundOptions::check_finite): before any member keeps a round's
// result, it is known whether every member's contribution was finite, and none keeps a result
// that a NaN or an Inf went into. Both backends carry the check inside the round's own data
// collective, so that it costs no collective of its own:
//   * each member finds its first tensor holding a non-finite element while it stages its
//     contribution (PackDivided with a finding on the host; the gather kernel on CUDA);
//   * the staged buffer carries one slot per member after the data: member i writes its
//     finding's code (finite_scan.h) at slot i, the others zeros, and the slots are reduced
//     with the data (a sum, so that every member's code arrives whole; a compressed round,
//     whose values are quantized, carries the code in each encoded part instead);
//   * after the collective every member reads the same codes and decides alike (DecideFinite):
//     all finite, the round goes on (the scatter back, the commit vote); otherwise no member
//     writes the result and every member's call fails with the same error naming the lowest
//     member with a finding, its first non-finite tensor and the value. The communicator stays
//     usable: nothing failed on the wire.
#ifndef MODELAVG_CLIENT_COMM_FINITE_CHECK_H_
#define MODELAVG_CLIENT_COMM_FINITE_CHECK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/payload/finite_scan.h"
#include "client/payload/staging_chunk.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// How many staging elements of `staging_code` (staging_chunk.h) one member's code takes: one in
// float32 and float64; in float16, three base-256 digits (each exact in float16 after an
// average and back).
int FiniteSlotWidth(int32_t staging_code);
// The `members` slots at `slots` (FiniteSlotWidth elements each, of `staging_code`): `code`
// (< 2^24) at `member`, zeros at the others.
void WriteFiniteSlots(void* slots, int32_t staging_code, int members, int member, int64_t code);
// The members' codes from the reduced slots. `scale`: what the reduction multiplied the slots
// by (1 for a sum; 1 / divisor for an average), undone before rounding.
std::vector<int64_t> ReadFiniteSlots(const void* slots, int32_t staging_code, int members,
                                     double scale = 1.0);

// The round's verdict from every member's code, the same on every member: OK when none found a
// non-finite value; otherwise INVALID_ARGUMENT of kind kNonFinite naming the lowest such member
// (ErrorPeerOf) and, in its NonFiniteDetail, its tensor and value (the step: `step`, -1 if not
// known; rank and level are the caller's to add).
absl::Status DecideFinite(absl::Span<const int64_t> codes, int64_t step);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_FINITE_CHECK_H_
