// The wire encodings of a level's pseudo-gradients (Level.payload, docs/streaming.md). Pure
// functions over float32 buffers, one entry per payload (kHostCodecs in payload_codec.cc, beside
// each one's code; the facts shared with the coordinator and the kernels are its row of
// kPayloads, modelavg/common/payload.h); the compressed all-reduce (GlooCommunicator) encodes each
// member's chunks with them, sums the decoded values in float32 and encodes the sum again for
// the all-gather.
//
// Each encoding's rule is written in its proto comment (coordinator.proto's enum Payload) and
// beside its code in payload_codec.cc; docs/streaming.md has them all. The first five:
//
//   FP32: the float32 values themselves (4 bytes an element).
//   BF16: bfloat16, rounded to nearest even (2 bytes an element). |decode(encode(x)) - x| <=
//         2^-8 |x| (half a unit in its 8 significant bits) for every finite x in bfloat16's normal range (and Inf/NaN preserved).
//   INT8: blocks of kInt8Block elements (the last one shorter), each one float32 scale
//         s = max|x| / 127 followed by its int8 values q = round(x / s) in [-127, 127] (1 byte an
//         element plus 4 bytes a block). |decode(encode(x)) - x| <= s / 2 = max|x over the
//         block| / 254 (plus float32 rounding of q * s). A block holding a non-finite value
//         decodes as NaN throughout.
//   INT4: blocks of kInt8Block elements as INT8's, each one float32 scale s = max|x| / 7, the
//         values q = round-half-even(x / s) in [-7, 7] (s and x / s in float32) stored as
//         q + 8, two to a byte (element i in the low
//         nibble of byte i / 2 when i is even, the high one when odd), all scales first
//         (ceil(n / 2) bytes plus 4 bytes a block: 0.504 bytes an element, 0.126 of FP32).
//         |decode(encode(x)) - x| <= s / 2 = max|x over the block| / 14 (plus float32 rounding
//         of q * s). A block holding a non-finite value decodes as NaN throughout.
//   TOPK: per block of kInt8Block elements, the k = WireFormat::topk entries of largest
//         magnitude (NaN counts as an infinite magnitude; ties, Inf and NaN among them: the
//         lower index first; a shorter last block
//         keeps min(k, its length)), as k pairs (uint16 index in the block, bfloat16 value) in
//         index order: 4 bytes an entry, 4 k / 1024 bytes an element (0.08 at density 0.02).
//         A kept entry's error <= 2^-8 |x| (bfloat16); a dropped one decodes as 0 (its error
//         |x| <= the block's k-th largest magnitude) — what error feedback keeps.
//         The compressed all-reduce sends the float32 mean of the members' decoded pieces back
//         as TOPK with min(kInt8Block, n k) entries a block: every non-zero of the mean (at most
//         n k a block), each rounded to bfloat16.
//
// Blocks start at multiples of kInt8Block of the whole buffer: the compressed all-reduce cuts
// the buffer into pieces at block boundaries (PayloadBlock), so that decode(encode(x)) of a
// member's buffer (RoundTripPayload) is exactly what its peers decode from it, whatever the
// number of members (error feedback, docs/streaming.md, keeps the difference).
#ifndef MODELAVG_CLIENT_PAYLOAD_PAYLOAD_CODEC_H_
#define MODELAVG_CLIENT_PAYLOAD_PAYLOAD_CODEC_H_

#include <cstddef>
#include <cstdint>

#include "modelavg/common/payload.h"

namespace modelavg::client {

// Elements per INT8 block (each block has its own scale); INT4 and TOPK use the same blocks.
inline constexpr int64_t kInt8Block = kPayloadBlock;

// A payload and, for TOPK, the entries it keeps per block of kInt8Block (a shorter last block
// keeps min(topk, its length)). Made from a Payload alone for the others.
struct WireFormat {
  WireFormat(Payload p = Payload::kFp32, int32_t k = 0) : payload(p), topk(k) {}  // NOLINT
  Payload payload;
  int32_t topk;
};

// TOPK's entries per block for Level.topk_density in (0, 1): ceil(density * kInt8Block).
int32_t TopkPerBlock(double density);

// Bytes of the encoding of `n` float32 elements (kPayloads' header_bytes and entry_bits).
size_t EncodedBytes(WireFormat format, int64_t n);

// Writes the encoding of in[0, n) to out[0, EncodedBytes(format, n)).
void EncodePayload(WireFormat format, const float* in, int64_t n, uint8_t* out);

// acc[i] += the decoded value of element i, for i in [0, n) (float32 accumulation).
void DecodeAddPayload(WireFormat format, const uint8_t* in, int64_t n, float* acc);

// out[i] = the decoded value of element i.
void DecodePayload(WireFormat format, const uint8_t* in, int64_t n, float* out);

// The alignment of the pieces the compressed all-reduce may cut a buffer into: kInt8Block for
// the block payloads (INT8, INT4, TOPK), 1 for the others (PayloadInfo::block).
int64_t PayloadBlock(Payload payload);

// The encoding in which the compressed all-reduce of `members` members sends the mean back in
// its all-gather (PayloadInfo::gather and gather_rule): `format` itself, or for TOPK, TOPK with
// min(kInt8Block, members * format.topk) entries a block. Both backends call it.
WireFormat GatherFormat(WireFormat format, int members);

// out[i] = decode(encode(in))[i], for i in [0, n): exactly the values a peer decodes from this
// buffer. `in` and `out` may be the same.
void RoundTripPayload(WireFormat format, const float* in, int64_t n, float* out);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_PAYLOAD_PAYLOAD_CODEC_H_
