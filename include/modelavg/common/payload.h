// The payload encodings (Level.payload, docs/streaming.md): one row each in kPayloads, which
// holds every fact about an encoding that is not its code: its value in coordinator.proto, its
// name (the one spelling the CLI, the status page, Python, logs and errors print), the level
// fields it needs, its bytes (a block's header and the bits of each entry it sends) and the
// format of the all-gathered mean. The host codec (client/payload/payload_codec.cc) and the
// device kernels (client/comm/nccl/cuda/payload_kernels.cu) each hold one entry per encoding
// beside its code; docs/architecture.md ("a new payload encoding") lists what a new one touches.
//
// Plain C++ (no absl, no protobuf): the CUDA kernels include it too.
#ifndef MODELAVG_COMMON_PAYLOAD_H_
#define MODELAVG_COMMON_PAYLOAD_H_

#include <cstddef>
#include <cstdint>

namespace modelavg {

// How a level's pseudo-gradients travel (outer levels; plain levels send FP32 parameters).
enum class Payload : int32_t { kFp32, kBf16, kInt8, kInt4, kTopk, kTopkInt2 };

// Elements per block of the block encodings (each block has its own scale, or its own top-k).
inline constexpr int64_t kPayloadBlock = 1024;

// How the members' mean is sent back in the all-gather of the compressed all-reduce.
enum class GatherRule : int32_t {
  // In the level's own payload and entries a block.
  kSame,
  // As `gather` with min(kPayloadBlock, members * k) entries a block: the union of the
  // members' entries (every non-zero of the mean).
  kUnion,
};

struct PayloadInfo {
  Payload payload;
  // Its value in coordinator.proto's enum Payload.
  int32_t proto;
  // Its spelling everywhere (the proto enum value's name).
  const char* name;
  // Loses something (error feedback has something to keep).
  bool lossy;
  // Sends the k = ceil(topk_density * kPayloadBlock) entries of largest magnitude a block:
  // needs Level.topk_density in (0, 1); the others need it 0.
  bool topk;
  // The alignment of the pieces a buffer may be cut into: kPayloadBlock, or 1 (no blocks).
  int64_t block;
  // Bytes of each block before its entries (a float32 scale), and bits of each entry sent
  // (every element, or each of a top-k block's k entries): a block of e entries takes
  // header_bytes + ceil(e * entry_bits / 8) bytes.
  int32_t header_bytes;
  int32_t entry_bits;
  // The all-gather of the mean: in `gather`'s encoding, by `gather_rule`.
  Payload gather;
  GatherRule gather_rule;
};

inline constexpr PayloadInfo kPayloads[] = {
    {Payload::kFp32, 0, "FP32", false, false, 1, 0, 32, Payload::kFp32, GatherRule::kSame},
    {Payload::kBf16, 1, "BF16", true, false, 1, 0, 16, Payload::kBf16, GatherRule::kSame},
    {Payload::kInt8, 2, "INT8", true, false, kPayloadBlock, 4, 8, Payload::kInt8,
     GatherRule::kSame},
    {Payload::kInt4, 3, "INT4", true, false, kPayloadBlock, 4, 4, Payload::kInt4,
     GatherRule::kSame},
    {Payload::kTopk, 4, "TOPK", true, true, kPayloadBlock, 0, 32, Payload::kTopk,
     GatherRule::kUnion},
    // TOPK's entries as a uint16 index and a 2-bit level of the block's float32 scale.
    {Payload::kTopkInt2, 5, "TOPK_INT2", true, true, kPayloadBlock, 4, 18, Payload::kTopk,
     GatherRule::kUnion},
};

inline constexpr size_t kPayloadCount = sizeof(kPayloads) / sizeof(kPayloads[0]);

// The row of `p`; FP32's for a value outside the enum.
constexpr const PayloadInfo& PayloadInfoOf(Payload p) {
  for (const PayloadInfo& info : kPayloads) {
    if (info.payload == p) return info;
  }
  return kPayloads[0];
}

// Its name: "FP32", "BF16", ...
constexpr const char* PayloadName(Payload p) { return PayloadInfoOf(p).name; }

// The row whose proto value is `proto`, or null.
constexpr const PayloadInfo* PayloadInfoOfProto(int32_t proto) {
  for (const PayloadInfo& info : kPayloads) {
    if (info.proto == proto) return &info;
  }
  return nullptr;
}

// Rows in enum order, so that PayloadInfoOf is one look-up per row.
constexpr bool PayloadRowsInOrder() {
  for (size_t i = 0; i < kPayloadCount; ++i) {
    if (static_cast<size_t>(kPayloads[i].payload) != i) return false;
  }
  return true;
}
static_assert(PayloadRowsInOrder(), "kPayloads holds one row per Payload, in enum order");

// Whether `table`, whose entries each name a `payload`, holds one entry per row of kPayloads,
// in its order: the check of each table kept beside the payloads' code (the host codecs, the
// device encoders), so that a row added here without its entry there fails to compile.
template <typename Entry, size_t N>
constexpr bool FollowsPayloads(const Entry (&table)[N]) {
  if (N != kPayloadCount) return false;
  for (size_t i = 0; i < N; ++i) {
    if (table[i].payload != kPayloads[i].payload) return false;
  }
  return true;
}

}  // namespace modelavg

#endif  // MODELAVG_COMMON_PAYLOAD_H_
