// modelavg-demo: a small real model trained with local SGD and periodic/hierarchical model
// averaging through the modelavg client library.
//
//   modelavg-demo --coordinator=127.0.0.1:50051 --job=demo --compare_job=demo-every-step \
//       --rank=0 --steps=200
//
// Every rank trains the same tiny MLP (same initial weights) on its own shard of a synthetic
// classification task — the shards come from different regions of the input space, so local
// models drift apart — and calls AverageParameters after every optimizer step, as one would call
// PyTorch's averagers. It prints its progress (step, loss, which averaging happened). With
// --compare_job it then repeats the same training in a second job (typically PERIODIC with period
// 1: averaging every step) and prints both final losses on the whole population, so the trade-off
// between communication and loss is visible.
//
// Parameters live in host memory and are averaged with Gloo over TCP; with --backend=nccl they
// are staged through CUDA device memory and averaged with NCCL.
//
// On SIGTERM or SIGINT (`docker stop`, `podman stop`, Ctrl-C) it leaves its job at once, so that
// the other ranks learn it from the coordinator instead of after a heartbeat timeout: a Join or a
// step delay in progress is cut short, an averaging call in progress ends first. It prints
// "stopped by SIGTERM at step s; left job J" and exits with 128 + the signal (143, 130); a second
// signal ends it at once.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/flags/connection_flags.h"
#include "common/logging.h"
#include "common/status_util.h"
#include "common/stop_signals.h"
#include "examples/tiny_mlp.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"
#include "spdlog/spdlog.h"
#ifdef MODELAVG_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

ABSL_FLAG(std::string, job, "demo", "id of the job to train in (it must exist)");
ABSL_FLAG(std::string, compare_job, "",
          "optional further jobs, comma-separated (e.g. PERIODIC with period 1, or a DiLoCo "
          "job), in each of which the same training is repeated for comparison; empty: none");
ABSL_FLAG(int32_t, rank, -1, "rank to take; -1: the coordinator assigns one");
ABSL_FLAG(int64_t, steps, 200, "optimizer steps (= AverageParameters calls) per job");
ABSL_FLAG(int32_t, batch_size, 32, "minibatch size of each local SGD step");
ABSL_FLAG(double, learning_rate, 0.2, "SGD learning rate");
ABSL_FLAG(int32_t, features, 16, "input dimension of the synthetic task");
ABSL_FLAG(int32_t, hidden, 32, "hidden units of the MLP");
ABSL_FLAG(int64_t, shard_size, 2048, "training points in each rank's shard");
ABSL_FLAG(uint64_t, seed, 7, "seed of the task and of the initial weights (same on every rank)");
ABSL_FLAG(int64_t, log_every, 20, "print progress every this many steps");
ABSL_FLAG(int64_t, step_delay_ms, 0,
          "sleep this long after each local SGD step, standing in for a real model's compute "
          "time; 0 to 60000");
ABSL_FLAG(std::string, backend, "gloo",
          "gloo: average host memory with Gloo over TCP; nccl: stage through CUDA memory and "
          "average with NCCL");
ABSL_FLAG(std::string, gloo_hostname, "127.0.0.1",
          "address Gloo binds to; the other ranks must reach it (in containers: this "
          "container's host name)");
ABSL_FLAG(int64_t, join_timeout_ms, 120000, "how long to wait for the whole world to join");
ABSL_FLAG(std::string, log_level, "warn", "spdlog level of the library's diagnostics (stderr)");

namespace modelavg {
namespace {

// SIGTERM/SIGINT (main installs it before any thread starts): the training loop leaves the job
// cleanly at the next step, so that the other ranks learn at once (a generation change) instead
// of after a heartbeat timeout.
StopSignals* g_stop = nullptr;

// The status of a training phase that ended on a stop signal: CANCELLED saying where.
absl::Status Stopped(const std::string& where, client::Client* client) {
  const std::string why = absl::StrCat("stopped by ", g_stop->name(), " ", where);
  if (client == nullptr) return absl::CancelledError(why);
  absl::Status left = client->Leave(why);
  return absl::CancelledError(
      left.ok() ? absl::StrCat(why, "; left job ", client->job_id())
                : absl::StrCat(why, "; leaving job ", client->job_id(), " failed: ",
                               left.ToString()));
}

// The parameters as the averager sees them: the host tensors, or device mirrors of them.
class StagedParameters {
 public:
  // With `cuda`, the device mirrors live on device rank % (number of devices).
  static absl::StatusOr<std::unique_ptr<StagedParameters>> Create(
      std::vector<std::vector<float>*> host, bool cuda, int32_t rank) {
    auto s = std::unique_ptr<StagedParameters>(new StagedParameters(std::move(host), cuda));
    int device = 0;
#ifdef MODELAVG_HAVE_CUDA
    if (cuda) {
      int count = 0;
      if (absl::Status st =
              CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount", __FILE__, __LINE__);
          !st.ok()) {
        return Annotate(st, "--backend=nccl needs a CUDA device (use --backend=gloo without one)");
      }
      device = rank % count;
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    }
#endif
    (void)device;  // unused in builds without CUDA
    for (std::vector<float>* t : s->host_) {
      client::TensorView v;
      v.numel = static_cast<int64_t>(t->size());
      v.dtype = client::DType::kFloat32;
      if (!cuda) {
        v.data = t->data();
        v.device = client::Device::Host();
      } else {
#ifdef MODELAVG_HAVE_CUDA
        MODELAVG_CUDA_RETURN_IF_ERROR(cudaMalloc(&v.data, t->size() * sizeof(float)));
        v.device = client::Device::Cuda(device);
#else
        return absl::FailedPreconditionError(
            "--backend=nccl: this build has no CUDA/NCCL support (configure with "
            "-DMODELAVG_WITH_CUDA=ON on a machine with the CUDA toolkit and NCCL)");
#endif
      }
      s->views_.push_back(v);
    }
    return s;
  }

  ~StagedParameters() {
#ifdef MODELAVG_HAVE_CUDA
    if (cuda_) {
      for (client::TensorView& v : views_) cudaFree(v.data);
    }
#endif
  }

  // Averages (or not) as the schedule says, keeping the host copy current.
  absl::StatusOr<Decision> Average(client::ModelAverager& averager) {
    if (!cuda_) return averager.AverageParameters(views_);
#ifdef MODELAVG_HAVE_CUDA
    for (size_t i = 0; i < views_.size(); ++i) {
      MODELAVG_CUDA_RETURN_IF_ERROR(
          cudaMemcpy(views_[i].data, host_[i]->data(), views_[i].nbytes(), cudaMemcpyHostToDevice));
    }
    MODELAVG_ASSIGN_OR_RETURN(Decision d, averager.AverageParameters(views_));
    if (d.average) {
      for (size_t i = 0; i < views_.size(); ++i) {
        MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_[i]->data(), views_[i].data,
                                                 views_[i].nbytes(), cudaMemcpyDeviceToHost));
      }
    }
    return d;
#else
    return absl::InternalError("unreachable: CUDA staging without CUDA");
#endif
  }

 private:
  StagedParameters(std::vector<std::vector<float>*> host, bool cuda)
      : host_(std::move(host)), cuda_(cuda) {}
  std::vector<std::vector<float>*> host_;
  std::vector<client::TensorView> views_;
  bool cuda_;
};

// "hierarchical, warm-up 8: every 2 steps in groups of 2, every 8 steps over all 4".
std::string DescribePlan(const Schedule& schedule) {
  const ScheduleSpec& spec = schedule.spec();
  std::vector<std::string> levels;
  for (const ScheduleLevel& l : spec.levels) {
    levels.push_back(absl::StrCat("every ", l.period, l.period == 1 ? " step" : " steps",
                                  l.group_size == spec.world_size
                                      ? absl::StrCat(" over all ", spec.world_size)
                                      : absl::StrCat(" in groups of ", l.group_size)));
    if (l.outer.has_value()) {
      absl::StrAppend(&levels.back(), absl::StrFormat(" (DiLoCo: outer SGD lr %g, momentum %g%s)",
                                                      l.outer->lr, l.outer->momentum,
                                                      l.outer->nesterov ? ", nesterov" : ""));
    }
  }
  return absl::StrCat(spec.mode == AveragingMode::kPeriodic ? "periodic" : "hierarchical",
                      ", warm-up ", spec.warmup_steps, ": ", absl::StrJoin(levels, ", "));
}

std::string GroupName(const Decision& d, int32_t world_size) {
  return d.subgroup.size == world_size ? absl::StrCat("all ", world_size)
         : d.subgroup.stride > 1
             ? absl::StrCat("ranks ", d.subgroup.Describe())
             : absl::StrCat("ranks ", d.subgroup.first_rank, "-", d.subgroup.LastRank());
}

struct PhaseResult {
  std::string job;
  std::string plan;
  int32_t world_size = 0;
  double initial_loss = 0;
  double final_loss = 0;
  int64_t averagings = 0;
  std::map<int32_t, int64_t> by_group_size;  // group size -> averaging calls
  double seconds = 0;
};

absl::StatusOr<client::ClientOptions> BaseOptions(const std::string& job, int32_t rank) {
  client::ClientOptions options;
  // --coordinator (default $MODELAVG_COORDINATOR, else 127.0.0.1:50051), --auth_token_file,
  // --tls_*, --rpc_timeout_ms: the connection flags of every modelavg program.
  client::ConnectionOptions defaults;
  defaults.coordinator = "127.0.0.1:50051";
  MODELAVG_ASSIGN_OR_RETURN(static_cast<client::ConnectionOptions&>(options),
                            client::ConnectionFromFlags(defaults));
  options.job_id = job;
  if (rank >= 0) options.rank = rank;
  options.gloo_hostname = absl::GetFlag(FLAGS_gloo_hostname);
  options.join_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  return options;
}

// Trains from scratch in `job`; `*rank` is the rank to ask for (-1: any) and receives the one
// taken.
absl::StatusOr<PhaseResult> TrainInJob(const std::string& job, int32_t* rank) {
  MODELAVG_ASSIGN_OR_RETURN(client::ClientOptions options, BaseOptions(job, *rank));
  std::printf("[rank %s] joining job %s at %s ...\n",
              *rank >= 0 ? absl::StrCat(*rank).c_str() : "?", job.c_str(),
              options.coordinator.c_str());
  std::fflush(stdout);
  // A stop signal cuts a Join in progress (or its retry backoff) short.
  options.cancel = std::make_shared<client::CancelToken>();
  g_stop->OnStop([cancel = options.cancel](int) { cancel->Cancel(); });
  absl::StatusOr<std::unique_ptr<client::Client>> connected = client::Client::Connect(options);
  if (!connected.ok() && g_stop->requested()) {
    return Stopped(absl::StrCat("while joining job ", job), nullptr);
  }
  MODELAVG_RETURN_IF_ERROR(connected.status());
  std::unique_ptr<client::Client> client = *std::move(connected);
  *rank = client->rank();
  const int32_t world = client->world_size();
  std::unique_ptr<client::ModelAverager> averager;
  if (client->schedule().spec().mode == AveragingMode::kPeriodic) {
    MODELAVG_ASSIGN_OR_RETURN(averager, client::PeriodicModelAverager::Create(client.get()));
  } else {
    MODELAVG_ASSIGN_OR_RETURN(averager, client::HierarchicalModelAverager::Create(client.get()));
  }
  PhaseResult result;
  result.job = job;
  result.plan = DescribePlan(client->schedule());
  result.world_size = world;
  std::printf("[rank %d] job %s: world %d, generation %d, %s\n", *rank, job.c_str(), world,
              static_cast<int>(client->generation()), result.plan.c_str());

  const int features = absl::GetFlag(FLAGS_features);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  examples::SyntheticTask task(features, world, seed);
  const examples::Dataset shard = task.Shard(*rank, absl::GetFlag(FLAGS_shard_size), 0);
  const examples::Dataset population = task.Population(512);
  examples::TinyMlp model(features, absl::GetFlag(FLAGS_hidden), seed);
  MODELAVG_ASSIGN_OR_RETURN(
      std::unique_ptr<StagedParameters> params,
      StagedParameters::Create(model.parameters(), absl::GetFlag(FLAGS_backend) == "nccl", *rank));
  result.initial_loss = model.Loss(population);

  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t log_every = std::max<int64_t>(1, absl::GetFlag(FLAGS_log_every));
  const int32_t batch = absl::GetFlag(FLAGS_batch_size);
  const float lr = static_cast<float>(absl::GetFlag(FLAGS_learning_rate));
  const absl::Duration step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_step_delay_ms));
  const absl::Time start = absl::Now();
  double window_loss = 0;
  int64_t window_steps = 0;
  std::map<std::string, int64_t> window_avg;  // "level L (group)" -> count since the last line
  for (int64_t step = 0; step < steps; ++step) {
    if (g_stop->requested()) return Stopped(absl::StrCat("at step ", step), client.get());
    window_loss += model.SgdStep(shard, step * batch, batch, lr);
    ++window_steps;
    if (step_delay > absl::ZeroDuration() && !g_stop->SleepFor(step_delay)) {
      return Stopped(absl::StrCat("at step ", step), client.get());
    }
    absl::StatusOr<Decision> d = params->Average(*averager);
    if (!d.ok() && g_stop->requested()) {
      // The call ended because of the stop (a peer that stopped too left the round).
      return Stopped(absl::StrCat("at step ", step, " (its call: ", d.status().message(), ")"),
                     client.get());
    }
    if (!d.ok()) return Annotate(d.status(), absl::StrCat("job ", job, " step ", step));
    if (d->average) {
      ++result.averagings;
      ++result.by_group_size[d->subgroup.size];
      ++window_avg[absl::StrCat("level ", d->level, " (", GroupName(*d, world), ")")];
    }
    if ((step + 1) % log_every == 0 || step + 1 == steps) {
      std::vector<std::string> parts;
      for (const auto& [what, n] : window_avg) parts.push_back(absl::StrCat(n, "x ", what));
      std::printf("[rank %d] %s step %4lld/%lld  train loss %.4f  averaged: %s\n", *rank,
                  job.c_str(), static_cast<long long>(step + 1), static_cast<long long>(steps),
                  window_loss / window_steps,
                  parts.empty() ? "none (local steps)" : absl::StrJoin(parts, ", ").c_str());
      std::fflush(stdout);
      window_loss = 0;
      window_steps = 0;
      window_avg.clear();
    }
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  result.final_loss = model.Loss(population);
  MODELAVG_RETURN_IF_ERROR(client->Leave("finished"));
  return result;
}

std::string DescribeAveragings(const PhaseResult& r) {
  std::vector<std::string> parts;
  for (const auto& [size, n] : r.by_group_size) {
    parts.push_back(
        absl::StrCat(n, size == r.world_size ? " over all" : absl::StrCat(" in groups of ", size)));
  }
  return absl::StrCat(r.averagings, " averagings",
                      parts.empty() ? "" : absl::StrCat(" (", absl::StrJoin(parts, ", "), ")"));
}

absl::Status Run() {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", backend, ": expected gloo or nccl"));
  }
  if (absl::GetFlag(FLAGS_steps) < 1) return absl::InvalidArgumentError("--steps must be >= 1");
  if (absl::GetFlag(FLAGS_step_delay_ms) < 0 || absl::GetFlag(FLAGS_step_delay_ms) > 60000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--step_delay_ms=", absl::GetFlag(FLAGS_step_delay_ms), ": must be in [0, 60000]"));
  }
  if (absl::GetFlag(FLAGS_batch_size) < 1 || absl::GetFlag(FLAGS_features) < 1 ||
      absl::GetFlag(FLAGS_hidden) < 1 || absl::GetFlag(FLAGS_shard_size) < 1) {
    return absl::InvalidArgumentError(
        "--batch_size, --features, --hidden and --shard_size must be >= 1");
  }
  int32_t rank = absl::GetFlag(FLAGS_rank);
  std::vector<PhaseResult> results;
  MODELAVG_ASSIGN_OR_RETURN(PhaseResult first, TrainInJob(absl::GetFlag(FLAGS_job), &rank));
  results.push_back(first);
  for (absl::string_view compare :
       absl::StrSplit(absl::GetFlag(FLAGS_compare_job), ',', absl::SkipEmpty())) {
    MODELAVG_ASSIGN_OR_RETURN(PhaseResult second, TrainInJob(std::string(compare), &rank));
    results.push_back(second);
  }
  // Rank 0 prints the table; the others one line. When the last step averages over every rank (as
  // in deploy/jobs/demo-jobs.json with 201 steps), all ranks hold the same model and agree.
  if (rank != 0) {
    std::vector<std::string> parts;
    for (const PhaseResult& r : results) {
      parts.push_back(absl::StrFormat("%s %.4f", r.job, r.final_loss));
    }
    std::printf("[rank %d] final loss: %s\n", rank, absl::StrJoin(parts, ", ").c_str());
  } else {
    std::printf(
        "[rank 0] summary: final loss of the model on every shard's test data "
        "(initial %.4f; lower is better)\n",
        results.front().initial_loss);
    for (const PhaseResult& r : results) {
      std::printf("[rank 0]   %-20s final loss %.4f  %s  %.1f s  [%s]\n", r.job.c_str(),
                  r.final_loss, DescribeAveragings(r).c_str(), r.seconds, r.plan.c_str());
    }
  }
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace
}  // namespace modelavg

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains a tiny MLP with local SGD and model averaging through modelavg. "
      "See --helpfull for the flags.");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "modelavg-demo: unexpected argument '" << rest[1] << "' (flags are --name=value)"
              << std::endl;
    return 2;
  }
  // Before any thread is started (the client's): SIGTERM and SIGINT are taken by its thread.
  modelavg::StopSignals stop;
  modelavg::g_stop = &stop;
  absl::Status logging = modelavg::InitLogging(absl::GetFlag(FLAGS_log_level), "demo");
  if (!logging.ok()) {
    std::cerr << "modelavg-demo: --log_level: " << logging.message() << std::endl;
    return 2;
  }
  absl::Status status = modelavg::Run();
  if (!status.ok() && stop.requested() && absl::IsCancelled(status)) {
    std::cerr << "modelavg-demo: " << status.message() << std::endl;
    return stop.exit_code();
  }
  if (!status.ok()) {
    std::cerr << "modelavg-demo: " << status.ToString() << std::endl;
    return 1;
  }
  return 0;
}
