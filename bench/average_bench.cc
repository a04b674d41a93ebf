// modelavg-bench-average --world=W --numel=N --tensors=T --iters=I --backend=gloo|nccl
//
// Starts a coordinator in-process and W worker processes (this binary again, with
// --worker_rank). Each worker holds T float32 tensors of N elements in total (separately
// allocated, so averaging goes through the staging buffer) and alternates, I times after a
// warm-up, one AverageParameters call (PERIODIC job, period 1: every call averages over the
// world) and one raw all-reduce of a flat N-element buffer on the same communicator (Gloo: a
// SUM all-reduce; NCCL: ncclAllReduce with ncclAvg). Prints one JSON line:
//   {"world", "numel", "tensors", "backend", "iters", "average_s", "raw_allreduce_s",
//    "avg_over_raw", "average_gbps", "raw_gbps"}
// where *_s are the median wall time of one call on the slowest rank, and avg_over_raw =
// average_s / raw_allreduce_s (the target is <= 1/0.9, i.e. >= 0.9x the raw throughput).
// It also times, on the same communicator, a plain round (Communicator::AllReduceAverage) and a
// committed one (RoundOptions::commit, as every round of an elastic job: the backup of the
// parameters and the one-element confirmation): "plain_round_s", "committed_round_s" and
// "committed_over_plain" (-1 where the backend has no committed rounds). With --in_place the
// plain round keeps no backup, so the ratio is the whole cost of an elastic round.
// With --outer the level has an outer optimizer (DiLoCo): average_s is then an outer step and
// "outer_over_plain" = average_s / plain_round_s, on the same buffers and communicator;
// --backup_device=cpu keeps the outer state of CUDA parameters in pinned host memory.
// The finite check (RoundOptions::check_finite, ClientOptions::check_finite): after the main
// loop, I plain rounds and then I checked rounds on the same communicator, each after one
// untimed round (the layout agreement): "unchecked_round_s", "checked_round_s" and
// "checked_over_unchecked". --check_finite=false runs AverageParameters without the check.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/comm/communicator_cache.h"
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
ABSL_FLAG(bool, check_finite, true, "ClientOptions.check_finite (AverageParameters' rounds).");
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

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Per-backend buffers and the raw all-reduce.
class Buffers {
 public:
  virtual ~Buffers() = default;
  virtual std::vector<TensorView> views() = 0;
  virtual absl::Status Raw() = 0;
};

class HostBuffers : public Buffers {
 public:
  HostBuffers(int64_t numel, int tensors, int rank, client::GlooCommunicator* comm)
      : comm_(comm), flat_(numel, 0.0f) {
    for (int i = 0; i < tensors; ++i) {
      const int64_t n = numel / tensors + (i == tensors - 1 ? numel % tensors : 0);
      data_.emplace_back(n, static_cast<float>(rank));
    }
  }
  std::vector<TensorView> views() override {
    std::vector<TensorView> v;
    for (auto& d : data_) v.push_back(TensorView{d.data(), static_cast<int64_t>(d.size())});
    return v;
  }
  absl::Status Raw() override {
    return comm_->AllReduceSum(flat_.data(), static_cast<int64_t>(flat_.size()),
                               DType::kFloat32);
  }

 private:
  client::GlooCommunicator* comm_;
  std::vector<std::vector<float>> data_;
  std::vector<float> flat_;
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
  setup.gloo_in_place = o.gloo_in_place;  // the averager must find the same communicator
  std::unique_ptr<Buffers> buffers;
  client::Communicator* round_comm = nullptr;
  if (!nccl) {
    MODELAVG_ASSIGN_OR_RETURN(client::Communicator * comm,
                              client->communicators()->Get(setup, client::Device::Host()));
    auto* gloo = dynamic_cast<client::GlooCommunicator*>(comm);
    if (gloo == nullptr) return absl::InvalidArgumentError("--world must be >= 2 for gloo");
    round_comm = comm;
    buffers = std::make_unique<HostBuffers>(numel, tensors, client->rank(), gloo);
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
  std::vector<TensorView> views = buffers->views();
  std::vector<double> avg, raw, plain, committed;
  const int warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iters);
  // The main loop's rounds check as AverageParameters does (one layout agreement, not one per
  // call).
  client::RoundOptions plain_round;
  plain_round.check_finite = absl::GetFlag(FLAGS_check_finite);
  client::RoundOptions commit = plain_round;
  commit.commit = true;
  bool has_committed = true;
  for (int i = 0; i < warmup + iters; ++i) {
    absl::Time t0 = absl::Now();
    MODELAVG_RETURN_IF_ERROR(averager->AverageParameters(views).status());
    absl::Time t1 = absl::Now();
    MODELAVG_RETURN_IF_ERROR(buffers->Raw());
    absl::Time t2 = absl::Now();
    MODELAVG_RETURN_IF_ERROR(round_comm->AllReduceAverage(views, plain_round, nullptr));
    absl::Time t3 = absl::Now();
    if (has_committed) {
      absl::Status c = round_comm->AllReduceAverage(views, commit, nullptr);
      if (absl::IsUnimplemented(c)) {
        has_committed = false;  // the same on every member: the backend's property
      } else {
        MODELAVG_RETURN_IF_ERROR(c);
      }
    }
    absl::Time t4 = absl::Now();
    if (i >= warmup) {
      avg.push_back(absl::ToDoubleSeconds(t1 - t0));
      raw.push_back(absl::ToDoubleSeconds(t2 - t1));
      plain.push_back(absl::ToDoubleSeconds(t3 - t2));
      committed.push_back(absl::ToDoubleSeconds(t4 - t3));
    }
  }
  // The finite check's cost: a block of plain rounds, then a block of checked ones (switching
  // between them agrees on the layout again, so each block starts with an untimed round).
  std::vector<double> unchecked, checked;
  client::RoundOptions check;
  check.check_finite = true;
  for (const client::RoundOptions& o : {client::RoundOptions{}, check}) {
    std::vector<double>& out = o.check_finite ? checked : unchecked;
    for (int i = 0; i <= iters; ++i) {
      absl::Time t0 = absl::Now();
      MODELAVG_RETURN_IF_ERROR(round_comm->AllReduceAverage(views, o, nullptr));
      if (i > 0) out.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    }
  }
  std::printf(
      "{\"rank\": %d, \"average_s\": %.9g, \"raw_allreduce_s\": %.9g, \"plain_round_s\": "
      "%.9g, \"committed_round_s\": %.9g, \"unchecked_round_s\": %.9g, "
      "\"checked_round_s\": %.9g}\n",
      client->rank(), Median(avg), Median(raw), Median(plain),
      has_committed ? Median(committed) : -1.0, Median(unchecked), Median(checked));
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
  if (absl::GetFlag(FLAGS_outer)) {
    level->mutable_outer()->set_lr(0.7);
    level->mutable_outer()->set_momentum(0.9);
    level->mutable_outer()->set_nesterov(true);
  }
  MODELAVG_RETURN_IF_ERROR(admin->CreateJob(spec).status());

  char dir_tmpl[] = "/tmp/modelavg-bench-average.XXXXXX";
  const std::string dir = mkdtemp(dir_tmpl) ? dir_tmpl : "/tmp";
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
        "--backup_device=" + absl::GetFlag(FLAGS_backup_device)};
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
  double average_s = 0, raw_s = 0, plain_s = 0, committed_s = 0, unchecked_s = 0, checked_s = 0;
  absl::Status failed;
  for (int r = 0; r < world; ++r) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      failed = absl::InternalError(absl::StrCat("worker ", r, " failed (see its stderr above)"));
      continue;
    }
    FILE* f = std::fopen(outs[r].c_str(), "r");
    int rank = -1;
    double a = 0, b = 0, c = 0, d = 0, e = 0, g = 0;
    if (f == nullptr ||
        std::fscanf(f,
                    "{\"rank\": %d, \"average_s\": %lf, \"raw_allreduce_s\": %lf, "
                    "\"plain_round_s\": %lf, \"committed_round_s\": %lf, "
                    "\"unchecked_round_s\": %lf, \"checked_round_s\": %lf}",
                    &rank, &a, &b, &c, &d, &e, &g) != 7) {
      failed = absl::InternalError(absl::StrCat("worker ", r, " printed no result"));
    }
    if (f) std::fclose(f);
    average_s = std::max(average_s, a);
    raw_s = std::max(raw_s, b);
    plain_s = std::max(plain_s, c);
    committed_s = d < 0 ? -1.0 : std::max(committed_s, d);
    unchecked_s = std::max(unchecked_s, e);
    checked_s = std::max(checked_s, g);
  }
  server->Shutdown();
  MODELAVG_RETURN_IF_ERROR(failed);
  const double bytes = static_cast<double>(numel) * 4;
  std::printf(
      "{\"world\": %d, \"numel\": %lld, \"tensors\": %d, \"backend\": \"%s\", "
      "\"in_place\": %s, \"iters\": %d, "
      "\"average_s\": %.6g, \"raw_allreduce_s\": %.6g, \"avg_over_raw\": %.4f, "
      "\"average_gbps\": %.4g, \"raw_gbps\": %.4g, \"plain_round_s\": %.6g, "
      "\"committed_round_s\": %.6g, \"committed_over_plain\": %.4f, \"outer\": %s, "
      "\"outer_over_plain\": %.4f, \"backup_device\": \"%s\", \"check_finite\": %s, "
      "\"unchecked_round_s\": %.6g, \"checked_round_s\": %.6g, "
      "\"checked_over_unchecked\": %.4f}\n",
      world, static_cast<long long>(numel), tensors, backend.c_str(),
      absl::GetFlag(FLAGS_in_place) ? "true" : "false", absl::GetFlag(FLAGS_iters), average_s, raw_s, raw_s > 0 ? average_s / raw_s : 0.0,
      bytes / average_s / 1e9, bytes / raw_s / 1e9, plain_s, committed_s,
      committed_s > 0 && plain_s > 0 ? committed_s / plain_s : -1.0,
      absl::GetFlag(FLAGS_outer) ? "true" : "false",
      absl::GetFlag(FLAGS_outer) && plain_s > 0 ? average_s / plain_s : -1.0,
      absl::GetFlag(FLAGS_backup_device).c_str(),
      absl::GetFlag(FLAGS_check_finite) ? "true" : "false", unchecked_s, checked_s,
      unchecked_s > 0 ? checked_s / unchecked_s : -1.0);
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
