// Streaming sync's device code on one GPU: the compressed payloads' kernels
// (payload_kernels.cu) against the host codec (payload_codec.h, which the Gloo path and the
// simulated device use) byte for byte and float for float, the mix kernel (OuterMix) against the
// host's formula, and a one-rank NCCL communicator's compressed round (its all-to-all and
// all-gather on a real communicator) against the host codec. The members' arithmetic with
// several ranks is covered on the host by tests/unit/client_nccl_compressed_test.cc and
// client_nccl_streaming_test.cc, and end to end by nccl_multirank_gpu_test.
#include <cuda_runtime_api.h>
#include <nccl.h>

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
#include "client/payload/payload_codec.h"
#include "client/payload/staging_layout.h"
#include "gtest/gtest.h"
#include "tests/gpu/cuda_device_test.h"
#include "tests/tools/staging_reference.h"

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

// The host's wire buffer: part j's encoding at j * stride, zero-padded (nccl_core.cc's layout).
std::vector<uint8_t> HostEncode(Payload payload, const std::vector<float>& in, int64_t part,
                                int parts, size_t stride) {
  std::vector<uint8_t> wire(stride * parts, 0);
  std::vector<float> tmp(static_cast<size_t>(part));
  for (int j = 0; j < parts; ++j) {
    std::fill(tmp.begin(), tmp.end(), 0.0f);
    for (int64_t i = 0; i < part && j * part + i < static_cast<int64_t>(in.size()); ++i) {
      tmp[i] = in[j * part + i];
    }
    EncodePayload(payload, tmp.data(), part, wire.data() + j * stride);
  }
  return wire;
}

bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(NcclStreamingGpuTest, PayloadKernels_EqualTheHostCodecBitForBit) {
  for (Payload payload : {Payload::kBf16, Payload::kInt8}) {
    for (int parts : {1, 3, 8}) {
      for (bool non_finite : {false, true}) {
        SCOPED_TRACE(std::string(PayloadName(payload)) + " parts " + std::to_string(parts) +
                     (non_finite ? " non-finite" : ""));
        const int64_t n = 9001;
        const int64_t part = (n + parts - 1) / parts;
        const size_t stride = (EncodedBytes(payload, part) + 15) / 16 * 16;
        const std::vector<float> in = Input(n, non_finite);
        const float* d_in = Upload(in);
        void* d_wire = Alloc(stride * parts);
        ASSERT_EQ(LaunchEncodeParts(static_cast<int32_t>(payload), d_in, n, part, parts, stride,
                                    d_wire, stream_),
                  cudaSuccess);
        const std::vector<uint8_t> host = HostEncode(payload, in, part, parts, stride);
        const std::vector<uint8_t> got = Download<uint8_t>(d_wire, host.size());
        ASSERT_EQ(got, host) << "the encodings differ";
        // The sum of every part's decoding (each member's piece of one part, on the wire).
        float* d_sum = static_cast<float*>(Alloc(part * sizeof(float)));
        const float scale = 1.0f / 3.0f;
        ASSERT_EQ(LaunchDecodeSumParts(static_cast<int32_t>(payload), d_wire, parts, part, stride,
                                       scale, d_sum, stream_),
                  cudaSuccess);
        std::vector<float> sum(static_cast<size_t>(part), 0.0f);
        for (int j = 0; j < parts; ++j) {
          DecodeAddPayload(payload, host.data() + j * stride, part, sum.data());
        }
        for (float& v : sum) v *= scale;
        EXPECT_TRUE(SameFloats(Download<float>(d_sum, part), sum)) << "the decoded sums differ";
        float* d_out = static_cast<float*>(Alloc(n * sizeof(float)));
        ASSERT_EQ(LaunchDecodeParts(static_cast<int32_t>(payload), d_wire, n, part, stride, d_out,
                                    stream_),
                  cudaSuccess);
        std::vector<float> out(static_cast<size_t>(n));
        std::vector<float> tmp(static_cast<size_t>(part));
        for (int j = 0; j < parts; ++j) {
          DecodePayload(payload, host.data() + j * stride, part, tmp.data());
          for (int64_t i = 0; i < part && j * part + i < n; ++i) out[j * part + i] = tmp[i];
        }
        EXPECT_TRUE(SameFloats(Download<float>(d_out, n), out)) << "the decodings differ";
      }
    }
  }
}

TEST_F(NcclStreamingGpuTest, MixKernel_EqualsTheHostFormula_EveryDType) {
  CudaLocalOps ops(0, absl::Seconds(30));
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
    ASSERT_TRUE(ops.OuterMix(static_cast<const StagingChunk*>(d_chunks),
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
  for (Payload payload : {Payload::kBf16, Payload::kInt8}) {
    SCOPED_TRACE(std::string(PayloadName(payload)));
    const int64_t n = 5003;
    const std::vector<float> in = Input(n, false);
    float* d = Upload(in);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    TensorView view{d, n, DType::kFloat32, Device::Cuda(0), stream_};
    RoundOptions options;
    options.payload = payload;
    const int64_t before = (*comm)->bytes_sent();
    ASSERT_TRUE((*comm)->AllReduceAverage({view}, options, nullptr).ok());
    EXPECT_EQ((*comm)->bytes_sent(), before);  // one rank sends nothing to others
    // One member: encode, decode (times 1), encode, decode.
    std::vector<float> want(static_cast<size_t>(n));
    std::vector<uint8_t> wire(EncodedBytes(payload, n));
    EncodePayload(payload, in.data(), n, wire.data());
    DecodePayload(payload, wire.data(), n, want.data());
    EncodePayload(payload, want.data(), n, wire.data());
    DecodePayload(payload, wire.data(), n, want.data());
    EXPECT_TRUE(SameFloats(Download<float>(d, n), want));
  }
}

}  // namespace
}  // namespace modelavg::client
