// The outer optimizer on CUDA parameters (DiLoCo on the NCCL path) on one GPU: the device
// kernels (client/outer/cuda/outer_kernels.cu, through CudaOuterKernels and DeviceOuterState)
// against the host implementation (OuterLevelState, which tests/integration/client_outer_test
// checks against a naive restatement of the rule) bit for bit, every step, every dtype, with the
// state on the device and in pinned host memory (backup_device), and one element against a
// naive double restatement of the rule; then the averager end to end on a one-rank job through a
// coordinator. NCCL refuses two ranks on one GPU, so every round averages one member: the
// members' arithmetic is covered on the host by tests/unit/client_nccl_outer_test.cc.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/comm/nccl/cuda/cuda_local_ops.h"
#include "client/comm/nccl/cuda/nccl_communicator.h"
#include "client/outer/cuda/cuda_outer_device.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_state.h"
#include "client/payload/staging_layout.h"
#include "gtest/gtest.h"
#include "tests/gpu/cuda_device_test.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/tools/make_job_spec.h"
#include "tests/reference/staging_reference.h"
#if MODELAVG_TEST_WITH_SERVER
#include "client/rpc/coordinator_client.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/contiguous_parameters.h"
#include "server/coordinator_server.h"
#include "tests/testing/in_process_coordinator.h"
#endif

namespace modelavg::client {
namespace {

struct Case {
  DType dtype;
  bool pinned;
};

using NcclOuterGpuTest = ::modelavg::testing::CudaDeviceTest<::testing::TestWithParam<Case>>;

// Element i of tensor t at step s before the call: a varying update on each element.
double Update(size_t t, int64_t i, int64_t s) {
  return 0.5 * (s + 1) + 0.125 * static_cast<double>(t) + 0.001 * static_cast<double>(i % 1000);
}

TEST_P(NcclOuterGpuTest, DeviceOuterSteps_EqualTheHostImplementationBitForBit) {
  const Case c = GetParam();
  const std::vector<int64_t> sizes = {1, 37, kStagingChunkElems * 2 + 3};
  const int32_t code = StagingCodeOf(c.dtype);
  const OuterSgd rule{0.7, 0.9, true};
  // Host twin: the same tensors in host memory, stepped by OuterLevelState.
  std::vector<std::vector<char>> host(sizes.size());
  std::vector<TensorView> host_views, device_views;
  for (size_t t = 0; t < sizes.size(); ++t) {
    host[t].resize(sizes[t] * DTypeSize(c.dtype));
    for (int64_t i = 0; i < sizes[t]; ++i) StoreAs(host[t].data(), code, i, 0.01 * i);
    host_views.push_back(TensorView{host[t].data(), sizes[t], c.dtype});
    void* d = Alloc(host[t].size());
    ASSERT_EQ(cudaMemcpy(d, host[t].data(), host[t].size(), cudaMemcpyHostToDevice), cudaSuccess);
    device_views.push_back(TensorView{d, sizes[t], c.dtype, Device::Cuda(0), stream_});
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  auto comm = NcclCommunicator::CreateWithId(id, 0, 1, 0, absl::Seconds(60), nullptr);
  ASSERT_TRUE(comm.ok()) << comm.status();
  CudaLocalOps ops(0, absl::Seconds(60));
  CudaOuterKernels kernels(0);
  auto device_state = std::make_unique<DeviceOuterState>(&ops, &kernels, 0, rule, c.pinned);
  GrowableBuffer gradient;
  OuterLevelState host_state(0, rule);
  OuterBuffer host_gradient;
  // Naive double restatement for one element (tensor 2, element 5), world 1: D = A - x.
  std::optional<double> a_ref, m_ref;
  double x_ref = LoadAs(host[2].data(), code, 5);
  for (int64_t s = 0; s < 8; ++s) {
    // The same update on both twins (rounded to the dtype on the host, then copied).
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (int64_t i = 0; i < sizes[t]; ++i) {
        StoreAs(host[t].data(), code, i, LoadAs(host[t].data(), code, i) + Update(t, i, s));
      }
      ASSERT_EQ(cudaMemcpy(device_views[t].data, host[t].data(), host[t].size(),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    x_ref = LoadAs(host[2].data(), code, 5);
    int64_t step = s;
    absl::Status d = RunDeviceOuterStep(
        device_state.get(), &gradient, device_views, /*first_step=*/s == 0, false,
        [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
          RoundOptions o;
          o.step = step;
          o.commit = true;
          o.layout_signature = layout_signature;
          return (*comm)->AllReduceAverage(tensors, o, nullptr);
        });
    ASSERT_TRUE(d.ok()) << "step " << s << ": " << d;
    // Host: the same rule on the same values (one member: the mean is the member's own).
    if (s == 0) {
      ASSERT_TRUE(host_state.SetAnchor(host_views).ok());
      a_ref = x_ref;
    } else {
      host_gradient.Shape(host_views);
      std::vector<TensorView> g = host_gradient.Views();
      ASSERT_TRUE(host_state.PseudoGradient(0, host_views, g).ok());
      ASSERT_TRUE(host_state.Step(0, g, host_views).ok());
      const double D = *a_ref - x_ref;
      m_ref = m_ref.has_value() ? rule.momentum * *m_ref + D : D;
      *a_ref -= rule.lr * (D + rule.momentum * *m_ref);
    }
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<char> got(host[t].size());
      ASSERT_EQ(cudaMemcpy(got.data(), device_views[t].data, got.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(std::memcmp(got.data(), host[t].data(), got.size()), 0)
          << "step " << s << " tensor " << t << ": the device differs from the host";
    }
    const double tol = (c.dtype == DType::kFloat64 ? 1e-12 : c.dtype == DType::kFloat32 ? 1e-5
                                                                                         : 2e-2) *
                       std::max(1.0, std::abs(*a_ref));
    EXPECT_NEAR(LoadAs(host[2].data(), code, 5), *a_ref, tol) << "step " << s;
  }
  auto a = device_state->AnchorTensors();
  auto m = device_state->MomentumTensors();
  ASSERT_TRUE(a.ok() && m.ok());
  const std::vector<StateTensor> ha = host_state.AnchorTensors();
  const std::vector<StateTensor> hm = host_state.MomentumTensors();
  for (size_t t = 0; t < sizes.size(); ++t) {
    EXPECT_EQ((*a)[t].bytes, ha[t].bytes) << "anchor " << t;
    EXPECT_EQ((*m)[t].bytes, hm[t].bytes) << "momentum " << t;
  }
  device_state.reset();
  gradient.Release(ops);
}

INSTANTIATE_TEST_SUITE_P(
    DTypesAndBackup, NcclOuterGpuTest,
    ::testing::Values(Case{DType::kFloat32, false}, Case{DType::kFloat32, true},
                      Case{DType::kBFloat16, false}, Case{DType::kFloat16, true},
                      Case{DType::kFloat64, false}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(DTypeName(info.param.dtype)) + (info.param.pinned ? "_PinnedHost" : "");
    });

#if MODELAVG_TEST_WITH_SERVER
// The averager end to end: a one-rank PERIODIC job whose level has an outer optimizer, on CUDA
// parameters, with backup_device on the device and on the host; the values match a naive double
// restatement of the rule (one member: D = A - x).
TEST(NcclOuterAveragerGpuTest, OneRankOuterJob_CudaParameters_FollowTheRule) {
  MODELAVG_REQUIRE_OR_SKIP_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto served = ::modelavg::testing::InProcessCoordinator::Start();
  ASSERT_TRUE(served.ok()) << served.status();
  for (int pinned = 0; pinned < 2; ++pinned) {
    const std::string job = absl::StrCat("gpu-outer-", pinned);
    v1::JobSpec spec = ::modelavg::testing::MakeSpec(job, 1, v1::PERIODIC, {{2, 1}}, 0);
    ::modelavg::testing::SetOuter(&spec, 0, 0.7, 0.9, true);
    ASSERT_TRUE(served->admin->CreateJob(spec).ok());
    ClientOptions copts;
    copts.coordinator = served->server->address();
    copts.job_id = job;
    auto client = Client::Connect(copts);
    ASSERT_TRUE(client.ok()) << client.status();
    AveragerOptions options;
    if (pinned == 1) options.backup_device = AveragerOptions::BackupDevice::kHost;
    auto avg = PeriodicModelAverager::Create(client->get(), options);
    ASSERT_TRUE(avg.ok());
    auto params = ContiguousParameters::Create({256, 1000}, DType::kFloat32, Device::Cuda(0),
                                               stream);
    ASSERT_TRUE(params.ok()) << params.status();
    std::vector<float> x(1256, 0.0f);
    std::optional<double> a, m;
    double xr = 0;
    for (int s = 0; s < 9; ++s) {
      for (float& v : x) v += 0.5f * (s + 1);
      xr += 0.5 * (s + 1);
      ASSERT_EQ(cudaMemcpy((*params)->views()[0].data, x.data(), x.size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto d = (*avg)->AverageParameters((*params)->views());
      ASSERT_TRUE(d.ok()) << d.status();
      if (s % 2 == 0) {
        if (!a.has_value()) {
          a = xr;
        } else {
          const double D = *a - xr;
          m = m.has_value() ? 0.9 * *m + D : D;
          *a -= 0.7 * (D + 0.9 * *m);
          xr = *a;
        }
      }
      ASSERT_EQ(cudaMemcpy(x.data(), (*params)->views()[0].data, x.size() * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_NEAR(x[1000], xr, 1e-4 * std::max(1.0, std::abs(xr))) << "step " << s;
    }
    const AveragerState st = (*avg)->state_dict();
    ASSERT_EQ(st.anchors.count(0), 1u);
    EXPECT_NEAR(reinterpret_cast<const float*>(st.anchors.at(0)[1].bytes.data())[10], *a,
                1e-4 * std::abs(*a));
  }
  cudaStreamDestroy(stream);
}
#endif

}  // namespace
}  // namespace modelavg::client
