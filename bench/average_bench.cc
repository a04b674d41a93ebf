// modelavg-bench-average --world=W --numel=N --tensors=T --iters=I --backend=gloo|nccl
//
// Starts a coordinator in-process and W worker processes (this binary again, with
// --worker_rank). Each worker holds T float32 tensors of N elements in total (separately
// allocated, so averaging goes through the staging buffer; --contiguous: back to back in one
// allocation, as ContiguousParameters) and, I times after a warm-up, makes one call of each
// phase of --phases in turn, on the same communicator:
//   average    ModelAverager::AverageParameters (PERIODIC job, period 1: every call averages over
//              the world; --elastic: an elastic job, every round committed)
//   raw        one all-reduce of a flat N-element buffer (Gloo: a SUM all-reduce; NCCL:
//              ncclAllReduce with ncclAvg): the transport's own figure
//   plain      Communicator::AllReduceAverage
//   committed  the same with RoundOptions::commit (every round of an elastic job)
//   vote       a one-element all-reduce: what one more round trip costs
//   copies     (host) packing the tensors into one buffer and back: the copies a staging
//              buffer costs; raw + copies is the copy floor
//   ring       (Gloo) the plain round on a second communicator that averages with Gloo's ring
//              at every size (GlooAlgorithms without the direct exchange): the algorithm
//              choice measured in the same run
//   ring_committed  the same, committed
// Prints one JSON line; each *_s is the median over the iterations of the slowest rank's time
// (*_p10_s and *_p90_s the spread; *_cpu_s the median CPU time of all ranks together, every
// thread, which a loaded machine disturbs less), -1 for a phase not run:
//   {"world", "numel", "tensors", "backend", "in_place", "elastic", "contiguous", "iters",
//    "average_s", "raw_allreduce_s", "plain_round_s", "committed_round_s", "vote_s", "copies_s",
//    "avg_over_raw", "raw_over_average" (throughput against the raw all-reduce's),
//    "floor_over_raw" (raw / (raw + copies): what a staged average could reach at best),
//    "average_gbps", "raw_gbps", "committed_over_plain", "outer_over_plain", ...}
// With --outer the level has an outer optimizer (DiLoCo): average_s is then an outer step and
// "outer_over_plain" = average_s / plain_round_s, on the same buffers and communicator;
// --backup_device=cpu keeps the outer state of CUDA parameters in pinned host memory.
// --world=1 measures the call's own cost (no transport: phases average and copies only).
// The finite check (RoundOptions::check_finite, ClientOptions::check_finite, --check_finite):
// AverageParameters, plain and committed check as the flag says; after the main loop, I plain
// and I checked rounds on the same communicator, in alternating blocks of --check_block (so
// that a load that drifts during the run weighs on both alike), each block after one untimed
// round (the layout agreement): "unchecked_round_s", "checked_round_s" and
// "checked_over_unchecked" (-1 with --world=1), and "checked_algorithm", how those rounds
// travelled: "direct" (Gloo's direct exchange: two members at every size, more up to
// GlooAlgorithms::direct_max_bytes), "scatter-gather" (--scatter_max_bytes), "ring" (Gloo's ring)
// or "nccl".
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/gloo/coordinator_store.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "client/rpc/coordinator_client.h"
#include "common/logging.h"
#include "common/status_util.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "server/coordinator_server.h"
#if MODELAVG_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "client/comm/nccl/cuda/nccl_communicator.h"
#include "common/cuda_check.h"
#endif

ABSL_FLAG(int32_t, world, 2, "Worker processes.");
ABSL_FLAG(int64_t, numel, 1 << 20, "float32 elements in total per worker.");
ABSL_FLAG(int32_t, tensors, 1, "Tensors the elements are split into.");
ABSL_FLAG(int32_t, iters, 20, "Measured iterations.");
ABSL_FLAG(int32_t, warmup, 3, "Unmeasured iterations first.");
ABSL_FLAG(std::string, backend, "gloo", "gloo (host tensors) or nccl (CUDA tensors).");
ABSL_FLAG(bool, in_place, false, "ClientOptions.gloo_in_place (no staging copy).");
ABSL_FLAG(int64_t, scatter_max_bytes, 0,
          "ClientOptions.gloo_scatter_max_bytes (0: Gloo's ring above 256 KiB with more than two "
          "members; more: the scatter-gather exchange up to that size).");
ABSL_FLAG(bool, check_finite, true, "ClientOptions.check_finite (AverageParameters' rounds).");
ABSL_FLAG(bool, elastic, false,
          "An elastic job (min_world_size 1): every AverageParameters call is a committed "
          "round, with the elastic job's bookkeeping.");
ABSL_FLAG(std::string, phases, "average,raw,plain,committed,vote,copies",
          "The calls each iteration makes, in this order (comma-separated; the others print "
          "-1): average, raw, plain, committed, vote, copies (see the top of average_bench.cc). "
          "One phase alone is for profiling.");
ABSL_FLAG(bool, contiguous, false,
          "The tensors back to back in one allocation (as ContiguousParameters): averaged in "
          "place.");
ABSL_FLAG(int64_t, ring_direct_max_bytes, 0,
          "The ring phases' communicator (Gloo, more than two members): "
          "GlooAlgorithms::direct_max_bytes (0: Gloo's ring at every size; more: the direct "
          "exchange up to that many bytes, to compare thresholds in one run).");
ABSL_FLAG(int32_t, check_block, 5,
          "Rounds per block of the finite check's comparison (unchecked and checked blocks "
          "alternate).");
ABSL_FLAG(std::string, log_level, "warn", "spdlog level.");
ABSL_FLAG(bool, outer, false,
          "DiLoCo: the job's level has an outer optimizer (lr 0.7, momentum 0.9, nesterov), so "
          "every measured AverageParameters call is an outer step (pseudo-gradient, all-reduce, "
          "SGD step); compare average_s with plain_round_s (a plain average of the same "
          "buffers on the same communicator): \"outer_over_plain\".");
ABSL_FLAG(std::string, backup_device, "parameters",
          "With --outer: where the outer state lives (AveragerOptions::backup_device): "
          "\"parameters\" (the parameters' device) or \"cpu\" (pinned host memory for CUDA "
          "parameters; host parameters keep host memory either way).");
// Internal: worker mode.
ABSL_FLAG(int32_t, worker_rank, -1, "internal");
ABSL_FLAG(std::string, coordinator, "", "internal");
ABSL_FLAG(std::string, job, "", "internal");

namespace modelavg::bench {
namespace {

using client::Client;
using client::DType;
using client::TensorView;

// This process's CPU time so far (user and system, every thread).
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// The q-quantile (0..1) of `v`.
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// Per-backend buffers and the baselines.
class Buffers {
 public:
  virtual ~Buffers() = default;
  virtual std::vector<TensorView> views() = 0;
  // One all-reduce of a flat buffer of the same size.
  virtual absl::Status Raw() = 0;
  // A one-element all-reduce.
  virtual absl::Status Vote() = 0;
  // The tensors packed into one buffer and unpacked again.
  virtual absl::Status Copies() = 0;
};

class HostBuffers : public Buffers {
 public:
  // `comm` null: a world of one (no transport).
  HostBuffers(int64_t numel, int tensors, int rank, bool contiguous,
              client::GlooCommunicator* comm)
      : comm_(comm), flat_(numel, 0.0f) {
    if (contiguous) one_.assign(static_cast<size_t>(numel), static_cast<float>(rank));
    int64_t at = 0;
    for (int i = 0; i < tensors; ++i) {
      const int64_t n = numel / tensors + (i == tensors - 1 ? numel % tensors : 0);
      if (contiguous) {
        views_.push_back(TensorView{one_.data() + at, n});
      } else {
        data_.emplace_back(n, static_cast<float>(rank));
        views_.push_back(TensorView{data_.back().data(), n});
      }
      at += n;
    }
  }
  std::vector<TensorView> views() override { return views_; }
  absl::Status Raw() override {
    if (comm_ == nullptr) return absl::UnimplementedError("no transport");
    return comm_->AllReduceSum(flat_.data(), static_cast<int64_t>(flat_.size()),
                               DType::kFloat32);
  }
  absl::Status Vote() override {
    if (comm_ == nullptr) return absl::UnimplementedError("no transport");
    return comm_->AllReduceSum(&word_, 1, DType::kFloat32);
  }
  absl::Status Copies() override {
    size_t at = 0;
    for (const TensorView& v : views_) {
      std::memcpy(flat_.data() + at, v.data, v.nbytes());
      at += static_cast<size_t>(v.numel);
    }
    at = 0;
    for (const TensorView& v : views_) {
      std::memcpy(v.data, flat_.data() + at, v.nbytes());
      at += static_cast<size_t>(v.numel);
    }
    return absl::OkStatus();
  }

 private:
  client::GlooCommunicator* comm_;
  std::vector<std::vector<float>> data_;
  std::vector<float> one_;
  std::vector<TensorView> views_;
  std::vector<float> flat_;
  float word_ = 1;
};

#if MODELAVG_HAVE_CUDA
class CudaBuffers : public Buffers {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBuffers>> Create(int64_t numel, int tensors,
                                                             int device) {
    auto b = std::unique_ptr<CudaBuffers>(new CudaBuffers());
    b->device_ = device;
    b->numel_ = numel;
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->stream_, cudaStreamNonBlocking));
    for (int i = 0; i < tensors; ++i) {
      const int64_t n = numel / tensors + (i == tensors - 1 ? numel % tensors : 0);
      void* p = nullptr;
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<int64_t>(n, 1) * 4));
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, n * 4));
      b->tensors_.push_back(TensorView{p, n, DType::kFloat32, client::Device::Cuda(device),
                                       b->stream_});
    }
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&b->flat_, std::max<int64_t>(numel, 1) * 4));
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemset(b->flat_, 0, numel * 4));
    return b;
  }
  ~CudaBuffers() override {
    for (auto& t : tensors_) cudaFree(t.data);
    if (flat_) cudaFree(flat_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  void set_comm(client::NcclCommunicator* c) { comm_ = c; }
  std::vector<TensorView> views() override { return tensors_; }
  absl::Status Raw() override {
    return comm_->RawAllReduceAvg(flat_, numel_, DType::kFloat32, stream_);
  }
  absl::Status Vote() override {
    return comm_->RawAllReduceAvg(flat_, 1, DType::kFloat32, stream_);
  }
  absl::Status Copies() override { return absl::UnimplementedError("host copies only"); }

 private:
  CudaBuffers() = default;
  int device_ = 0;
  int64_t numel_ = 0;
  cudaStream_t stream_ = nullptr;
  std::vector<TensorView> tensors_;
  void* flat_ = nullptr;
  client::NcclCommunicator* comm_ = nullptr;
};
#endif

absl::Status Worker() {
  client::ClientOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.job_id = absl::GetFlag(FLAGS_job);
  o.rank = absl::GetFlag(FLAGS_worker_rank);
  o.collective_timeout = absl::Seconds(120);
  o.gloo_in_place = absl::GetFlag(FLAGS_in_place);
  o.gloo_scatter_max_bytes = absl::GetFlag(FLAGS_scatter_max_bytes);
  o.check_finite = absl::GetFlag(FLAGS_check_finite);
  MODELAVG_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(o));
  client::AveragerOptions averager_options;
  if (absl::GetFlag(FLAGS_backup_device) == "cpu") {
    averager_options.backup_device = client::AveragerOptions::BackupDevice::kHost;
  }
  MODELAVG_ASSIGN_OR_RETURN(auto averager,
                            client::PeriodicModelAverager::Create(client.get(), averager_options));
  const int64_t numel = absl::GetFlag(FLAGS_numel);
  const int tensors = absl::GetFlag(FLAGS_tensors);
  const bool nccl = absl::GetFlag(FLAGS_backend) == "nccl";

  client::CommunicatorSetup setup;
  setup.coordinator = client->coordinator();
  setup.job_id = client->job_id();
  setup.generation = client->generation();
  setup.level = 0;
  setup.subgroup = client->schedule().SubgroupOf(0, client->rank());
  setup.rank = client->rank();
  setup.credential = client->credential();
  setup.timeout = o.collective_timeout;
  // The averager must find the same communicator (an elastic job's has no in-place mode).
  setup.gloo_in_place = o.gloo_in_place && !absl::GetFlag(FLAGS_elastic);
  setup.gloo_scatter_max_bytes = o.gloo_scatter_max_bytes;

  std::unique_ptr<Buffers> buffers;
  client::Communicator* round_comm = nullptr;
  // How the plain rounds travel (Gloo: the direct exchange or the ring; see GlooAlgorithms).
  std::string algorithm = "nccl";
  if (!nccl) {
    MODELAVG_ASSIGN_OR_RETURN(client::Communicator * comm,
                              client->communicators()->Get(setup, client::Device::Host()));
    // Null in a world of one (a communicator without a transport).
    auto* gloo = dynamic_cast<client::GlooCommunicator*>(comm);
    const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
    algorithm = gloo == nullptr                ? "none"
                : gloo->ScatterGather(bytes) ? "scatter-gather"
                : gloo->Direct(bytes)        ? "direct"
                                             : "ring";
    round_comm = comm;
    buffers = std::make_unique<HostBuffers>(numel, tensors, client->rank(),
                                            absl::GetFlag(FLAGS_contiguous), gloo);
  } else {
#if MODELAVG_HAVE_CUDA
    int count = 0;
    MODELAVG_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
    const int device = client->rank() % count;
    MODELAVG_ASSIGN_OR_RETURN(auto cuda, CudaBuffers::Create(numel, tensors, device));
    MODELAVG_ASSIGN_OR_RETURN(client::Communicator * comm,
                              client->communicators()->Get(setup, client::Device::Cuda(device)));
    cuda->set_comm(static_cast<client::NcclCommunicator*>(comm));
    round_comm = comm;
    buffers = std::move(cuda);
#else
    return absl::UnimplementedError("this build has no CUDA/NCCL: use --backend=gloo");
#endif
  }
  // The ring-only communicator, when a phase needs it (Gloo, two or more members).
  std::unique_ptr<client::GlooCommunicator> ring;
  if (!nccl && client->schedule().spec().world_size > 1 &&
      absl::StrContains(absl::GetFlag(FLAGS_phases), "ring")) {
    client::CoordinatorStore store(setup, "bench-ring/");
    MODELAVG_ASSIGN_OR_RETURN(auto device, client::CreateGlooDevice("127.0.0.1"));
    client::GlooAlgorithms ring_only;
    ring_only.direct_pairs = false;
    ring_only.direct_max_bytes = absl::GetFlag(FLAGS_ring_direct_max_bytes);
    ring_only.scatter_max_bytes = 0;
    MODELAVG_ASSIGN_OR_RETURN(
        ring, client::GlooCommunicator::Create(store, device, client->rank(),
                                               client->schedule().spec().world_size,
                                               o.collective_timeout, nullptr, setup.gloo_in_place,
                                               nullptr, ring_only));
  }
  std::vector<TensorView> views = buffers->views();
  // The main loop's rounds check as AverageParameters does (one layout agreement, not one per
  // call).
  client::RoundOptions plain_round;
  plain_round.check_finite = absl::GetFlag(FLAGS_check_finite);
  client::RoundOptions commit = plain_round;
  commit.commit = true;
  const std::map<std::string, std::function<absl::Status()>> calls = {
      {"average", [&] { return averager->AverageParameters(views).status(); }},
      {"raw", [&] { return buffers->Raw(); }},
      {"plain", [&] { return round_comm->AllReduceAverage(views, plain_round, nullptr); }},
      {"committed", [&] { return round_comm->AllReduceAverage(views, commit, nullptr); }},
      {"vote", [&] { return buffers->Vote(); }},
      {"copies", [&] { return buffers->Copies(); }},
      {"ring",
       [&] {
         return ring == nullptr ? absl::UnimplementedError("no ring") : ring->AllReduceAverage(views);
       }},
      {"ring_committed",
       [&] {
         return ring == nullptr ? absl::UnimplementedError("no ring")
                                : ring->AllReduceAverage(views, commit, nullptr);
       }},
  };
  // Each phase's samples; a phase the backend or the world cannot run is dropped (alike on
  // every member: a property of the backend and the world).
  std::vector<std::pair<std::string, std::vector<double>>> samples;
  for (absl::string_view p : absl::StrSplit(absl::GetFlag(FLAGS_phases), ',')) {
    if (calls.count(std::string(p)) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown phase '", p, "'"));
    }
    samples.emplace_back(std::string(p), std::vector<double>{});
  }
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  const int world = client->schedule().spec().world_size;
  // phase -> per iteration, this process's CPU time (every thread: the transport's too).
  std::map<std::string, std::vector<double>> cpu;
  for (int i = 0; i < warmup + iters; ++i) {
    for (auto it = samples.begin(); it != samples.end();) {
      // The members start each call together (a one-element all-reduce, not timed), so that a
      // call's time is not the previous call's skew between members.
      if (world > 1) MODELAVG_RETURN_IF_ERROR(buffers->Vote());
      const double c0 = ProcessCpuSeconds();
      const absl::Time t0 = absl::Now();
      absl::Status s = calls.at(it->first)();
      const absl::Time t1 = absl::Now();
      const double c1 = ProcessCpuSeconds();
      if (absl::IsUnimplemented(s)) {
        it = samples.erase(it);
        continue;
      }
      MODELAVG_RETURN_IF_ERROR(s);
      if (i >= warmup) {
        it->second.push_back(absl::ToDoubleSeconds(t1 - t0));
        cpu[it->first].push_back(c1 - c0);
      }
      ++it;
    }
  }
  // The finite check's cost: blocks of plain rounds and of checked ones, alternating (switching
  // between them agrees on the layout again, so each block starts with an untimed round),
  // printed as the phases "unchecked" and "checked".
  if (world > 1) {
    client::RoundOptions check;
    check.check_finite = true;
    const size_t first = samples.size();
    samples.emplace_back("unchecked", std::vector<double>{});
    samples.emplace_back("checked", std::vector<double>{});
    const int block = std::max(1, absl::GetFlag(FLAGS_check_block));
    for (int done = 0; done < iters; done += block) {
      const int n = std::min(block, iters - done);
      for (size_t k = 0; k < 2; ++k) {
        const client::RoundOptions o = k == 0 ? client::RoundOptions{} : check;
        auto& [name, values] = samples[first + k];
        for (int i = 0; i <= n; ++i) {
          const double c0 = ProcessCpuSeconds();
          const absl::Time t0 = absl::Now();
          MODELAVG_RETURN_IF_ERROR(round_comm->AllReduceAverage(views, o, nullptr));
          const absl::Time t1 = absl::Now();
          const double c1 = ProcessCpuSeconds();
          if (i == 0) continue;
          values.push_back(absl::ToDoubleSeconds(t1 - t0));
          cpu[name].push_back(c1 - c0);
        }
      }
    }
  }
  std::printf("algorithm %s\n", algorithm.c_str());
  // One line per phase: its name, then its samples in iteration order; then its CPU times
  // under the name "cpu:<phase>".
  for (const auto& [name, values] : samples) {
    std::printf("%s", name.c_str());
    for (double v : values) std::printf(" %.9g", v);
    std::printf("\ncpu:%s", name.c_str());
    for (double v : cpu[name]) std::printf(" %.9g", v);
    std::printf("\n");
  }
  std::fflush(stdout);
  buffers.reset();
  return client->Leave("benchmark done");
}

absl::Status Driver(const char* self) {
  const int world = absl::GetFlag(FLAGS_world);
  const int64_t numel = absl::GetFlag(FLAGS_numel);
  const int tensors = absl::GetFlag(FLAGS_tensors);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (world < 1 || numel < 1 || tensors < 1 || tensors > numel || absl::GetFlag(FLAGS_iters) < 1) {
    return absl::InvalidArgumentError(
        "need --world >= 1, --numel >= 1, 1 <= --tensors <= --numel, --iters >= 1");
  }
  if (absl::GetFlag(FLAGS_backup_device) != "parameters" &&
      absl::GetFlag(FLAGS_backup_device) != "cpu") {
    return absl::InvalidArgumentError("--backup_device must be parameters or cpu");
  }
  if (backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError("--backend must be gloo or nccl");
  }
  server::ServerOptions sopts;
  MODELAVG_ASSIGN_OR_RETURN(auto server, server::CoordinatorServer::Start(sopts));
  client::ConnectionOptions aopts;
  aopts.coordinator = server->address();
  MODELAVG_ASSIGN_OR_RETURN(auto admin, client::CoordinatorClient::Create(aopts));
  const std::string job = absl::StrCat("bench-average-", getpid());
  v1::JobSpec spec;
  spec.set_job_id(job);
  spec.set_world_size(world);
  spec.set_mode(v1::PERIODIC);
  v1::Level* level = spec.add_levels();
  level->set_period(1);
  level->set_group_size(world);
  if (absl::GetFlag(FLAGS_elastic)) spec.set_min_world_size(1);
  if (absl::GetFlag(FLAGS_outer)) {
    level->mutable_outer()->set_lr(0.7);
    level->mutable_outer()->set_momentum(0.9);
    level->mutable_outer()->set_nesterov(true);
  }
  MODELAVG_RETURN_IF_ERROR(admin->CreateJob(spec).status());

  // The ranks' outputs, in a folder of this run's own ($TMPDIR or /tmp), removed at the end
  // unless a rank failed (its output is then kept, and named).
  const char* tmpdir = std::getenv("TMPDIR");
  std::string dir_tmpl = absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp",
                                      "/modelavg-bench-average.XXXXXX");
  if (mkdtemp(dir_tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot make a folder ", dir_tmpl, ": ",
                                            std::strerror(errno)));
  }
  const std::string dir = dir_tmpl;
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {
        self, absl::StrCat("--worker_rank=", r), "--coordinator=" + server->address(),
        "--job=" + job, absl::StrCat("--numel=", numel), absl::StrCat("--tensors=", tensors),
        absl::StrCat("--iters=", absl::GetFlag(FLAGS_iters)),
        absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup)), "--backend=" + backend,
        "--log_level=" + absl::GetFlag(FLAGS_log_level),
        absl::StrCat("--in_place=", absl::GetFlag(FLAGS_in_place) ? "true" : "false"),
        absl::StrCat("--elastic=", absl::GetFlag(FLAGS_elastic) ? "true" : "false"),
        "--phases=" + absl::GetFlag(FLAGS_phases),
        absl::StrCat("--contiguous=", absl::GetFlag(FLAGS_contiguous) ? "true" : "false"),
        "--backup_device=" + absl::GetFlag(FLAGS_backup_device),
        absl::StrCat("--check_finite=", absl::GetFlag(FLAGS_check_finite) ? "true" : "false"),
        absl::StrCat("--ring_direct_max_bytes=", absl::GetFlag(FLAGS_ring_direct_max_bytes)),
        absl::StrCat("--scatter_max_bytes=", absl::GetFlag(FLAGS_scatter_max_bytes)),
        absl::StrCat("--check_block=", absl::GetFlag(FLAGS_check_block))};
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    outs.push_back(absl::StrCat(dir, "/rank", r, ".out"));
    const std::string out = outs.back();
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) dup2(fd, 1);
      execv(args[0], args.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  // phase -> per iteration, the slowest rank's time.
  std::map<std::string, std::vector<double>> slowest;
  std::string algorithm = "none";
  absl::Status failed;
  for (int r = 0; r < world; ++r) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      failed = absl::InternalError(absl::StrCat("worker ", r, " failed (see its stderr above; ",
                                                "its output is in ", outs[r], ")"));
      continue;
    }
    std::ifstream in(outs[r]);
    std::string line;
    int phases = 0;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string name;
      words >> name;
      if (name == "algorithm") {
        words >> algorithm;
        continue;
      }
      // Wall times: the slowest rank's; CPU times: every rank's together.
      const bool is_cpu = absl::StartsWith(name, "cpu:");
      std::vector<double>& all = slowest[name];
      double v;
      for (size_t i = 0; words >> v; ++i) {
        if (i >= all.size()) all.push_back(is_cpu ? 0 : v);
        all[i] = is_cpu ? all[i] + v : std::max(all[i], v);
      }
      ++phases;
    }
    if (phases == 0) {
      failed = absl::InternalError(absl::StrCat("worker ", r, " printed nothing (", outs[r], ")"));
    }
  }
  server->Shutdown();
  MODELAVG_RETURN_IF_ERROR(failed);
  std::error_code removed;
  std::filesystem::remove_all(dir, removed);
  const auto q = [&](const char* phase, double quantile) {
    auto it = slowest.find(phase);
    return it == slowest.end() ? -1.0 : Quantile(it->second, quantile);
  };
  const auto ratio = [](double a, double b) { return a > 0 && b > 0 ? a / b : -1.0; };
  const double average_s = q("average", 0.5), raw_s = q("raw", 0.5), plain_s = q("plain", 0.5),
               committed_s = q("committed", 0.5), copies_s = q("copies", 0.5);
  const double bytes = static_cast<double>(numel) * 4;
  std::string out = absl::StrFormat(
      "{\"world\": %d, \"numel\": %d, \"tensors\": %d, \"backend\": \"%s\", "
      "\"in_place\": %s, \"elastic\": %s, \"contiguous\": %s, \"iters\": %d",
      world, numel, tensors, backend, absl::GetFlag(FLAGS_in_place) ? "true" : "false",
      absl::GetFlag(FLAGS_elastic) ? "true" : "false",
      absl::GetFlag(FLAGS_contiguous) ? "true" : "false", absl::GetFlag(FLAGS_iters));
  const std::pair<const char*, const char*> keys[] = {
      {"average", "average_s"}, {"raw", "raw_allreduce_s"}, {"plain", "plain_round_s"},
      {"committed", "committed_round_s"}, {"vote", "vote_s"}, {"copies", "copies_s"},
      {"ring", "ring_round_s"}, {"ring_committed", "ring_committed_s"},
      {"unchecked", "unchecked_round_s"}, {"checked", "checked_round_s"}};
  for (const auto& [phase, key] : keys) {
    std::string k(key);
    k.resize(k.size() - 2);
    absl::StrAppendFormat(&out,
                          ", \"%s\": %.6g, \"%s_p10_s\": %.6g, \"%s_p90_s\": %.6g, "
                          "\"%s_cpu_s\": %.6g",
                          key, q(phase, 0.5), k, q(phase, 0.1), k, q(phase, 0.9), k,
                          q(absl::StrCat("cpu:", phase).c_str(), 0.5));
  }
  absl::StrAppendFormat(
      &out,
      ", \"avg_over_raw\": %.4f, \"raw_over_average\": %.4f, \"floor_over_raw\": %.4f, "
      "\"average_gbps\": %.4g, \"raw_gbps\": %.4g, \"committed_over_plain\": %.4f, "
      "\"outer\": %s, \"outer_over_plain\": %.4f, \"backup_device\": \"%s\", "
      "\"check_finite\": %s, \"checked_over_unchecked\": %.4f, "
      "\"checked_algorithm\": \"%s\"}\n",
      ratio(average_s, raw_s), ratio(raw_s, average_s),
      raw_s > 0 && copies_s >= 0 ? raw_s / (raw_s + copies_s) : -1.0,
      average_s > 0 ? bytes / average_s / 1e9 : -1.0, raw_s > 0 ? bytes / raw_s / 1e9 : -1.0,
      ratio(committed_s, plain_s), absl::GetFlag(FLAGS_outer) ? "true" : "false",
      absl::GetFlag(FLAGS_outer) ? ratio(average_s, plain_s) : -1.0,
      absl::GetFlag(FLAGS_backup_device), absl::GetFlag(FLAGS_check_finite) ? "true" : "false",
      ratio(q("checked", 0.5), q("unchecked", 0.5)), algorithm);
  std::fputs(out.c_str(), stdout);
  return absl::OkStatus();
}

}  // namespace
}  // namespace modelavg::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  modelavg::InitLogging(absl::GetFlag(FLAGS_log_level)).IgnoreError();
  absl::Status s = absl::GetFlag(FLAGS_worker_rank) >= 0
                       ? modelavg::bench::Worker()
                       : modelavg::bench::Driver("/proc/self/exe");
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
