// The NCCL path on one GPU: the staging kernels' results, one-rank communicators (zero-copy and
// staged), abort of a communicator whose peer never arrives or whose generation moves on, and
// the bootstrap through a coordinator. NCCL refuses two ranks of one communicator on the same
// GPU, so multi-rank correctness is carried by the same code path that the Gloo tests prove.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/contiguous_parameters.h"
#include "client/half.h"
#include "client/nccl_communicator.h"
#include "client/staging_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#if MODELAVG_TEST_WITH_SERVER
#include "client/averager.h"
#include "client/client.h"
#include "client/coordinator_client.h"
#include "server/coordinator_server.h"
#endif

namespace modelavg::client {
namespace {

class NcclGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      GTEST_SKIP() << "no usable CUDA device: cudaGetDeviceCount failed with "
                   << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")";
    }
    if (count == 0) GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount returned 0";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // A device tensor filled from `host` (raw bytes of its dtype).
  void* Upload(const void* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes > 0 ? bytes : 1), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    // A pageable host-to-device cudaMemcpy may return before its DMA has landed, and the
    // legacy stream it runs on does not order the non-blocking stream_ the kernels use.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    allocations_.push_back(d);
    return d;
  }
  template <typename T>
  std::vector<T> Download(const void* d, size_t n) {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  ~NcclGpuTest() override {
    for (void* p : allocations_) cudaFree(p);
  }

  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
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
  server::ServerOptions sopts;
  auto server = server::CoordinatorServer::Start(sopts);
  ASSERT_TRUE(server.ok()) << server.status();
  CoordinatorClientOptions aopts;
  aopts.address = (*server)->address();
  auto admin = CoordinatorClient::Create(aopts);
  ASSERT_TRUE(admin.ok());
  v1::JobSpec spec;
  spec.set_job_id("gpu1");
  spec.set_world_size(1);
  spec.set_mode(v1::HIERARCHICAL);
  for (auto [p, g] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}}) {
    v1::Level* l = spec.add_levels();
    l->set_period(p);
    l->set_group_size(g);
  }
  ASSERT_TRUE((*admin)->CreateJob(spec).ok());
  ClientOptions copts;
  copts.coordinator = (*server)->address();
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
