#include "client/payload/payload_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "client/base/half.h"

namespace modelavg::client {
namespace {

int64_t Blocks(int64_t n) { return (n + kInt8Block - 1) / kInt8Block; }

// A block's scale: max|x| / levels, NaN when the block holds a non-finite value.
float BlockScale(const float* in, int64_t lo, int64_t hi, float levels) {
  float max_abs = 0.0f;
  bool finite = true;
  for (int64_t i = lo; i < hi; ++i) {
    finite = finite && std::isfinite(in[i]);
    max_abs = std::max(max_abs, std::fabs(in[i]));
  }
  return finite ? max_abs / levels : std::numeric_limits<float>::quiet_NaN();
}

// The INT4 layout: every block's scale first (float32), then the values q + 8 in [1, 15], two
// to a byte (element i in the low nibble of byte i / 2 when i is even, the high one when odd).
void EncodeInt4(int32_t, const float* in, int64_t n, uint8_t* out) {
  const int64_t blocks = Blocks(n);
  uint8_t* q = out + blocks * sizeof(float);
  std::memset(q, 0, static_cast<size_t>((n + 1) / 2));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t hi = std::min(n, lo + kInt8Block);
    const float scale = BlockScale(in, lo, hi, 7.0f);
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    const bool zero = !(scale > 0.0f);  // zero block, or NaN (decodes to NaN)
    for (int64_t i = lo; i < hi; ++i) {
      // x / s in float32, rounded half to even (the documented rule, exactly).
      float v = zero ? 0.0f : std::nearbyint(in[i] / scale);
      v = std::min(7.0f, std::max(-7.0f, v));
      const uint8_t nibble = static_cast<uint8_t>(static_cast<int>(v) + 8);
      q[i / 2] |= (i % 2 == 0) ? nibble : static_cast<uint8_t>(nibble << 4);
    }
  }
}

template <bool kAdd>
void DecodeInt4(int32_t, const uint8_t* in, int64_t n, float* out) {
  const int64_t blocks = Blocks(n);
  const uint8_t* q = in + blocks * sizeof(float);
  for (int64_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    const int64_t lo = b * kInt8Block;
    const int64_t hi = std::min(n, lo + kInt8Block);
    for (int64_t i = lo; i < hi; ++i) {
      const int nibble = (i % 2 == 0) ? (q[i / 2] & 0x0f) : (q[i / 2] >> 4);
      const float v = static_cast<float>(nibble - 8) * scale;
      if (kAdd) {
        out[i] += v;
      } else {
        out[i] = v;
      }
    }
  }
}

// A TOPK block's entries: indices by decreasing magnitude (NaN first), ties by index.
int64_t TopkEntries(int32_t topk, int64_t len) {
  return std::max<int64_t>(0, std::min<int64_t>(topk, len));
}

// TOPK's selection in the block x[0, len): the indices of its k entries of largest magnitude
// (NaN as large as Inf; ties: the lower index first), in index order, in order[0, k).
void TopkSelect(const float* x, int64_t len, int64_t k, std::vector<uint16_t>* order) {
  order->resize(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) (*order)[i] = static_cast<uint16_t>(i);
  const auto mag = [x](uint16_t i) {
    return std::isnan(x[i]) ? std::numeric_limits<float>::infinity() : std::fabs(x[i]);
  };
  std::partial_sort(order->begin(), order->begin() + k, order->end(),
                    [&](uint16_t a, uint16_t b) {
                      const float ma = mag(a), mb = mag(b);
                      return ma != mb ? ma > mb : a < b;
                    });
  std::sort(order->begin(), order->begin() + k);
}

void EncodeTopk(int32_t topk, const float* in, int64_t n, uint8_t* out) {
  std::vector<uint16_t> order;
  for (int64_t lo = 0; lo < n; lo += kInt8Block) {
    const int64_t len = std::min(n - lo, kInt8Block);
    const int64_t k = TopkEntries(topk, len);
    TopkSelect(in + lo, len, k, &order);
    for (int64_t e = 0; e < k; ++e) {
      const uint16_t index = order[e];
      const uint16_t value = FloatToBFloat16(in[lo + index]);
      std::memcpy(out, &index, 2);
      std::memcpy(out + 2, &value, 2);
      out += 4;
    }
  }
}

template <bool kAdd>
void DecodeTopk(int32_t topk, const uint8_t* in, int64_t n, float* out) {
  for (int64_t lo = 0; lo < n; lo += kInt8Block) {
    const int64_t len = std::min(n - lo, kInt8Block);
    const int64_t k = TopkEntries(topk, len);
    if (!kAdd) std::fill(out + lo, out + lo + len, 0.0f);
    for (int64_t e = 0; e < k; ++e) {
      uint16_t index, value;
      std::memcpy(&index, in, 2);
      std::memcpy(&value, in + 2, 2);
      in += 4;
      if (index < len) out[lo + index] += BFloat16ToFloat(value);
    }
  }
}

// TOPK_INT2: TOPK's entries, each value coded in 2 bits q for the level (2q - 3) s / 3 of its
// block's scale s = max|kept value| (NaN when one is not finite): q = 0, 1, 2, 3 for -s, -s/3,
// s/3, s; the nearest level by |x| / s >= 2/3 in float32 (no float32 is 2/3: no ties), the sign
// from x's sign bit (+-0 codes +-s/3). Layout: every block's scale (float32), then every
// block's k uint16 indices (in index order), then each block's codes, four to a byte from the
// low bits (entry e in bits 2 (e % 4) of the block's byte e / 4), a block's codes byte-aligned.
constexpr float kTwoThirds = 2.0f / 3.0f;

uint8_t Int2Code(float x, float s) {
  const bool big = s > 0.0f && std::fabs(x) / s >= kTwoThirds;
  return std::signbit(x) ? (big ? 0 : 1) : (big ? 3 : 2);
}

float Int2Level(int q, float s) {
  const float third = s / 3.0f;
  return q == 0 ? -s : q == 1 ? -third : q == 2 ? third : s;
}

// Entries of all of a buffer's blocks.
int64_t TopkEntriesOfBuffer(int32_t topk, int64_t n) {
  int64_t entries = 0;
  for (int64_t lo = 0; lo < n; lo += kInt8Block) {
    entries += TopkEntries(topk, std::min(n - lo, kInt8Block));
  }
  return entries;
}

void EncodeTopkInt2(int32_t topk, const float* in, int64_t n, uint8_t* out) {
  const int64_t blocks = Blocks(n);
  uint8_t* indices = out + blocks * sizeof(float);
  uint8_t* codes = indices + 2 * TopkEntriesOfBuffer(topk, n);
  std::vector<uint16_t> order;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t len = std::min(n - lo, kInt8Block);
    const int64_t k = TopkEntries(topk, len);
    TopkSelect(in + lo, len, k, &order);
    float max_abs = 0.0f;
    bool finite = true;
    for (int64_t e = 0; e < k; ++e) {
      const float x = in[lo + order[e]];
      finite = finite && std::isfinite(x);
      max_abs = std::max(max_abs, std::fabs(x));
    }
    const float scale = finite ? max_abs : std::numeric_limits<float>::quiet_NaN();
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    std::memset(codes, 0, static_cast<size_t>((k + 3) / 4));
    for (int64_t e = 0; e < k; ++e) {
      std::memcpy(indices + 2 * e, &order[e], 2);
      codes[e / 4] |= static_cast<uint8_t>(Int2Code(in[lo + order[e]], scale) << (2 * (e % 4)));
    }
    indices += 2 * k;
    codes += (k + 3) / 4;
  }
}

template <bool kAdd>
void DecodeTopkInt2(int32_t topk, const uint8_t* in, int64_t n, float* out) {
  const int64_t blocks = Blocks(n);
  const uint8_t* indices = in + blocks * sizeof(float);
  const uint8_t* codes = indices + 2 * TopkEntriesOfBuffer(topk, n);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t len = std::min(n - lo, kInt8Block);
    const int64_t k = TopkEntries(topk, len);
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    if (!kAdd) std::fill(out + lo, out + lo + len, 0.0f);
    for (int64_t e = 0; e < k; ++e) {
      uint16_t index;
      std::memcpy(&index, indices + 2 * e, 2);
      const int q = (codes[e / 4] >> (2 * (e % 4))) & 3;
      if (index < len) out[lo + index] += Int2Level(q, scale);
    }
    indices += 2 * k;
    codes += (k + 3) / 4;
  }
}

// The INT8 layout: every block's scale first (float32), then the int8 values.
void EncodeInt8(int32_t, const float* in, int64_t n, uint8_t* out) {
  const int64_t blocks = Blocks(n);
  int8_t* q = reinterpret_cast<int8_t*>(out + blocks * sizeof(float));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t hi = std::min(n, lo + kInt8Block);
    float max_abs = 0.0f;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      const float a = std::fabs(in[i]);
      finite = finite && std::isfinite(in[i]);
      max_abs = std::max(max_abs, a);
    }
    float scale = max_abs / 127.0f;
    if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    if (!(scale > 0.0f)) {  // zero block, or NaN: values are 0 (NaN scale decodes to NaN)
      std::memset(q + lo, 0, static_cast<size_t>(hi - lo));
      continue;
    }
    const float inv = 1.0f / scale;
    for (int64_t i = lo; i < hi; ++i) {
      float v = std::nearbyint(in[i] * inv);
      v = std::min(127.0f, std::max(-127.0f, v));
      q[i] = static_cast<int8_t>(v);
    }
  }
}

template <bool kAdd>
void DecodeInt8(int32_t, const uint8_t* in, int64_t n, float* out) {
  const int64_t blocks = Blocks(n);
  const int8_t* q = reinterpret_cast<const int8_t*>(in + blocks * sizeof(float));
  for (int64_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    const int64_t lo = b * kInt8Block;
    const int64_t hi = std::min(n, lo + kInt8Block);
    for (int64_t i = lo; i < hi; ++i) {
      const float v = static_cast<float>(q[i]) * scale;
      if (kAdd) {
        out[i] += v;
      } else {
        out[i] = v;
      }
    }
  }
}

void EncodeFp32(int32_t, const float* in, int64_t n, uint8_t* out) {
  std::memcpy(out, in, static_cast<size_t>(n) * 4);
}

template <bool kAdd>
void DecodeFp32(int32_t, const uint8_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, in + 4 * i, 4);
    out[i] = kAdd ? out[i] + v : v;
  }
}

void EncodeBf16(int32_t, const float* in, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = FloatToBFloat16(in[i]);
    std::memcpy(out + 2 * i, &b, 2);
  }
}

template <bool kAdd>
void DecodeBf16(int32_t, const uint8_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, in + 2 * i, 2);
    const float v = BFloat16ToFloat(b);
    out[i] = kAdd ? out[i] + v : v;
  }
}

// One entry per payload (kPayloads' order): its host encode, decode and decode-add. `topk` is
// WireFormat::topk, ignored by the dense payloads.
struct HostCodec {
  Payload payload;
  void (*encode)(int32_t topk, const float* in, int64_t n, uint8_t* out);
  void (*decode)(int32_t topk, const uint8_t* in, int64_t n, float* out);
  void (*decode_add)(int32_t topk, const uint8_t* in, int64_t n, float* acc);
};

constexpr HostCodec kHostCodecs[] = {
    {Payload::kFp32, EncodeFp32, DecodeFp32<false>, DecodeFp32<true>},
    {Payload::kBf16, EncodeBf16, DecodeBf16<false>, DecodeBf16<true>},
    {Payload::kInt8, EncodeInt8, DecodeInt8<false>, DecodeInt8<true>},
    {Payload::kInt4, EncodeInt4, DecodeInt4<false>, DecodeInt4<true>},
    {Payload::kTopk, EncodeTopk, DecodeTopk<false>, DecodeTopk<true>},
    {Payload::kTopkInt2, EncodeTopkInt2, DecodeTopkInt2<false>, DecodeTopkInt2<true>},
};

static_assert(FollowsPayloads(kHostCodecs), "one host codec per row of kPayloads, in its order");

const HostCodec& CodecOf(Payload p) {
  const size_t i = static_cast<size_t>(p);
  return kHostCodecs[i < kPayloadCount ? i : 0];
}

}  // namespace

size_t EncodedBytes(WireFormat format, int64_t n) {
  const PayloadInfo& info = PayloadInfoOf(format.payload);
  const auto block_bytes = [&info](int64_t entries) {
    return static_cast<size_t>(info.header_bytes) +
           static_cast<size_t>((entries * info.entry_bits + 7) / 8);
  };
  if (info.block == 1) return block_bytes(n);
  size_t bytes = 0;
  for (int64_t lo = 0; lo < n; lo += info.block) {
    const int64_t len = std::min(n - lo, info.block);
    bytes += block_bytes(info.topk ? TopkEntries(format.topk, len) : len);
  }
  return bytes;
}

void EncodePayload(WireFormat format, const float* in, int64_t n, uint8_t* out) {
  CodecOf(format.payload).encode(format.topk, in, n, out);
}

void DecodeAddPayload(WireFormat format, const uint8_t* in, int64_t n, float* acc) {
  CodecOf(format.payload).decode_add(format.topk, in, n, acc);
}

void DecodePayload(WireFormat format, const uint8_t* in, int64_t n, float* out) {
  CodecOf(format.payload).decode(format.topk, in, n, out);
}

int32_t TopkPerBlock(double density) {
  const double k = std::ceil(density * static_cast<double>(kInt8Block));
  return static_cast<int32_t>(std::min<double>(kInt8Block, std::max(1.0, k)));
}

int64_t PayloadBlock(Payload payload) { return PayloadInfoOf(payload).block; }

WireFormat GatherFormat(WireFormat format, int members) {
  const PayloadInfo& info = PayloadInfoOf(format.payload);
  if (info.gather_rule == GatherRule::kSame) return format;
  return WireFormat(info.gather,
                    static_cast<int32_t>(std::min<int64_t>(
                        kInt8Block, int64_t{members} * std::max<int32_t>(format.topk, 0))));
}

void RoundTripPayload(WireFormat format, const float* in, int64_t n, float* out) {
  std::vector<uint8_t> wire(EncodedBytes(format, n));
  EncodePayload(format, in, n, wire.data());
  DecodePayload(format, wire.data(), n, out);
}

}  // namespace modelavg::client
