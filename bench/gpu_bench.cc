// modelavg-bench-gpu [--sizes_mib=...] [--tensors=256] [--iters=50] [--peak_tbps=4.8]
//
// The NCCL path on one GPU, world 1, through a real Client and averager (in-process
// coordinator). For each buffer size prints one JSON line:
//   {"bytes", "raw_s" (ncclAllReduce(ncclAvg) of one flat buffer), "zero_copy_s"
//    (AverageParameters on ContiguousParameters: in place), "staged_s" (AverageParameters on
//    --tensors separately allocated tensors: gather + all-reduce + scatter), "zero_copy_over_raw",
//    "staged_over_raw", and the rounds of an elastic job, on the communicator directly:
//    "plain_s" (a plain zero-copy round), "committed_s" (a committed zero-copy round: the device
//    backup copy + the data all-reduce + the one-int64 commit all-reduce and its host wait),
//    "committed_staged_s" (a committed staged round: the commit only), "committed_over_plain"}
// then {"layout_check_s"} (a call with nothing to average on an agreed communicator: what a call
// costs beyond its data all-reduce, since the layout is agreed once per communicator), {"bf16_bytes", "raw_bf16_s", "bf16_via_fp32_s", "bf16_via_fp32_over_raw"}
// (bfloat16 reduced through float32 vs NCCL's native bfloat16 average), and one line per
// staging kernel alone (cudaEvent timing, large buffer):
//   {"kernel": "gather"|"scatter", "bytes", "s", "tbps" (read + write bytes / s),
//    "fraction_of_peak"}
// Targets: zero_copy_over_raw <= 1.05; kernel fraction_of_peak >= 0.8 on an H200 (4.8 TB/s).
// Times are medians of host wall time around calls that wait for completion.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/nccl/cuda/nccl_communicator.h"
#include "client/comm/nccl/cuda/staging_kernels.h"
#include "client/rpc/coordinator_client.h"
#include "common/cuda_check.h"
#include "common/logging.h"
#include "common/status_util.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/contiguous_parameters.h"
#include "server/coordinator_server.h"

ABSL_FLAG(std::string, sizes_mib, "0.00390625,0.0625,1,16,64,256,1024",
          "Buffer sizes in MiB (float32), comma-separated.");
ABSL_FLAG(int32_t, tensors, 256, "Tensors of the staged case.");
ABSL_FLAG(int32_t, iters, 50, "Measured iterations per size.");
ABSL_FLAG(double, peak_tbps, 4.8, "The device's peak memory bandwidth (TB/s).");
ABSL_FLAG(std::string, log_level, "warn", "spdlog level.");

namespace modelavg::bench {
namespace {

using client::DType;
using client::TensorView;

template <typename F>
absl::StatusOr<double> MedianSeconds(int iters, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < iters + 3; ++i) {
    absl::Time a = absl::Now();
    MODELAVG_RETURN_IF_ERROR(f());
    if (i >= 3) t.push_back(absl::ToDoubleSeconds(absl::Now() - a));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

absl::Status Run() {
  int count = 0;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  cudaStream_t stream;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  server::ServerOptions sopts;
  MODELAVG_ASSIGN_OR_RETURN(auto server, server::CoordinatorServer::Start(sopts));
  client::ConnectionOptions aopts;
  aopts.coordinator = server->address();
  MODELAVG_ASSIGN_OR_RETURN(auto admin, client::CoordinatorClient::Create(aopts));
  v1::JobSpec spec;
  spec.set_job_id("bench-gpu");
  spec.set_world_size(1);
  spec.set_mode(v1::PERIODIC);
  spec.add_levels()->set_period(1);
  spec.mutable_levels(0)->set_group_size(1);
  MODELAVG_RETURN_IF_ERROR(admin->CreateJob(spec).status());
  client::ClientOptions copts;
  copts.coordinator = server->address();
  copts.job_id = "bench-gpu";
  MODELAVG_ASSIGN_OR_RETURN(auto cl, client::Client::Connect(copts));
  MODELAVG_ASSIGN_OR_RETURN(auto averager, client::PeriodicModelAverager::Create(cl.get()));
  client::CommunicatorSetup setup;
  setup.coordinator = cl->coordinator();
  setup.job_id = cl->job_id();
  setup.generation = cl->generation();
  setup.subgroup = cl->schedule().SubgroupOf(0, 0);
  setup.timeout = absl::Seconds(60);
  MODELAVG_ASSIGN_OR_RETURN(client::Communicator * comm,
                            cl->communicators()->Get(setup, client::Device::Cuda(0)));
  auto* nccl = static_cast<client::NcclCommunicator*>(comm);
  const int iters = absl::GetFlag(FLAGS_iters);
  const int tensors = absl::GetFlag(FLAGS_tensors);

  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes_mib), ',')) {
    double mib = 0;
    if (!absl::SimpleAtod(s, &mib) || mib <= 0) {
      return absl::InvalidArgumentError("bad --sizes_mib");
    }
    const int64_t numel = std::max<int64_t>(1, static_cast<int64_t>(mib * 1024 * 1024 / 4));
    const int t = static_cast<int>(std::min<int64_t>(tensors, numel));
    std::vector<int64_t> split(t, numel / t);
    split.back() += numel % t;
    MODELAVG_ASSIGN_OR_RETURN(auto contiguous, client::ContiguousParameters::Create(
                                                   split, DType::kFloat32,
                                                   client::Device::Cuda(0), stream));
    // Separately allocated tensors: the staged path.
    std::vector<std::unique_ptr<client::ContiguousParameters>> separate;
    std::vector<TensorView> separate_views;
    for (int64_t n : split) {
      MODELAVG_ASSIGN_OR_RETURN(auto p, client::ContiguousParameters::Create(
                                            {n}, DType::kFloat32, client::Device::Cuda(0),
                                            stream));
      separate_views.push_back(p->flat());
      separate.push_back(std::move(p));
    }
    TensorView flat = contiguous->flat();
    MODELAVG_ASSIGN_OR_RETURN(double raw, MedianSeconds(iters, [&] {
                                return nccl->RawAllReduceAvg(flat.data, numel, DType::kFloat32,
                                                             stream);
                              }));
    MODELAVG_ASSIGN_OR_RETURN(double zero, MedianSeconds(iters, [&] {
                                return averager->AverageParameters(contiguous->views()).status();
                              }));
    MODELAVG_ASSIGN_OR_RETURN(double staged, MedianSeconds(iters, [&] {
                                return averager->AverageParameters(separate_views).status();
                              }));
    // An elastic job's committed rounds next to a plain one, on the communicator itself (the
    // averager of this strict job runs plain rounds).
    client::RoundOptions committed_round;
    committed_round.commit = true;
    MODELAVG_ASSIGN_OR_RETURN(double plain, MedianSeconds(iters, [&] {
                                return nccl->AllReduceAverage(contiguous->views());
                              }));
    MODELAVG_ASSIGN_OR_RETURN(double committed, MedianSeconds(iters, [&] {
                                return nccl->AllReduceAverage(contiguous->views(),
                                                              committed_round, nullptr);
                              }));
    MODELAVG_ASSIGN_OR_RETURN(double committed_staged, MedianSeconds(iters, [&] {
                                return nccl->AllReduceAverage(separate_views, committed_round,
                                                              nullptr);
                              }));
    std::printf(
        "{\"bytes\": %lld, \"tensors\": %d, \"raw_s\": %.6g, \"zero_copy_s\": %.6g, "
        "\"staged_s\": %.6g, \"zero_copy_over_raw\": %.4f, \"staged_over_raw\": %.4f, "
        "\"plain_s\": %.6g, \"committed_s\": %.6g, \"committed_staged_s\": %.6g, "
        "\"committed_over_plain\": %.4f}\n",
        static_cast<long long>(numel * 4), t, raw, zero, staged, zero / raw, staged / raw, plain,
        committed, committed_staged, committed / plain);
    std::fflush(stdout);
  }

  // The layout check alone (every call runs it; here with nothing to average).
  MODELAVG_ASSIGN_OR_RETURN(double check, MedianSeconds(iters, [&] {
                              return nccl->AllReduceAverage({});
                            }));
  std::printf("{\"layout_check_s\": %.6g}\n", check);
  // bfloat16 in one buffer: reduced in float32 (gather, float32 all-reduce, scatter) next to
  // NCCL's native bfloat16 ncclAvg of the same buffer.
  {
    const int64_t numel = int64_t{32} << 20;  // 64 MiB of bfloat16
    MODELAVG_ASSIGN_OR_RETURN(auto bf16, client::ContiguousParameters::Create(
                                             {numel / 2, numel / 2}, DType::kBFloat16,
                                             client::Device::Cuda(0), stream));
    MODELAVG_ASSIGN_OR_RETURN(double raw, MedianSeconds(iters, [&] {
                                return nccl->RawAllReduceAvg(bf16->flat().data, numel,
                                                             DType::kBFloat16, stream);
                              }));
    MODELAVG_ASSIGN_OR_RETURN(double avg, MedianSeconds(iters, [&] {
                                return averager->AverageParameters(bf16->views()).status();
                              }));
    std::printf("{\"bf16_bytes\": %lld, \"raw_bf16_s\": %.6g, \"bf16_via_fp32_s\": %.6g, "
                "\"bf16_via_fp32_over_raw\": %.4f}\n",
                static_cast<long long>(numel * 2), raw, avg, avg / raw);
    std::fflush(stdout);
  }

  // The kernels alone: 1 GiB over --tensors tensors, float32 -> float32 staging.
  const int64_t numel = int64_t{1} << 28;
  void *src = nullptr, *staging = nullptr;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&src, numel * 4));
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&staging, numel * 4));
  std::vector<client::StagingChunk> chunks;
  const int64_t per = numel / tensors;
  for (int i = 0; i < tensors; ++i) {
    for (int64_t st = 0; st < per; st += client::kStagingChunkElems) {
      chunks.push_back(client::StagingChunk{static_cast<char*>(src) + (i * per + st) * 4,
                                            i * per + st,
                                            std::min(client::kStagingChunkElems, per - st),
                                            client::kStageF32, 0});
    }
  }
  client::StagingChunk* dchunks = nullptr;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&dchunks, chunks.size() * sizeof(chunks[0])));
  // On the kernels' own stream: a pageable cudaMemcpy may return before its DMA has landed,
  // and the legacy stream it would use does not order the non-blocking `stream`. Without
  // this the gather read a half-written table (illegal address, or a 10 us "1 GiB" copy).
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dchunks, chunks.data(),
                                                chunks.size() * sizeof(chunks[0]),
                                                cudaMemcpyHostToDevice, stream));
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
  MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b));
  for (bool gather : {true, false}) {
    std::vector<float> ms;
    for (int i = 0; i < 23; ++i) {
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventRecord(a, stream));
      MODELAVG_CUDA_RETURN_IF_ERROR(
          gather ? client::LaunchGather(dchunks, chunks.size(), staging, client::kStageF32, stream)
                 : client::LaunchScatter(dchunks, chunks.size(), staging, client::kStageF32,
                                         stream));
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventRecord(b, stream));
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b));
      float t = 0;
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, a, b));
      if (i >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double s = ms[ms.size() / 2] / 1e3;
    const double bytes = static_cast<double>(per) * tensors * 4;
    const double tbps = 2 * bytes / s / 1e12;
    std::printf(
        "{\"kernel\": \"%s\", \"bytes\": %.0f, \"tensors\": %d, \"s\": %.6g, \"tbps\": %.4g, "
        "\"fraction_of_peak\": %.4f}\n",
        gather ? "gather" : "scatter", bytes, tensors, s, tbps,
        tbps / absl::GetFlag(FLAGS_peak_tbps));
  }
  cudaFree(src);
  cudaFree(staging);
  cudaFree(dchunks);
  cudaStreamDestroy(stream);
  return cl->Leave("benchmark done");
}

}  // namespace
}  // namespace modelavg::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  modelavg::InitLogging(absl::GetFlag(FLAGS_log_level)).IgnoreError();
  absl::Status s = modelavg::bench::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
