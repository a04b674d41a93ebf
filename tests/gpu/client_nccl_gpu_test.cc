// The NCCL path on one GPU: the staging kernels' results against a host reference (the padded
// layout with large aligned float32 tensors on the 16-byte vector path, misaligned mixed dtypes
// on the element path), one-rank communicators in every dtype (zero-copy and staged, NCCL's
// ncclSum and ncclAvg), a paced round's weighted copy on the device, committed rounds (backup,
// commit, a lost commit's result adopted after the abort), ContiguousParameters' zeroing
// order, abort of a communicator whose peer never arrives or whose generation moves on, and the
// bootstrap through a coordinator. NCCL refuses two ranks of one communicator on the same GPU, so
// with one GPU every average is of one member: the multi-member logic (layout agreement, local
// failures, averaging arithmetic, bootstrap retry) is covered by the host tests in
// tests/unit/client_nccl_*_test.cc.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/averaging/round_weights.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/nccl/cuda/nccl_communicator.h"
#include "client/comm/nccl/cuda/staging_kernels.h"
#include "client/outer/cuda/cuda_outer_device.h"
#include "client/outer/outer_device.h"
#include "client/payload/staging_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "modelavg/client/contiguous_parameters.h"
#include "tests/gpu/cuda_device_test.h"
#include "tests/testing/faulty_communicator.h"
#include "tests/tools/make_job_spec.h"
#include "tests/reference/staging_reference.h"
#if MODELAVG_TEST_WITH_SERVER
#include "client/rpc/coordinator_client.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "server/coordinator_server.h"
#include "tests/testing/in_process_coordinator.h"
#endif

namespace modelavg::client {
namespace {


const DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};

class NcclGpuTest : public ::modelavg::testing::CudaDeviceTest<> {
 protected:
  // A device tensor filled from `host` (raw bytes of its dtype).
  void* Upload(const void* host, size_t bytes) {
    void* d = Alloc(bytes);
    EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable host-to-device cudaMemcpy may return before its DMA has landed, and the
    // legacy stream it runs on does not order the non-blocking stream_ the kernels use.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return d;
  }
  template <typename T>
  std::vector<T> Download(const void* d, size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  // Tensors of `spec` (values exact in every dtype), each `shift` bytes past a cudaMalloc'd
  // (256-byte aligned) allocation. The padded gather into a `code` staging buffer must match a
  // host gather; the scatter of doubled values must land in every tensor and nowhere else.
  void GatherScatterAgainstHost(const std::vector<std::pair<DType, int64_t>>& spec, size_t shift,
                                int32_t code) {
    const size_t margin = 16;
    std::vector<std::vector<char>> host;
    std::vector<TensorView> views;
    for (size_t t = 0; t < spec.size(); ++t) {
      const auto [dtype, n] = spec[t];
      const int32_t tc = StagingCodeOf(dtype);
      std::vector<char> h(shift + n * DTypeSize(dtype) + margin, 0x5a);
      for (int64_t i = 0; i < n; ++i) StoreAs(h.data() + shift, tc, i, 0.5 * (t + 1) + 0.25 * (i % 127));
      char* d = static_cast<char*>(Upload(h.data(), h.size()));
      views.push_back(TensorView{d + shift, n, dtype, Device::Cuda(0), stream_});
      host.push_back(std::move(h));
    }
    const StagingLayout layout = BuildStagingLayout(views, code, /*pad=*/true);
    const size_t esize = StagingCodeSize(code);
    for (const StagingChunk& c : layout.chunks) {
      ASSERT_EQ(c.staging_offset * esize % kStagingAlignBytes, 0u);
    }
    auto* dchunks = static_cast<StagingChunk*>(
        Upload(layout.chunks.data(), layout.chunks.size() * sizeof(StagingChunk)));
    void* staging = Upload(std::vector<char>(layout.elems * esize, 0).data(), layout.elems * esize);
    ASSERT_EQ(LaunchGather(dchunks, layout.chunks.size(), staging, code, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<char> got = Download<char>(staging, layout.elems * esize);
    std::vector<char> doubled = got;
    size_t chunk = 0;
    for (size_t t = 0; t < spec.size(); ++t) {
      const int32_t tc = StagingCodeOf(spec[t].first);
      for (int64_t start = 0; start < spec[t].second; start += kStagingChunkElems, ++chunk) {
        const StagingChunk& c = layout.chunks[chunk];
        for (int64_t i = 0; i < c.numel; ++i) {
          const double want = LoadAs(host[t].data() + shift, tc, start + i);
          ASSERT_EQ(LoadAs(got.data(), code, c.staging_offset + i), want)
              << "tensor " << t << " element " << start + i;
          StoreAs(doubled.data(), code, c.staging_offset + i, 2 * want);
        }
      }
    }
    ASSERT_EQ(cudaMemcpy(staging, doubled.data(), doubled.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // stream_ does not wait on the legacy one
    ASSERT_EQ(LaunchScatter(dchunks, layout.chunks.size(), staging, code, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (size_t t = 0; t < spec.size(); ++t) {
      const int32_t tc = StagingCodeOf(spec[t].first);
      std::vector<char> back =
          Download<char>(static_cast<char*>(views[t].data) - shift, host[t].size());
      for (size_t b = 0; b < shift; ++b) ASSERT_EQ(back[b], 0x5a) << "tensor " << t;
      for (int64_t i = 0; i < spec[t].second; ++i) {
        ASSERT_EQ(LoadAs(back.data() + shift, tc, i), 2 * LoadAs(host[t].data() + shift, tc, i))
            << "tensor " << t << " element " << i;
      }
      for (size_t b = host[t].size() - margin; b < host[t].size(); ++b) {
        ASSERT_EQ(back[b], 0x5a) << "tensor " << t << ": the scatter wrote past its end";
      }
    }
  }
};

TEST_F(NcclGpuTest, StagingKernels_MixedDTypesAndChunks_GatherThenScatterRoundTrips) {
  // A float32 tensor larger than one chunk with an odd size, a float16, a bfloat16, a float64
  // and an offset (unaligned) float32 view.
  const int64_t n0 = kStagingChunkElems * 2 + 3, n1 = 1001, n2 = 17, n3 = 5, n4 = 9;
  std::vector<float> f0(n0);
  for (int64_t i = 0; i < n0; ++i) f0[i] = static_cast<float>(i % 1000) * 0.25f;
  std::vector<uint16_t> h1(n1), b2(n2);
  for (int64_t i = 0; i < n1; ++i) h1[i] = FloatToHalf(static_cast<float>(i % 64) * 0.5f);
  for (int64_t i = 0; i < n2; ++i) b2[i] = FloatToBFloat16(static_cast<float>(i) * 2.0f);
  std::vector<double> d3 = {0.5, 1.5, -2.5, 1e10, -1e-3};
  std::vector<float> f4(n4 + 1);
  for (int64_t i = 0; i <= n4; ++i) f4[i] = 100.0f + i;
  void* t0 = Upload(f0.data(), n0 * 4);
  void* t1 = Upload(h1.data(), n1 * 2);
  void* t2 = Upload(b2.data(), n2 * 2);
  void* t3 = Upload(d3.data(), n3 * 8);
  void* t4 = static_cast<char*>(Upload(f4.data(), (n4 + 1) * 4)) + 4;  // not 16-byte aligned

  struct T {
    void* p;
    int64_t n;
    int32_t dtype;
  };
  std::vector<T> tensors = {{t0, n0, kStageF32}, {t1, n1, kStageF16}, {t2, n2, kStageBF16},
                            {t3, n3, kStageF64}, {t4, n4, kStageF32}};
  std::vector<StagingChunk> chunks;
  int64_t offset = 0;
  for (const T& t : tensors) {
    for (int64_t s = 0; s < t.n; s += kStagingChunkElems) {
      const int64_t elem = t.dtype == kStageF64 ? 8 : (t.dtype == kStageF32 ? 4 : 2);
      chunks.push_back(StagingChunk{static_cast<char*>(t.p) + s * elem, offset + s,
                                    std::min(kStagingChunkElems, t.n - s), t.dtype, 0});
    }
    offset += t.n;
  }
  const int64_t total = offset;
  StagingChunk* dchunks = static_cast<StagingChunk*>(
      Upload(chunks.data(), chunks.size() * sizeof(StagingChunk)));
  void* staging = Upload(std::vector<double>(total).data(), total * sizeof(double));

  ASSERT_EQ(LaunchGather(dchunks, chunks.size(), staging, kStageF64, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<double> flat = Download<double>(staging, total);
  int64_t at = 0;
  for (int64_t i = 0; i < n0; ++i) ASSERT_EQ(flat[at + i], f0[i]) << i;
  at += n0;
  for (int64_t i = 0; i < n1; ++i) ASSERT_EQ(flat[at + i], HalfToFloat(h1[i])) << i;
  at += n1;
  for (int64_t i = 0; i < n2; ++i) ASSERT_EQ(flat[at + i], BFloat16ToFloat(b2[i])) << i;
  at += n2;
  for (int64_t i = 0; i < n3; ++i) ASSERT_EQ(flat[at + i], d3[i]) << i;
  at += n3;
  for (int64_t i = 0; i < n4; ++i) ASSERT_EQ(flat[at + i], f4[i + 1]) << i;

  // Scatter doubled values back.
  for (double& x : flat) x *= 2;
  ASSERT_EQ(cudaMemcpy(staging, flat.data(), total * 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(LaunchScatter(dchunks, chunks.size(), staging, kStageF64, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  auto g0 = Download<float>(t0, n0);
  for (int64_t i = 0; i < n0; ++i) ASSERT_EQ(g0[i], 2 * f0[i]) << i;
  auto g1 = Download<uint16_t>(t1, n1);
  for (int64_t i = 0; i < n1; ++i) ASSERT_EQ(HalfToFloat(g1[i]), 2 * HalfToFloat(h1[i])) << i;
  auto g2 = Download<uint16_t>(t2, n2);
  for (int64_t i = 0; i < n2; ++i) {
    ASSERT_EQ(BFloat16ToFloat(g2[i]), 2 * BFloat16ToFloat(b2[i])) << i;
  }
  auto g3 = Download<double>(t3, n3);
  for (int64_t i = 0; i < n3; ++i) ASSERT_EQ(g3[i], 2 * d3[i]) << i;
  auto g4 = Download<float>(static_cast<char*>(t4) - 4, n4 + 1);
  EXPECT_EQ(g4[0], f4[0]);  // the element before the view is untouched
  for (int64_t i = 0; i < n4; ++i) ASSERT_EQ(g4[i + 1], 2 * f4[i + 1]) << i;
}

// The finite check's kernels (finite_kernels.cu) on a device: a NaN or an Inf in any dtype, in
// a later chunk of a tensor, is found and named (the smallest tensor index first); the values
// stay as they were; finite values near the limits pass.
TEST_F(NcclGpuTest, FiniteCheck_OneRank_NonFiniteInEachDTypeNamed_ValuesUnchanged) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  RoundOptions o;
  o.check_finite = true;
  o.step = 9;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
    SCOPED_TRACE(static_cast<int>(dtype));
    const int32_t code = StagingCodeOf(dtype);
    const int64_t sizes[3] = {100, kStagingChunkElems * 2 + 9, 5};
    std::vector<std::vector<char>> host(3);
    std::vector<TensorView> views;
    for (int t = 0; t < 3; ++t) {
      host[t].resize(sizes[t] * DTypeSize(dtype));
      for (int64_t i = 0; i < sizes[t]; ++i) StoreAs(host[t].data(), code, i, 1.0 + i % 7);
    }
    StoreAs(host[1].data(), code, kStagingChunkElems + 3, std::nan(""));
    StoreAs(host[2].data(), code, 4, -std::numeric_limits<double>::infinity());
    for (int t = 0; t < 3; ++t) {
      views.push_back(TensorView{Upload(host[t].data(), host[t].size()), sizes[t], dtype,
                                 Device::Cuda(0), stream_});
    }
    absl::Status s = (*comm)->AllReduceAverage(views, o, nullptr);
    EXPECT_EQ(ErrorKindOf(s), ErrorKind::kNonFinite) << s;
    std::optional<NonFiniteDetail> d = NonFiniteDetailOf(s);
    ASSERT_TRUE(d.has_value()) << s;
    EXPECT_EQ(d->tensor, 1);
    EXPECT_EQ(d->value, "NaN");
    EXPECT_EQ(d->step, 9);
    for (int t = 0; t < 3; ++t) {
      EXPECT_EQ(Download<char>(views[t].data, host[t].size()), host[t]) << "tensor " << t;
    }
    // Repaired (tensor 2's -Inf left): named next; then all finite, the round averages.
    StoreAs(host[1].data(), code, kStagingChunkElems + 3, 2.0);
    views[1].data = Upload(host[1].data(), host[1].size());
    s = (*comm)->AllReduceAverage(views, o, nullptr);
    ASSERT_TRUE(NonFiniteDetailOf(s).has_value()) << s;
    EXPECT_EQ(NonFiniteDetailOf(s)->tensor, 2);
    EXPECT_EQ(NonFiniteDetailOf(s)->value, "-Inf");
    StoreAs(host[2].data(), code, 4, dtype == DType::kFloat16 ? 65504.0 : 3.0e38);
    views[2].data = Upload(host[2].data(), host[2].size());
    s = (*comm)->AllReduceAverage(views, o, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    for (int t = 0; t < 3; ++t) {
      EXPECT_EQ(Download<char>(views[t].data, host[t].size()), host[t]) << "tensor " << t;
    }
  }
}

TEST_F(NcclGpuTest, OneRankCommunicator_ContiguousIsZeroCopy_StagedMixedIsIdentity) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();

  auto params = ContiguousParameters::Create({1000, 24, 7}, DType::kFloat32, Device::Cuda(0),
                                             stream_);
  ASSERT_TRUE(params.ok()) << params.status();
  std::vector<float> init(1031);
  for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i);
  ASSERT_EQ(cudaMemcpy((*params)->flat().data, init.data(), init.size() * 4,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // stream_ does not wait on the legacy one
  ASSERT_TRUE((*comm)->AllReduceAverage((*params)->views()).ok());
  EXPECT_TRUE((*comm)->last_was_zero_copy());
  EXPECT_EQ(Download<float>((*params)->flat().data, init.size()), init);

  std::vector<uint16_t> h = {FloatToHalf(1.5f), FloatToHalf(-3.0f)};
  std::vector<double> d = {0.125, 7.0};
  TensorView a{Upload(h.data(), 4), 2, DType::kFloat16, Device::Cuda(0), stream_};
  TensorView b{Upload(d.data(), 16), 2, DType::kFloat64, Device::Cuda(0), stream_};
  ASSERT_TRUE((*comm)->AllReduceAverage({a, b}).ok());
  EXPECT_FALSE((*comm)->last_was_zero_copy());
  EXPECT_EQ(Download<uint16_t>(a.data, 2), h);
  EXPECT_EQ(Download<double>(b.data, 2), d);
  EXPECT_TRUE((*comm)->AllReduceAverage({}).ok());

  TensorView host{h.data(), 2, DType::kFloat16};
  EXPECT_EQ((*comm)->AllReduceAverage({host}).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclGpuTest, StagingKernels_PaddedLayout_LargeAlignedFloat32_MatchesHostReference) {
  // A float32 scalar first: unpadded, it would put every later tensor at 4 mod 16 bytes and
  // off the 16-byte vector path.
  GatherScatterAgainstHost({{DType::kFloat32, 1},
                            {DType::kFloat32, 1 << 22},
                            {DType::kFloat32, 3 * kStagingChunkElems + 7},
                            {DType::kFloat32, 5}},
                           /*shift=*/0, kStageF32);
}

TEST_F(NcclGpuTest, StagingKernels_MisalignedMixedDTypes_MatchHostReference) {
  const std::vector<std::pair<DType, int64_t>> mixed = {
      {DType::kFloat32, 1},  {DType::kFloat16, 7},     {DType::kBFloat16, 9},
      {DType::kFloat32, 70001}, {DType::kFloat64, 3}, {DType::kFloat16, kStagingChunkElems + 5}};
  // 8 bytes past 16-byte alignment: naturally aligned for every dtype, never 16-byte aligned.
  GatherScatterAgainstHost(mixed, /*shift=*/8, kStageF64);
  GatherScatterAgainstHost(mixed, /*shift=*/8, kStageF32);
  // One dtype, misaligned by 2 bytes: the same-dtype copy's byte path.
  GatherScatterAgainstHost({{DType::kFloat16, 3}, {DType::kFloat16, 2 * kStagingChunkElems + 1}},
                           /*shift=*/2, kStageF16);
}

TEST_F(NcclGpuTest, OneRankCommunicator_EveryDType_AverageAndRawSumAndAvgAreIdentity) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const int32_t code = StagingCodeOf(dtype);
    const size_t es = DTypeSize(dtype);
    // Values: for the 2-byte types every bit pattern but NaNs and subnormals (which a
    // flush-to-zero kernel may zero); else a spread of magnitudes.
    const int64_t n = es == 2 ? 65536 : 3 * kStagingChunkElems + 11;
    std::vector<char> host(n * es);
    for (int64_t i = 0; i < n; ++i) {
      if (es == 2) {
        uint16_t bits = static_cast<uint16_t>(i);
        const bool nan = dtype == DType::kFloat16 ? (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff)
                                                  : (bits & 0x7f80) == 0x7f80 && (bits & 0x7f);
        const bool subnormal = dtype == DType::kFloat16
                                   ? (bits & 0x7c00) == 0 && (bits & 0x3ff)
                                   : (bits & 0x7f80) == 0 && (bits & 0x7f);
        if (nan || subnormal) bits = 0;
        std::memcpy(host.data() + i * 2, &bits, 2);
      } else {
        StoreAs(host.data(), code, i, (i % 2 ? -1.0 : 1.0) * std::ldexp(1.0 + (i % 1000) / 1000.0, static_cast<int>(i % 60) - 30));
      }
    }
    // One buffer (zero-copy except bfloat16, which is staged through float32).
    auto params = ContiguousParameters::Create({n / 2, 1, n - n / 2 - 1}, dtype, Device::Cuda(0),
                                               stream_);
    ASSERT_TRUE(params.ok()) << params.status();
    void* flat = (*params)->flat().data;
    ASSERT_EQ(cudaMemcpy(flat, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // stream_ does not wait on the legacy one
    ASSERT_TRUE((*comm)->AllReduceAverage((*params)->views()).ok());
    EXPECT_EQ((*comm)->last_was_zero_copy(), dtype != DType::kBFloat16);
    EXPECT_EQ(Download<char>(flat, host.size()), host) << "contiguous AllReduceAverage";
    // Separately allocated tensors: staged (padded layout).
    void* a = Upload(host.data(), 3 * es);
    void* b = Upload(host.data() + 3 * es, (n - 3) * es);
    std::vector<TensorView> separate = {TensorView{a, 3, dtype, Device::Cuda(0), stream_},
                                        TensorView{b, n - 3, dtype, Device::Cuda(0), stream_}};
    ASSERT_TRUE((*comm)->AllReduceAverage(separate).ok());
    EXPECT_FALSE((*comm)->last_was_zero_copy());
    std::vector<char> back = Download<char>(a, 3 * es);
    std::vector<char> rest = Download<char>(b, (n - 3) * es);
    back.insert(back.end(), rest.begin(), rest.end());
    EXPECT_EQ(back, host) << "staged AllReduceAverage";
    // NCCL's own arithmetic in this dtype, one member: ncclSum and ncclAvg are the identity.
    for (bool sum : {true, false}) {
      ASSERT_TRUE((*comm)->RawAllReduce(flat, n, dtype, stream_, sum).ok());
      EXPECT_EQ(Download<char>(flat, host.size()), host) << (sum ? "ncclSum" : "ncclAvg");
    }
  }
  int device = -1;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(device, 0);
}

// A paced round on CUDA tensors (client/averaging/round_weights.h): the weighted copy on the
// averager's device (OuterDevice with the CUDA kernels), in every dtype, is fl(s x) restated here
// bit for bit (the product in double, rounded once to float32 or float64, float16 and bfloat16
// from that float32: the host's arithmetic); the caller's tensors keep their values until the
// round (one member: the identity) has completed and Finish writes the copy into them.
TEST_F(NcclGpuTest, PacedRound_WeightedCopyOnTheDevice_EveryDType_IsTheHostsArithmetic) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  OuterDevice device(absl::Seconds(60), /*pinned_host=*/false, OpenCudaOuterDevice);
  // Rank 0's part in a two-member paced round with weights 7 and 13: s = 2 * 7 / 20.
  Decision decision;
  decision.average = true;
  decision.round = 0;
  decision.subgroup = SubgroupRange{0, 0, 2};
  decision.members = {0, 1};
  decision.weights = {7, 13};
  const absl::StatusOr<RoundWeight> weight = WeightOf(decision, 0);
  ASSERT_TRUE(weight.ok()) << weight.status();
  ASSERT_DOUBLE_EQ(weight->scale, 0.7);
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const int32_t code = StagingCodeOf(dtype);
    const size_t es = DTypeSize(dtype);
    const int64_t n = 3 * kStagingChunkElems + 11;
    std::vector<char> host(n * es), want(n * es);
    for (int64_t i = 0; i < n; ++i) {
      // Normal and (float16) subnormal magnitudes, both signs, short of float16's overflow.
      StoreAs(host.data(), code, i,
              (i % 2 ? -1.0 : 1.0) *
                  std::ldexp(1.0 + (i % 1000) / 1000.0, static_cast<int>(i % 36) - 20));
      const double product = weight->scale * LoadAs(host.data(), code, i);
      const float f = static_cast<float>(product);
      const uint16_t h = dtype == DType::kFloat16 ? FloatToHalf(f) : FloatToBFloat16(f);
      if (dtype == DType::kFloat64) {
        std::memcpy(want.data() + i * es, &product, es);
      } else if (dtype == DType::kFloat32) {
        std::memcpy(want.data() + i * es, &f, es);
      } else {
        std::memcpy(want.data() + i * es, &h, es);
      }
    }
    char* a = static_cast<char*>(Upload(host.data(), 5 * es));
    char* b = static_cast<char*>(Upload(host.data() + 5 * es, (n - 5) * es));
    const std::vector<TensorView> tensors = {TensorView{a, 5, dtype, Device::Cuda(0), stream_},
                                             TensorView{b, n - 5, dtype, Device::Cuda(0),
                                                        stream_}};
    WeightedInput copy(&device);
    absl::StatusOr<std::vector<TensorView>> views = copy.Fill(*weight, tensors, nullptr);
    ASSERT_TRUE(views.ok()) << views.status();
    ASSERT_EQ(views->size(), 2u);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<char> got = Download<char>((*views)[0].data, 5 * es);
    std::vector<char> rest = Download<char>((*views)[1].data, (n - 5) * es);
    got.insert(got.end(), rest.begin(), rest.end());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(got.data() + i * es, want.data() + i * es, es), 0)
          << "element " << i << ": " << LoadAs(got.data(), code, i) << " for " << weight->scale
          << " * " << LoadAs(host.data(), code, i);
    }
    ASSERT_TRUE((*comm)->AllReduceAverage(*views).ok());
    std::vector<char> before = Download<char>(a, 5 * es);
    rest = Download<char>(b, (n - 5) * es);
    before.insert(before.end(), rest.begin(), rest.end());
    EXPECT_EQ(before, host) << "the caller's tensors changed before Finish";
    ASSERT_TRUE(copy.Finish(tensors).ok());
    std::vector<char> after = Download<char>(a, 5 * es);
    rest = Download<char>(b, (n - 5) * es);
    after.insert(after.end(), rest.begin(), rest.end());
    EXPECT_EQ(after, want);
  }
}

TEST_F(NcclGpuTest, OneRankCommunicator_LayoutChangesAndALocalError_StayUsable) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> v(12);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.5f * i;
  void* d = Upload(v.data(), v.size() * 4);
  TensorView all{d, 12, DType::kFloat32, Device::Cuda(0), stream_};
  TensorView head{d, 10, DType::kFloat32, Device::Cuda(0), stream_};
  TensorView tail{static_cast<float*>(d) + 11, 1, DType::kFloat32, Device::Cuda(0), stream_};
  ASSERT_TRUE((*comm)->AllReduceAverage({all}).ok());
  ASSERT_TRUE((*comm)->AllReduceAverage({head}).ok());
  ASSERT_TRUE((*comm)->AllReduceAverage({head, tail}).ok());
  TensorView host{v.data(), 2, DType::kFloat32};
  EXPECT_EQ((*comm)->AllReduceAverage({head, host}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*comm)->AllReduceAverage({tail, head}).ok()) << "the communicator stays usable";
  EXPECT_EQ(Download<float>(d, 12), v);
}

TEST_F(NcclGpuTest, OneRankCommunicator_AbortFromAnotherThread_LaterCallsFailWithTheReason) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> v = {1, 2, 3};
  TensorView t{Upload(v.data(), 12), 3, DType::kFloat32, Device::Cuda(0), stream_};
  ASSERT_TRUE((*comm)->AllReduceAverage({t}).ok());
  std::thread([&] {
    (*comm)->Abort(absl::FailedPreconditionError("job moved to generation 3"));
  }).join();
  for (int i = 0; i < 2; ++i) {
    const absl::Status s = (*comm)->AllReduceAverage({t});
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("generation 3"));
  }
  EXPECT_EQ(Download<float>(t.data, 3), v);
}

TEST_F(NcclGpuTest, OneRankCommunicator_CommittedRounds_LostCommitKeepsTheResultAside) {
  // The committed round's device work (the backup copy, the int64 ncclSum commit, on the
  // caller's stream) on both paths; then a lost commit, made by a FaultyCommunicator around the
  // real one (tests/testing/: it undoes the completed round with device copies and aborts the
  // communicator), and the adoption of the kept result. With one member the average is the
  // input, so the values are checked for being unchanged; the multi-member arithmetic and
  // NcclCore's own restore and adoption after a failed commit are in client_nccl_core_test.
  for (bool zero_copy : {true, false}) {
    SCOPED_TRACE(zero_copy ? "zero copy" : "staged");
    ncclUniqueId id;
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
    ASSERT_TRUE(comm.ok()) << comm.status();
    std::vector<float> v(1000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * i - 7;
    float* d = static_cast<float*>(Upload(v.data(), v.size() * 4));
    std::vector<TensorView> views;
    if (zero_copy) {
      views = {TensorView{d, 400, DType::kFloat32, Device::Cuda(0), stream_},
               TensorView{d + 400, 600, DType::kFloat32, Device::Cuda(0), stream_}};
    } else {
      views = {TensorView{d, 400, DType::kFloat32, Device::Cuda(0), stream_},
               TensorView{d + 401, 599, DType::kFloat32, Device::Cuda(0), stream_}};
    }
    RoundOptions options;
    options.step = 3;
    options.commit = true;
    RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
    ASSERT_TRUE((*comm)->AllReduceAverage(views, options, &outcome).ok());
    EXPECT_EQ(outcome, RoundOutcome::kCompleted);
    EXPECT_EQ((*comm)->last_was_zero_copy(), zero_copy);
    EXPECT_EQ(Download<float>(d, v.size()), v);
    auto faults = std::make_shared<::modelavg::testing::CommunicatorFaults>();
    faults->LoseCommitAt(::modelavg::testing::CommunicatorFaults::kAnyStep);
    ::modelavg::testing::FaultyCommunicator faulty(*std::move(comm), faults);
    options.step = 4;
    const absl::Status s = faulty.AllReduceAverage(views, options, &outcome);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_EQ(outcome, RoundOutcome::kFailedHoldingResult);
    EXPECT_EQ(Download<float>(d, v.size()), v);
    // The communicator is aborted; the kept result is still adopted (local copies only).
    EXPECT_FALSE(faulty.AllReduceAverage(views).ok());
    ASSERT_TRUE(faulty.AdoptPendingResult(views).ok());
    EXPECT_EQ(Download<float>(d, v.size()), v);
    EXPECT_EQ(faulty.AdoptPendingResult(views).code(), absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(NcclGpuTest, ContiguousParameters_ZeroedOnTheCallersStream_BeforeItsFirstFill) {
  // Keep the legacy default stream busy: a zeroing queued there would land after the fill.
  ASSERT_EQ(cudaLaunchHostFunc(
                cudaStreamLegacy,
                [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(500)); },
                nullptr),
            cudaSuccess);
  const int64_t n = 1 << 20;
  auto params = ContiguousParameters::Create({n}, DType::kFloat32, Device::Cuda(0), stream_);
  ASSERT_TRUE(params.ok()) << params.status();
  std::vector<float> ones(n, 1.0f);
  ASSERT_EQ(cudaMemcpyAsync((*params)->flat().data, ones.data(), n * 4, cudaMemcpyHostToDevice,
                            stream_),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got = Download<float>((*params)->flat().data, n);
  EXPECT_EQ(std::count(got.begin(), got.end(), 1.0f), n)
      << "the zeroing ran after the caller's first fill";
}

TEST_F(NcclGpuTest, Create_PeerNeverArrives_DeadlineExceededAndAborted) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 2, 0, absl::Seconds(2), nullptr);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
}

TEST_F(NcclGpuTest, Create_GenerationMovesOnWhileWaiting_AbortedWithThatReason) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  const absl::Time moved = absl::Now() + absl::Milliseconds(300);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 2, 0, absl::Seconds(60), [moved] {
    return absl::Now() < moved ? absl::OkStatus()
                               : absl::FailedPreconditionError("job moved to generation 2");
  });
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kFailedPrecondition) << comm.status();
  EXPECT_THAT(std::string(comm.status().message()), ::testing::HasSubstr("generation 2"));
}

#if MODELAVG_TEST_WITH_SERVER
TEST_F(NcclGpuTest, Averager_OneRankJob_BootstrapsThroughTheCoordinator) {
  auto served = ::modelavg::testing::InProcessCoordinator::Start();
  ASSERT_TRUE(served.ok()) << served.status();
  const v1::JobSpec spec =
      ::modelavg::testing::MakeSpec("gpu1", 1, v1::HIERARCHICAL, {{1, 1}, {2, 1}}, 0);
  ASSERT_TRUE(served->admin->CreateJob(spec).ok());
  ClientOptions copts;
  copts.coordinator = served->server->address();
  copts.job_id = "gpu1";
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  auto avg = HierarchicalModelAverager::Create(client->get());
  ASSERT_TRUE(avg.ok());
  auto params = ContiguousParameters::Create({256, 256}, DType::kBFloat16, Device::Cuda(0),
                                             stream_);
  ASSERT_TRUE(params.ok()) << params.status();
  for (int s = 0; s < 4; ++s) {
    auto d = (*avg)->AverageParameters((*params)->views());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(d->average);
    EXPECT_EQ(d->level, s % 2 == 0 ? 1 : 0);
  }
  // Mixing host and CUDA tensors in one call is refused.
  float x = 0;
  std::vector<TensorView> mixed = {(*params)->views()[0], TensorView{&x, 1, DType::kFloat32}};
  EXPECT_EQ((*avg)->AverageParameters(mixed).status().code(),
            absl::StatusCode::kInvalidArgument);
}
#endif

}  // namespace
}  // namespace modelavg::client
