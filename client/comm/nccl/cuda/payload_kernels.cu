#include "client/comm/nccl/cuda/payload_kernels.h"

#include <algorithm>
#include <cstdint>

#include "client/payload/payload_codec.h"

namespace modelavg::client {
namespace {

constexpr int kThreads = 256;
// The block of the block payloads, and the payload codes the kernels dispatch on (Payload).
constexpr int64_t kWireInt8Block = kInt8Block;
constexpr int32_t kWireBf16 = static_cast<int32_t>(Payload::kBf16);
constexpr int32_t kWireInt8 = static_cast<int32_t>(Payload::kInt8);
constexpr int32_t kWireInt4 = static_cast<int32_t>(Payload::kInt4);
constexpr int32_t kWireTopk = static_cast<int32_t>(Payload::kTopk);
constexpr int32_t kWireTopkInt2 = static_cast<int32_t>(Payload::kTopkInt2);
// TOPK's selection: one thread per element of a block.
constexpr int kTopkThreads = static_cast<int>(kWireInt8Block);
static_assert(kTopkThreads == 1024, "the TOPK kernel's scans assume 32 full warps");

// half.h's conversions, on the device: round to nearest even, NaN kept quiet.
__device__ __forceinline__ uint16_t ToBFloat16(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float FromBFloat16(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ int64_t Int8Blocks(int64_t n) {
  return (n + kWireInt8Block - 1) / kWireInt8Block;
}

// TOPK's entries in a block of `len` elements (payload_codec.cc's TopkEntries), and in a full one
// (where block b's entries start: every block before it is full).
__device__ __forceinline__ int64_t TopkEntries(int32_t topk, int64_t len) {
  return max(int64_t{0}, min(static_cast<int64_t>(topk), len));
}

// Element i of part j (zero past numel).
__device__ __forceinline__ float Input(const float* in, int64_t numel, int64_t part, int64_t j,
                                       int64_t i) {
  const int64_t e = j * part + i;
  return e < numel ? in[e] : 0.0f;
}

// Element i of a TOPK part `p` of `part` elements: its block's entry for i (a binary search: the
// entries are in index order), 0 where the block kept none.
__device__ __forceinline__ float DecodedTopk(int32_t topk, const uint8_t* p, int64_t part,
                                             int64_t i) {
  const int64_t b = i / kWireInt8Block;
  const int64_t lo = b * kWireInt8Block;
  const int64_t count = TopkEntries(topk, min(part - lo, kWireInt8Block));
  const uint32_t* entries =
      reinterpret_cast<const uint32_t*>(p) + b * TopkEntries(topk, kWireInt8Block);
  const uint32_t want = static_cast<uint32_t>(i - lo);
  int64_t first = 0, last = count;  // the first entry whose index is >= want, in [first, last]
  while (first < last) {
    const int64_t mid = (first + last) / 2;
    if ((entries[mid] & 0xFFFFu) < want) {
      first = mid + 1;
    } else {
      last = mid;
    }
  }
  if (first < count && (entries[first] & 0xFFFFu) == want) {
    return FromBFloat16(static_cast<uint16_t>(entries[first] >> 16));
  }
  return 0.0f;
}

// TOPK_INT2's level of code q in a block of scale s (payload_codec.cc's Int2Level): -s, -s/3,
// s/3, s; and the code of x (Int2Code): the nearest level by |x| / s >= 2/3 in float32, the sign
// from x's sign bit.
constexpr float kTwoThirds = 2.0f / 3.0f;
__device__ __forceinline__ float Int2Level(int q, float s) {
  const float third = __fdiv_rn(s, 3.0f);
  return q == 0 ? -s : q == 1 ? -third : q == 2 ? third : s;
}
__device__ __forceinline__ uint32_t Int2Code(float x, float s) {
  const bool big = s > 0.0f && __fdiv_rn(fabsf(x), s) >= kTwoThirds;
  return signbit(x) ? (big ? 0u : 1u) : (big ? 3u : 2u);
}

// TOPK_INT2's entries of all the blocks of a part of `part` elements (every block but the last
// full).
__device__ __forceinline__ int64_t TopkEntriesOfPart(int32_t topk, int64_t part) {
  const int64_t blocks = Int8Blocks(part);
  return (blocks - 1) * TopkEntries(topk, kWireInt8Block) +
         TopkEntries(topk, part - (blocks - 1) * kWireInt8Block);
}

// Element i of a TOPK_INT2 part `p`: the scales, then every block's uint16 indices, then each
// block's codes (payload_codec.cc's layout); a binary search in its block's indices.
__device__ __forceinline__ float DecodedTopkInt2(int32_t topk, const uint8_t* p, int64_t part,
                                                 int64_t i) {
  const int64_t blocks = Int8Blocks(part);
  const int64_t b = i / kWireInt8Block;
  const int64_t lo = b * kWireInt8Block;
  const int64_t full = TopkEntries(topk, kWireInt8Block);
  const int64_t count = TopkEntries(topk, min(part - lo, kWireInt8Block));
  const uint16_t* indices = reinterpret_cast<const uint16_t*>(p + blocks * 4) + b * full;
  const uint16_t want = static_cast<uint16_t>(i - lo);
  int64_t first = 0, last = count;
  while (first < last) {
    const int64_t mid = (first + last) / 2;
    if (indices[mid] < want) {
      first = mid + 1;
    } else {
      last = mid;
    }
  }
  if (first >= count || indices[first] != want) return 0.0f;
  const uint8_t* codes = p + blocks * 4 + 2 * TopkEntriesOfPart(topk, part) + b * ((full + 3) / 4);
  const int q = (codes[first / 4] >> (2 * (first % 4))) & 3;
  return Int2Level(q, reinterpret_cast<const float*>(p)[b]);
}

// Element i of wire part `p` decoded (p: the part's first byte).
__device__ __forceinline__ float Decoded(int32_t payload, int32_t topk, const uint8_t* p,
                                         int64_t part, int64_t i) {
  if (payload == kWireBf16) return FromBFloat16(reinterpret_cast<const uint16_t*>(p)[i]);
  if (payload == kWireInt8) {
    const float scale = reinterpret_cast<const float*>(p)[i / kWireInt8Block];
    const int8_t q = reinterpret_cast<const int8_t*>(p + Int8Blocks(part) * 4)[i];
    return __fmul_rn(static_cast<float>(q), scale);
  }
  if (payload == kWireInt4) {
    const float scale = reinterpret_cast<const float*>(p)[i / kWireInt8Block];
    const uint8_t byte = (p + Int8Blocks(part) * 4)[i / 2];
    const int nibble = (i % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
    return __fmul_rn(static_cast<float>(nibble - 8), scale);
  }
  if (payload == kWireTopk) return DecodedTopk(topk, p, part, i);
  if (payload == kWireTopkInt2) return DecodedTopkInt2(topk, p, part, i);
  return reinterpret_cast<const float*>(p)[i];
}

// The element-wise encodings: FP32 as it is, BF16 rounded (ToBFloat16).
template <typename Wire>
__device__ __forceinline__ Wire Encoded(float x);
template <>
__device__ __forceinline__ float Encoded<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ uint16_t Encoded<uint16_t>(float x) {
  return ToBFloat16(x);
}

// Every element of every part, each into its Wire element (float: FP32, uint16_t: BF16).
template <typename Wire>
__global__ void EncodeElementwiseKernel(const float* in, int64_t numel, int64_t part, int parts,
                                        size_t stride, uint8_t* wire) {
  const int64_t total = part * parts;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = k / part, i = k % part;
    reinterpret_cast<Wire*>(wire + j * stride)[i] = Encoded<Wire>(Input(in, numel, part, j, i));
  }
}

// A quantized block's scale, max|x| / levels over elements [lo, hi) of part j, NaN when one of
// them is not finite; every thread of the (kThreads) block gets it.
__device__ float BlockScale(const float* in, int64_t numel, int64_t part, int64_t j, int64_t lo,
                            int64_t hi, float levels) {
  __shared__ float max_abs[kThreads];
  __shared__ int finite[kThreads];
  float m = 0.0f;
  int ok = 1;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const float x = Input(in, numel, part, j, i);
    ok &= isfinite(x) ? 1 : 0;
    m = fmaxf(m, fabsf(x));
  }
  max_abs[threadIdx.x] = m;
  finite[threadIdx.x] = ok;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) {
      max_abs[threadIdx.x] = fmaxf(max_abs[threadIdx.x], max_abs[threadIdx.x + w]);
      finite[threadIdx.x] &= finite[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (!finite[0]) return __int_as_float(0x7fc00000);  // NaN: the block decodes as NaN
  return __fdiv_rn(max_abs[0], levels);
}

// One CUDA block per INT8 block (of one part): its largest |x|, its scale, its values.
__global__ void EncodeInt8Kernel(const float* in, int64_t numel, int64_t part,
                                 int64_t blocks_per_part, size_t stride, uint8_t* wire) {
  const int64_t j = blockIdx.x / blocks_per_part;
  const int64_t b = blockIdx.x % blocks_per_part;
  const int64_t lo = b * kWireInt8Block;
  const int64_t hi = min(part, lo + kWireInt8Block);
  const float scale = BlockScale(in, numel, part, j, lo, hi, 127.0f);
  uint8_t* p = wire + j * stride;
  if (threadIdx.x == 0) reinterpret_cast<float*>(p)[b] = scale;
  int8_t* q = reinterpret_cast<int8_t*>(p + blocks_per_part * 4);
  const bool zero = !(scale > 0.0f);
  const float inv = zero ? 0.0f : __fdiv_rn(1.0f, scale);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    if (zero) {
      q[i] = 0;
      continue;
    }
    float v = rintf(__fmul_rn(Input(in, numel, part, j, i), inv));
    v = fminf(127.0f, fmaxf(-127.0f, v));
    q[i] = static_cast<int8_t>(v);
  }
}

// INT4's stored value q + 8 of x: q = round-half-even(x / s) in [-7, 7] (x / s in float32, as
// the host divides), 8 for a zero or NaN scale.
__device__ __forceinline__ uint32_t Int4Nibble(float x, float scale, bool zero) {
  float v = zero ? 0.0f : rintf(__fdiv_rn(x, scale));
  v = fminf(7.0f, fmaxf(-7.0f, v));
  return static_cast<uint32_t>(static_cast<int>(v) + 8);
}

// One CUDA block per INT4 block (of one part): its scale, then its values two to a byte, each
// thread writing whole bytes (element i in the low nibble of byte i / 2 when i is even).
__global__ void EncodeInt4Kernel(const float* in, int64_t numel, int64_t part,
                                 int64_t blocks_per_part, size_t stride, uint8_t* wire) {
  const int64_t j = blockIdx.x / blocks_per_part;
  const int64_t b = blockIdx.x % blocks_per_part;
  const int64_t lo = b * kWireInt8Block;  // even: a block's bytes are its own
  const int64_t hi = min(part, lo + kWireInt8Block);
  const float scale = BlockScale(in, numel, part, j, lo, hi, 7.0f);
  uint8_t* p = wire + j * stride;
  if (threadIdx.x == 0) reinterpret_cast<float*>(p)[b] = scale;
  uint8_t* q = p + blocks_per_part * 4;
  const bool zero = !(scale > 0.0f);
  for (int64_t i = lo + 2 * threadIdx.x; i < hi; i += 2 * blockDim.x) {
    const uint32_t low = Int4Nibble(Input(in, numel, part, j, i), scale, zero);
    // An odd part's last byte keeps a zero high nibble, as the host's.
    const uint32_t high = i + 1 < hi ? Int4Nibble(Input(in, numel, part, j, i + 1), scale, zero) : 0;
    q[i / 2] = static_cast<uint8_t>(low | (high << 4));
  }
}

// The exclusive prefix sum of `flag` over the threads of a kTopkThreads block, by thread index:
// a ballot per warp, then a scan of the 32 warp counts in warp 0. Every thread calls it.
__device__ int BlockExclusiveScan(bool flag, int* warp_sums) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, flag);
  const int before = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) warp_sums[warp] = __popc(ballot);
  __syncthreads();
  if (warp == 0) {
    int v = warp_sums[lane];
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xFFFFFFFFu, v, d);
      if (lane >= d) v += y;
    }
    warp_sums[lane] = v;  // inclusive: warps 0..lane
  }
  __syncthreads();
  const int result = (warp == 0 ? 0 : warp_sums[warp - 1]) + before;
  __syncthreads();  // warp_sums is reused by the next scan
  return result;
}

// TOPK's selection in a block of kTopkThreads threads, thread t holding element t of the block
// (live: t < the block's length): whether it is one of the k kept, and then its rank among them
// in index order (*at). Every thread calls it.
__device__ bool TopkKeep(float x, bool live, int k, int* warp_sums, int* at) {
  // NaN's magnitude is the host's infinity: it ties with +-Inf (the lower index first).
  const uint32_t key = isnan(x) ? 0x7F800000u : (__float_as_uint(x) & 0x7FFFFFFFu);
  uint32_t threshold = 0;  // #{key >= threshold} >= k holds throughout (len >= k)
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = threshold | (1u << bit);
    if (__syncthreads_count(live && key >= candidate) >= k) threshold = candidate;
  }
  const int greater = __syncthreads_count(live && key > threshold);  // < k
  const bool tie = live && key == threshold;
  const int tie_rank = BlockExclusiveScan(tie, warp_sums);
  const bool keep = live && (key > threshold || (tie && tie_rank < k - greater));
  *at = BlockExclusiveScan(keep, warp_sums);
  return keep;
}

// A thread of a CUDA block (kTopkThreads threads) that selects TOPK's entries of one block of
// one part (CUDA block index: part j * blocks_per_part + block b).
struct TopkThread {
  int64_t j, b;
  int k;      // the entries the block keeps (0: none, every thread alike)
  float x;    // this thread's element (0 past the block or the buffer)
  bool keep;  // whether it is kept
  int at;     // then its rank among the kept, in index order
};

__device__ TopkThread SelectTopk(const float* in, int64_t numel, int64_t part,
                                 int64_t blocks_per_part, int32_t topk, int* warp_sums) {
  TopkThread s;
  s.j = blockIdx.x / blocks_per_part;
  s.b = blockIdx.x % blocks_per_part;
  const int64_t lo = s.b * kWireInt8Block;
  const int len = static_cast<int>(min(part - lo, kWireInt8Block));
  s.k = static_cast<int>(TopkEntries(topk, len));
  const bool live = static_cast<int>(threadIdx.x) < len;
  s.x = live ? Input(in, numel, part, s.j, lo + threadIdx.x) : 0.0f;
  s.keep = false;
  s.at = 0;
  if (s.k > 0) s.keep = TopkKeep(s.x, live, s.k, warp_sums, &s.at);
  return s;
}

// One CUDA block (kTopkThreads threads, one per element) per TOPK block of one part. The keys
// are |x|'s bits (ordered as the magnitudes), NaN the largest with +-Inf (the host codec counts
// its magnitude as infinity: they tie); T, the k-th largest key, is found
// bit by bit from the top (the largest T with #{key >= T} >= k, one block count a bit); the
// block keeps every key > T and, of the keys == T, the lowest indices up to k (ties: the lower
// index first), each written at its rank in index order (a block prefix sum). Deterministic,
// O(32 + log) block passes, never O(n^2).
__global__ void __launch_bounds__(kTopkThreads)
    EncodeTopkKernel(const float* in, int64_t numel, int64_t part, int64_t blocks_per_part,
                     int32_t topk, size_t stride, uint8_t* wire) {
  __shared__ int warp_sums[32];
  const TopkThread s = SelectTopk(in, numel, part, blocks_per_part, topk, warp_sums);
  if (!s.keep) return;
  uint32_t* entries = reinterpret_cast<uint32_t*>(wire + s.j * stride) +
                      s.b * TopkEntries(topk, kWireInt8Block);
  // (uint16 index, bfloat16 value), little-endian: the host codec's two memcpys.
  entries[s.at] =
      static_cast<uint32_t>(threadIdx.x) | (static_cast<uint32_t>(ToBFloat16(s.x)) << 16);
}

// One CUDA block (kTopkThreads threads) per TOPK_INT2 block of one part: TOPK's selection, the
// scale s (the largest kept magnitude, NaN when a kept value is not finite), each kept index at
// its rank and its 2-bit code, the codes gathered in shared memory and written four to a byte.
__global__ void __launch_bounds__(kTopkThreads)
    EncodeTopkInt2Kernel(const float* in, int64_t numel, int64_t part, int64_t blocks_per_part,
                         int32_t topk, size_t stride, uint8_t* wire) {
  __shared__ int warp_sums[32];
  __shared__ uint32_t max_key;
  __shared__ uint8_t codes[kTopkThreads];
  const TopkThread s = SelectTopk(in, numel, part, blocks_per_part, topk, warp_sums);
  if (s.k == 0) return;  // the whole block alike
  const int64_t j = s.j, b = s.b;
  const int k = s.k, t = threadIdx.x;
  const float x = s.x;
  const bool keep = s.keep;
  if (t == 0) max_key = 0;
  __syncthreads();
  // Non-negative floats order as their bits.
  if (keep && isfinite(x)) atomicMax(&max_key, __float_as_uint(fabsf(x)));
  const bool nonfinite = __syncthreads_or(keep && !isfinite(x)) != 0;
  const float scale = nonfinite ? __int_as_float(0x7fc00000) : __uint_as_float(max_key);
  uint8_t* p = wire + j * stride;
  const int64_t full = TopkEntries(topk, kWireInt8Block);
  if (t == 0) reinterpret_cast<float*>(p)[b] = scale;
  if (keep) {
    reinterpret_cast<uint16_t*>(p + blocks_per_part * 4)[b * full + s.at] =
        static_cast<uint16_t>(t);
    codes[s.at] = static_cast<uint8_t>(Int2Code(x, scale));
  }
  __syncthreads();
  if (t < (k + 3) / 4) {
    uint32_t byte = 0;
    for (int e = 4 * t; e < min(4 * t + 4, k); ++e) {
      byte |= static_cast<uint32_t>(codes[e]) << (2 * (e % 4));
    }
    uint8_t* out =
        p + blocks_per_part * 4 + 2 * TopkEntriesOfPart(topk, part) + b * ((full + 3) / 4);
    out[t] = static_cast<uint8_t>(byte);
  }
}

__global__ void DecodeSumKernel(int32_t payload, int32_t topk, const uint8_t* wire, int parts,
                                int64_t part, size_t stride, float scale, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < part;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // Member order, float32: the host's DecodeAddPayload loop (a TOPK element a part did not
    // keep adds +0, which changes no sum that starts at +0).
    float acc = 0.0f;
    for (int j = 0; j < parts; ++j) {
      acc = __fadd_rn(acc, Decoded(payload, topk, wire + j * stride, part, i));
    }
    out[i] = __fmul_rn(acc, scale);
  }
}

__global__ void DecodeKernel(int32_t payload, int32_t topk, const uint8_t* wire, int64_t numel,
                             int64_t part, size_t stride, float* out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < numel;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = e / part, i = e % part;
    const float v = Decoded(payload, topk, wire + j * stride, part, i);
    // The host decodes TOPK and TOPK_INT2 as zeros plus the entries: 0 + (-0) is +0.
    out[e] = payload == kWireTopk || payload == kWireTopkInt2 ? __fadd_rn(0.0f, v) : v;
  }
}

unsigned Grid(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
}

// A launch of an encode kernel: parts of `part` elements, `blocks` blocks of kWireInt8Block
// each.
struct EncodeArgs {
  const float* in;
  int64_t numel;
  int64_t part;
  int parts;
  int64_t blocks;
  int32_t topk;
  size_t stride;
  uint8_t* wire;
};
using EncodeLauncher = void (*)(const EncodeArgs& a, cudaStream_t stream);

template <typename Wire>
void LaunchElementwise(const EncodeArgs& a, cudaStream_t stream) {
  EncodeElementwiseKernel<Wire><<<Grid(a.part * a.parts), kThreads, 0, stream>>>(
      a.in, a.numel, a.part, a.parts, a.stride, a.wire);
}

void LaunchInt8(const EncodeArgs& a, cudaStream_t stream) {
  EncodeInt8Kernel<<<static_cast<unsigned>(a.blocks * a.parts), kThreads, 0, stream>>>(
      a.in, a.numel, a.part, a.blocks, a.stride, a.wire);
}

void LaunchInt4(const EncodeArgs& a, cudaStream_t stream) {
  EncodeInt4Kernel<<<static_cast<unsigned>(a.blocks * a.parts), kThreads, 0, stream>>>(
      a.in, a.numel, a.part, a.blocks, a.stride, a.wire);
}

void LaunchTopkInt2(const EncodeArgs& a, cudaStream_t stream) {
  EncodeTopkInt2Kernel<<<static_cast<unsigned>(a.blocks * a.parts), kTopkThreads, 0, stream>>>(
      a.in, a.numel, a.part, a.blocks, a.topk, a.stride, a.wire);
}

void LaunchTopk(const EncodeArgs& a, cudaStream_t stream) {
  EncodeTopkKernel<<<static_cast<unsigned>(a.blocks * a.parts), kTopkThreads, 0, stream>>>(
      a.in, a.numel, a.part, a.blocks, a.topk, a.stride, a.wire);
}

// One entry per payload (kPayloads' order): its encode kernel's launch. Its decode is its case
// of Decoded above.
struct DeviceEncoder {
  Payload payload;
  EncodeLauncher launch;
};

constexpr DeviceEncoder kEncoders[] = {
    {Payload::kFp32, LaunchElementwise<float>},
    {Payload::kBf16, LaunchElementwise<uint16_t>},
    {Payload::kInt8, LaunchInt8},
    {Payload::kInt4, LaunchInt4},
    {Payload::kTopk, LaunchTopk},
    {Payload::kTopkInt2, LaunchTopkInt2},
};
static_assert(FollowsPayloads(kEncoders), "one device encoder per row of kPayloads, in its order");

}  // namespace

cudaError_t LaunchEncodeParts(int32_t payload, int32_t topk, const float* in, int64_t numel,
                              int64_t part, int parts, size_t stride, void* wire,
                              cudaStream_t stream) {
  if (part <= 0 || parts <= 0) return cudaSuccess;
  // The bytes past each part's encoding: zeros, so that the wire is the same on every run.
  cudaError_t e = cudaMemsetAsync(wire, 0, stride * parts, stream);
  if (e != cudaSuccess) return e;
  const size_t i = static_cast<size_t>(payload);
  const EncodeLauncher launch = i < kPayloadCount ? kEncoders[i].launch : kEncoders[0].launch;
  launch(EncodeArgs{in, numel, part, parts, (part + kWireInt8Block - 1) / kWireInt8Block, topk,
                    stride, static_cast<uint8_t*>(wire)},
         stream);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeSumParts(int32_t payload, int32_t topk, const void* wire, int parts,
                                 int64_t part, size_t stride, float scale, float* out,
                                 cudaStream_t stream) {
  if (part <= 0) return cudaSuccess;
  DecodeSumKernel<<<Grid(part), kThreads, 0, stream>>>(
      payload, topk, static_cast<const uint8_t*>(wire), parts, part, stride, scale, out);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeParts(int32_t payload, int32_t topk, const void* wire, int64_t numel,
                              int64_t part, size_t stride, float* out, cudaStream_t stream) {
  if (numel <= 0 || part <= 0) return cudaSuccess;
  DecodeKernel<<<Grid(numel), kThreads, 0, stream>>>(
      payload, topk, static_cast<const uint8_t*>(wire), numel, part, stride, out);
  return cudaGetLastError();
}

}  // namespace modelavg::client
