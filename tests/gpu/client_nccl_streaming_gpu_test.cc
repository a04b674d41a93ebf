// Streaming sync's device code on one GPU: the compressed payloads' kernels (payload_kernels.cu:
// BF16, INT8, INT4, TOPK, TOPK_INT2) against the host codec (payload_codec.h, which the Gloo path
// and the simulated device use) byte for byte and float for float, the mix kernel (OuterMix)
// against the host's formula, and a one-rank NCCL communicator's compressed round (its all-to-all
// and all-gather on a real communicator) against the host codec. The members' arithmetic with
// several ranks is covered on the host by tests/unit/client_nccl_compressed_test.cc and
// client_nccl_streaming_test.cc, and end to end by nccl_multirank_gpu_test.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "client/base/half.h"
#include "client/comm/nccl/cuda/cuda_local_ops.h"
#include "client/comm/nccl/cuda/nccl_communicator.h"
#include "client/comm/nccl/cuda/payload_kernels.h"
#include "client/outer/cuda/cuda_outer_device.h"
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "gtest/gtest.h"
#include "tests/gpu/cuda_device_test.h"
#include "tests/reference/staging_reference.h"

namespace modelavg::client {
namespace {

class NcclStreamingGpuTest : public ::modelavg::testing::CudaDeviceTest<> {
 protected:
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    T* d = static_cast<T*>(Alloc(v.size() * sizeof(T)));
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }
  template <typename T>
  std::vector<T> Download(const void* d, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// Values with magnitudes that change by block, a zero block, and (optionally) non-finite ones.
std::vector<float> Input(int64_t n, bool non_finite) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int block = static_cast<int>(i / 900);
    v[i] = block == 2 ? 0.0f
                      : std::ldexp(std::sin(0.731f * i + 0.2f), block % 7 - 3) * (i % 5 == 0 ? -1 : 1);
  }
  if (non_finite && n > 4000) {
    v[3100] = std::numeric_limits<float>::infinity();
    v[3900] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

// Values with many equal magnitudes (TOPK's ties: quarters, signs mixed, +0 and -0), a short
// zero run, and (optionally) non-finite ones.
std::vector<float> TiedInput(int64_t n, bool non_finite) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::round(4.0f * std::sin(0.377f * static_cast<float>(i))) / 4.0f;
    v[i] = (i / 50) % 7 == 3 ? (i % 2 == 0 ? 0.0f : -0.0f) : q;
  }
  if (non_finite && n > 2100) {
    // NaN ties with Inf in TOPK's order (the lower index first): k = 1 keeps element 3.
    v[3] = std::numeric_limits<float>::infinity();
    v[5] = std::numeric_limits<float>::quiet_NaN();
    v[1030] = -std::numeric_limits<float>::infinity();
    v[2049] = std::numeric_limits<float>::quiet_NaN();
    v[2050] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

// The host's wire buffer: part j's encoding at j * stride, zero-padded (nccl_core.cc's layout).
std::vector<uint8_t> HostEncode(WireFormat format, const std::vector<float>& in, int64_t part,
                                int parts, size_t stride) {
  std::vector<uint8_t> wire(stride * parts, 0);
  std::vector<float> tmp(static_cast<size_t>(part));
  for (int j = 0; j < parts; ++j) {
    std::fill(tmp.begin(), tmp.end(), 0.0f);
    for (int64_t i = 0; i < part && j * part + i < static_cast<int64_t>(in.size()); ++i) {
      tmp[i] = in[j * part + i];
    }
    EncodePayload(format, tmp.data(), part, wire.data() + j * stride);
  }
  return wire;
}

// Bit for bit, except that any NaN equals any NaN (the GPU's arithmetic returns the canonical
// NaN where the host's keeps the operand's bits).
bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
  }
  return true;
}

struct KernelCase {
  WireFormat format;
  int64_t n;     // elements of the buffer
  int64_t part;  // 0: ceil(n / parts)
};

std::vector<KernelCase> KernelCases() {
  std::vector<KernelCase> out;
  for (Payload p : {Payload::kBf16, Payload::kInt8, Payload::kInt4}) {
    out.push_back({WireFormat(p), 9001, 0});
    out.push_back({WireFormat(p), 9001, 3072});  // block-aligned parts, as nccl_core cuts them
    out.push_back({WireFormat(p), 7, 0});        // one short block
  }
  for (Payload p : {Payload::kTopk, Payload::kTopkInt2}) {
    for (int32_t k : {1, 21, 300, 1023, 1024}) {
      out.push_back({WireFormat(p, k), 9001, 0});
      out.push_back({WireFormat(p, k), 9001, 3072});
      out.push_back({WireFormat(p, k), 5, 0});  // k > the block's length
    }
  }
  return out;
}

// Every payload's kernels against the host codec: the encoding's bytes, the decoded sum of the
// parts and the decoding, for parts cut anywhere or at block boundaries, short last blocks,
// ties, NaN and Inf, and TOPK and TOPK_INT2 with k from 1 to 1024.
TEST_F(NcclStreamingGpuTest, PayloadKernels_EqualTheHostCodecBitForBit) {
  for (const KernelCase& c : KernelCases()) {
    for (int parts : {1, 3, 8}) {
      for (int input = 0; input < 3; ++input) {
        const WireFormat f = c.format;
        SCOPED_TRACE(std::string(PayloadName(f.payload)) + " k " + std::to_string(f.topk) +
                     " n " + std::to_string(c.n) + " parts " + std::to_string(parts) +
                     " input " + std::to_string(input));
        const int64_t n = c.n;
        const int64_t part = c.part > 0 ? c.part : (n + parts - 1) / parts;
        const size_t stride = (EncodedBytes(f, part) + 15) / 16 * 16;
        const std::vector<float> in = input == 0   ? Input(n, false)
                                      : input == 1 ? TiedInput(n, false)
                                                   : TiedInput(n, true);
        const float* d_in = Upload(in);
        void* d_wire = Alloc(stride * parts);
        ASSERT_EQ(LaunchEncodeParts(static_cast<int32_t>(f.payload), f.topk, d_in, n, part, parts,
                                    stride, d_wire, stream_),
                  cudaSuccess);
        const std::vector<uint8_t> host = HostEncode(f, in, part, parts, stride);
        const std::vector<uint8_t> got = Download<uint8_t>(d_wire, host.size());
        ASSERT_EQ(got, host) << "the encodings differ";
        // The sum of every part's decoding (each member's piece of one part, on the wire).
        float* d_sum = static_cast<float*>(Alloc(part * sizeof(float)));
        const float scale = 1.0f / 3.0f;
        ASSERT_EQ(LaunchDecodeSumParts(static_cast<int32_t>(f.payload), f.topk, d_wire, parts,
                                       part, stride, scale, d_sum, stream_),
                  cudaSuccess);
        std::vector<float> sum(static_cast<size_t>(part), 0.0f);
        for (int j = 0; j < parts; ++j) {
          DecodeAddPayload(f, host.data() + j * stride, part, sum.data());
        }
        for (float& v : sum) v *= scale;
        EXPECT_TRUE(SameFloats(Download<float>(d_sum, part), sum)) << "the decoded sums differ";
        float* d_out = static_cast<float*>(Alloc(n * sizeof(float)));
        ASSERT_EQ(LaunchDecodeParts(static_cast<int32_t>(f.payload), f.topk, d_wire, n, part,
                                    stride, d_out, stream_),
                  cudaSuccess);
        std::vector<float> out(static_cast<size_t>(n));
        std::vector<float> tmp(static_cast<size_t>(part));
        for (int j = 0; j < parts; ++j) {
          DecodePayload(f, host.data() + j * stride, part, tmp.data());
          for (int64_t i = 0; i < part && j * part + i < n; ++i) out[j * part + i] = tmp[i];
        }
        EXPECT_TRUE(SameFloats(Download<float>(d_out, n), out)) << "the decodings differ";
      }
    }
  }
}

// Random inputs (a fixed seed), TOPK at every density the tests use and INT4: the bytes of one
// part of the whole buffer equal EncodePayload's, and the decoding DecodePayload's.
TEST_F(NcclStreamingGpuTest, PayloadKernels_RandomInputs_EqualEncodePayload) {
  uint32_t state = 12345;
  const auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return state;
  };
  for (const WireFormat f : {WireFormat(Payload::kInt4), WireFormat(Payload::kTopk, 1),
                             WireFormat(Payload::kTopk, 21), WireFormat(Payload::kTopk, 1024),
                             WireFormat(Payload::kTopkInt2, 1), WireFormat(Payload::kTopkInt2, 21),
                             WireFormat(Payload::kTopkInt2, 1024)}) {
    for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{4096}, int64_t{5000}}) {
      SCOPED_TRACE(std::string(PayloadName(f.payload)) + " k " + std::to_string(f.topk) + " n " +
                   std::to_string(n));
      std::vector<float> in(static_cast<size_t>(n));
      for (float& v : in) {
        const uint32_t r = next();
        // Every third value from a handful (ties), the others spread over magnitudes.
        v = r % 3 == 0 ? static_cast<float>(static_cast<int>(r >> 8) % 5 - 2)
                       : std::ldexp(static_cast<float>(r >> 8) / 16777216.0f - 0.5f,
                                    static_cast<int>(r % 13) - 6);
      }
      const size_t bytes = EncodedBytes(f, n);
      const size_t stride = (bytes + 15) / 16 * 16;
      const float* d_in = Upload(in);
      void* d_wire = Alloc(stride);
      ASSERT_EQ(LaunchEncodeParts(static_cast<int32_t>(f.payload), f.topk, d_in, n, n, 1, stride,
                                  d_wire, stream_),
                cudaSuccess);
      std::vector<uint8_t> want(bytes);
      EncodePayload(f, in.data(), n, want.data());
      std::vector<uint8_t> got = Download<uint8_t>(d_wire, stride);
      EXPECT_TRUE(std::all_of(got.begin() + bytes, got.end(), [](uint8_t b) { return b == 0; }));
      got.resize(bytes);
      ASSERT_EQ(got, want);
      float* d_out = static_cast<float*>(Alloc(n * sizeof(float)));
      ASSERT_EQ(LaunchDecodeParts(static_cast<int32_t>(f.payload), f.topk, d_wire, n, n, stride,
                                  d_out, stream_),
                cudaSuccess);
      std::vector<float> out(static_cast<size_t>(n));
      DecodePayload(f, want.data(), n, out.data());
      EXPECT_TRUE(SameFloats(Download<float>(d_out, n), out));
    }
  }
}

TEST_F(NcclStreamingGpuTest, MixKernel_EqualsTheHostFormula_EveryDType) {
  CudaOuterKernels kernels(0);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const int64_t n = 3 * kStagingChunkElems + 17;
    const int32_t code = StagingCodeOf(dtype);
    const int32_t state = dtype == DType::kFloat64 ? kStageF64 : kStageF32;
    std::vector<char> x(n * DTypeSize(dtype)), local(n * StagingCodeSize(state));
    for (int64_t i = 0; i < n; ++i) {
      StoreAs(x.data(), code, i, 0.37 * i - 11.0);
      StoreAs(local.data(), state, i, -0.21 * i + 5.0);
    }
    void* d_x = Upload(x);
    void* d_local = Upload(local);
    TensorView view{d_x, n, dtype, Device::Cuda(0), stream_};
    const StagingLayout layout = BuildStagingLayout({view}, state, /*pad=*/false);
    void* d_chunks = Upload(layout.chunks);
    const double mix = 0.3;
    ASSERT_TRUE(kernels.OuterMix(static_cast<const StagingChunk*>(d_chunks),
                                 static_cast<int64_t>(layout.chunks.size()), d_local, state, mix,
                                 stream_)
                    .ok());
    const std::vector<char> got = Download<char>(d_x, x.size());
    for (int64_t i = 0; i < n; ++i) {
      const double v = (1.0 - mix) * LoadAs(x.data(), code, i) + mix * LoadAs(local.data(), state, i);
      char want[8];
      StoreAs(want, code, 0, dtype == DType::kFloat64 ? v : static_cast<double>(static_cast<float>(v)));
      ASSERT_EQ(0, std::memcmp(got.data() + i * DTypeSize(dtype), want, DTypeSize(dtype)))
          << "element " << i;
    }
  }
}

TEST_F(NcclStreamingGpuTest, OneRankCommunicator_CompressedRound_IsTheCodecTwice) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  for (const WireFormat payload : {WireFormat(Payload::kBf16), WireFormat(Payload::kInt8),
                                   WireFormat(Payload::kInt4), WireFormat(Payload::kTopk, 21),
                                   WireFormat(Payload::kTopkInt2, 21)}) {
    SCOPED_TRACE(std::string(PayloadName(payload.payload)));
    const int64_t n = 5003;
    const std::vector<float> in = Input(n, false);
    float* d = Upload(in);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    TensorView view{d, n, DType::kFloat32, Device::Cuda(0), stream_};
    RoundOptions options;
    options.payload = payload.payload;
    options.topk = payload.topk;
    const int64_t before = (*comm)->bytes_sent();
    ASSERT_TRUE((*comm)->AllReduceAverage({view}, options, nullptr).ok());
    EXPECT_EQ((*comm)->bytes_sent(), before);  // one rank sends nothing to others
    // One member: encode, decode (times 1), encode, decode in the gather's format (TOPK and
    // TOPK_INT2: TOPK with min(1024, 1 k) entries a block).
    const WireFormat gather = payload.payload == Payload::kTopkInt2
                                  ? WireFormat(Payload::kTopk, payload.topk)
                                  : payload;
    std::vector<float> want(static_cast<size_t>(n));
    std::vector<uint8_t> wire(EncodedBytes(payload, n));
    EncodePayload(payload, in.data(), n, wire.data());
    DecodePayload(payload, wire.data(), n, want.data());
    wire.resize(EncodedBytes(gather, n));
    EncodePayload(gather, want.data(), n, wire.data());
    DecodePayload(gather, wire.data(), n, want.data());
    EXPECT_TRUE(SameFloats(Download<float>(d, n), want));
  }
}

}  // namespace
}  // namespace modelavg::client
