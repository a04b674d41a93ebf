// modelavg-trace-worker: the synthetic conformance worker (tools/trace_worker.h: this is its
// program, shared by the shipped binary and the tests' variant).
//
//   modelavg-trace-worker --coordinator=127.0.0.1:50051 --job=J --rank=0 --world_size=4 \
//       --steps=16 --numel=3 --backend=gloo
//
// Joins an existing job (it never creates one). Without --rank (or with --rank=-1) the
// coordinator picks the rank: the lowest free one, or, in a RUNNING elastic job, the lowest
// vacant one (the worker is then a replacement). Every parameter starts at the rank's number;
// before the averaging call of step s it adds (rank + 1) * (s + 1) * 0.5 to every parameter; after
// the call it checks that every element is equal to the first (within float32 rounding: relative
// 1e-5) and prints one JSON line on stdout:
//   {"step": s, "rank": r, "value": <first parameter>, "action": "AVERAGE"|"SKIP", "level": l,
//    "generation": g, "members": [ranks], "joining": [ranks]}
// level is -1 for SKIP; members are the ranks that actually averaged at that step (empty for
// SKIP; in an elastic job the subgroup less its vacant ranks); joining are the replacements
// admitted at that step (they contributed nothing and received the others' average; usually
// empty); generation is the job's generation the decision was taken in. With --unix_ms each line
// also has "unix_ms": the wall-clock time (ms since the epoch) when the call returned.
// After a plan update (UpdateJob, docs/plan-updates.md) each line from the switch step on has
// "plan": the version of the plan that decided it.
// An AVERAGE line also has "outer": whether the step's level has an outer optimizer (the
// decision's StepDecision.outer; DiLoCo, docs/diloco.md): its value then follows the outer rule.
// --save_state writes the parameters and the averager's state_dict() after the last step;
// --load_state restores them (load_state_dict) in a new process, which goes on from that step.
// A replacement (Client::admission_step() > 0) runs steps admission_step .. steps-1: its first
// line is the admission step, with the value it received, and has "admitted": true.
// The same update run through PyTorch's own averagers (tests/conformance/torch_reference.py) must
// give the same values. On any failure it prints one line on stderr and exits 1.
// On SIGTERM or SIGINT it leaves the job at once (a Join or a step delay in progress is cut
// short; an averaging call in progress ends first), prints "stopped by SIGTERM at step s; left
// job J" on stderr and exits with 128 + the signal (143, 130); a second signal ends it at once.
// Paced levels (docs/paced.md): --tokens_per_step=T is sent with the Join (a round weighs each
// member by its steps times T), --rounds=R replaces --steps (the worker stops after the call
// that completes round R - 1 of the job's last level, which must be paced; both flags together
// are an error), and a paced level's AVERAGE line also has "round": its index from 0, and
// "weight": this member's own weight in the round.
// --testing_nonfinite_at_step=s makes one element of the parameters NaN (or +-Inf) before the
// call of step s, as a diverged replica's would be (--testing_nonfinite_at_admission: before the
// call that admits a replacement, which this worker then hands it).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/comm/communicator_factory.h"
#include "client/flags/connection_flags.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_util.h"
#include "common/stop_signals.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"
#include "spdlog/spdlog.h"
#include "tools/trace_worker.h"
#ifdef MODELAVG_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

ABSL_FLAG(std::string, job, "", "id of an existing job to join (required)");
ABSL_FLAG(int32_t, rank, -1,
          "this worker's rank, 0 <= rank < world_size; -1 (the default): the coordinator picks "
          "the lowest free rank, or the lowest vacant rank of a running elastic job");
ABSL_FLAG(int32_t, world_size, 0, "the job's world size (required; must match the job's spec)");
ABSL_FLAG(int64_t, steps, 0, "number of AverageParameters calls (steps 0 .. steps-1)");
ABSL_FLAG(int64_t, numel, 1, "number of float32 parameters");
ABSL_FLAG(int64_t, rounds, 0,
          "instead of --steps, for a job whose last level is paced (docs/paced.md): stop after "
          "the R-th round of that level (the call whose decision has round R - 1)");
ABSL_FLAG(std::string, tokens_per_step, "",
          "the tokens one step processes (ClientOptions::tokens_per_step: a paced round weighs a "
          "member by its steps times this); empty: $MODELAVG_TOKENS_PER_STEP, else 1");
ABSL_FLAG(bool, print_traffic, false,
          "after the last step, print one more JSON line: {\"traffic\": [{\"level\": l, "
          "\"bytes_sent\": b, \"waited_ms\": w}, ...]} (the averager's per-level counts)");
ABSL_FLAG(int64_t, testing_sleep_at_step, -1,
          "tests: before the call of this step, sleep --testing_sleep_ms (a slow peer)");
ABSL_FLAG(int64_t, testing_sleep_ms, 0, "see --testing_sleep_at_step");
ABSL_FLAG(int64_t, cuda_gap_elems, 0,
          "--backend=nccl with --tensors > 1: leave this many unused float32 elements between "
          "consecutive tensors in device memory, so that they are not back to back (the NCCL "
          "staged path; an odd gap also misaligns them)");
ABSL_FLAG(int32_t, tensors, 1,
          "pass the parameters as this many tensors (numel split as evenly as possible, the "
          "first ones one element larger), tensor t starting at the rank's number and getting "
          "(t + 1) times the update: a level with Level.fragments > 1 syncs some of them at a "
          "time; the line then has \"values\" (each tensor's first element) and \"fragment\"");
ABSL_FLAG(std::string, backend, "gloo",
          "gloo: parameters in host memory, averaged with Gloo over TCP; "
          "nccl: parameters in CUDA device memory, averaged with NCCL");
ABSL_FLAG(std::string, gloo_hostname, "127.0.0.1",
          "address Gloo's TCP transport binds to (reachable by the other ranks)");
ABSL_FLAG(int64_t, join_timeout_ms, 60000, "how long to wait for the whole world to join");
ABSL_FLAG(int64_t, collective_timeout_ms, 60000, "longest wait for one averaging collective");
ABSL_FLAG(int64_t, step_delay_ms, 0,
          "sleep this long before each averaging call, so that tests (and people) can kill "
          "things mid-run");
ABSL_FLAG(std::string, testing_step_delay_after_round, "",
          "R:MS: from the call that takes a paced level's round R on, --step_delay_ms is MS (a "
          "member whose pace changes mid-run)");
ABSL_FLAG(int64_t, coordinator_outage_timeout_ms, 300000,
          "ClientOptions.coordinator_outage_timeout: how long work that needs an unreachable "
          "coordinator waits for it");
ABSL_FLAG(int64_t, schedule_window, 4096,
          "ClientOptions.schedule_window: decisions fetched per GetSchedule call");
ABSL_FLAG(bool, unix_ms, false,
          "add \"unix_ms\" to every line: the wall-clock time (milliseconds since the epoch) "
          "when the averaging call returned");
ABSL_FLAG(std::string, log_level, "warn", "spdlog level for diagnostics on stderr");
ABSL_FLAG(std::string, save_state, "",
          "after the last step, write the parameters and the averager's state_dict() (step, "
          "every outer level's anchor and momentum) to this file, then leave the job");
ABSL_FLAG(std::string, load_state, "",
          "before the first step, restore the parameters and the averager's state "
          "(load_state_dict) from a --save_state file of the same job spec and --numel; the "
          "worker then runs steps <saved step> .. --steps-1");
ABSL_FLAG(int64_t, testing_nonfinite_at_step, -1,
          "tests: before the call of this step, set element --testing_nonfinite_element of "
          "tensor --testing_nonfinite_tensor to --testing_nonfinite_value (a diverged replica)");
ABSL_FLAG(std::string, testing_nonfinite_value, "nan", "see --testing_nonfinite_at_step: nan, "
          "inf or -inf");
ABSL_FLAG(int32_t, testing_nonfinite_tensor, 0, "see --testing_nonfinite_at_step");
ABSL_FLAG(int64_t, testing_nonfinite_element, 0,
          "see --testing_nonfinite_at_step (an index into that tensor)");
ABSL_FLAG(bool, testing_nonfinite_at_admission, false,
          "tests: the same as --testing_nonfinite_at_step, before the first call whose decision "
          "admits a replacement (a live member's NaN in what it hands the replacement)");
ABSL_FLAG(bool, check_untouched, false,
          "on a failed call, say after its error whether the parameters are bit for bit as "
          "before it ([parameters untouched] or [parameters CHANGED])");
ABSL_FLAG(int64_t, testing_die_after_step, -1,
          "tests: exit abruptly (no Leave, exit code 9) right after printing this step's line, "
          "as a worker that dies would");

namespace modelavg {
namespace {

// How far (relative) an element may be from element 0 after a call. The rounding of a float32
// average over n members, summed in any order, is at most about n * 1.2e-7: below this for the
// member counts the tests use (up to a few dozen); a call that leaves the tensor partly averaged
// is far above it.
constexpr double kUnevenTolerance = 1e-5;

// The rank this worker holds once it has joined (for the error line; -1 before).
int32_t joined_rank = -1;

// Where the parameters live: host memory, or CUDA memory mirrored from a host copy.
class Parameters {
 public:
  // With `cuda`, the parameters live on device rank % (number of devices).
  // `extra_elems`: device room for the gaps of SetGaps.
  static absl::StatusOr<std::unique_ptr<Parameters>> Create(bool cuda, int64_t numel, float initial,
                                                            int32_t rank,
                                                            int64_t extra_elems = 0) {
    auto p = std::unique_ptr<Parameters>(new Parameters(cuda, numel, initial));
    if (cuda) {
#ifdef MODELAVG_HAVE_CUDA
      int count = 0;
      if (absl::Status s =
              CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount", __FILE__, __LINE__);
          !s.ok()) {
        return Annotate(s, "--backend=nccl needs a CUDA device (use --backend=gloo without one)");
      }
      p->device_index_ = rank % count;
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaSetDevice(p->device_index_));
      MODELAVG_CUDA_RETURN_IF_ERROR(
          cudaMalloc(&p->device_, (numel + extra_elems) * sizeof(float)));
#else
      return absl::FailedPreconditionError(
          "--backend=nccl: this build has no CUDA/NCCL support (configure with "
          "-DMODELAVG_WITH_CUDA=ON on a machine with the CUDA toolkit and NCCL)");
#endif
    }
    return p;
  }
  ~Parameters() {
#ifdef MODELAVG_HAVE_CUDA
    if (device_ != nullptr) cudaFree(device_);
#endif
  }

  std::vector<float>& host() { return host_; }

  // Device memory only: tensor t (host elements [first_of[t], first_of[t + 1])) sits at device
  // element first_of[t] + t * gap.
  void SetGaps(std::vector<int64_t> first_of, int64_t gap) {
    first_of_ = std::move(first_of);
    gap_ = gap;
  }
  // Where host element `i` of tensor `t` lives in the view's buffer.
  int64_t DeviceOffset(int32_t t, int64_t i) const { return i + t * gap_; }

  // The view to average: the host vector, or the device copy after uploading the host values.
  absl::StatusOr<client::TensorView> Upload() {
    client::TensorView view;
    view.numel = static_cast<int64_t>(host_.size());
    view.dtype = client::DType::kFloat32;
    if (!cuda_) {
      view.data = host_.data();
      view.device = client::Device::Host();
      return view;
    }
#ifdef MODELAVG_HAVE_CUDA
    if (gap_ == 0) {
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpy(device_, host_.data(), host_.size() * sizeof(float),
                                               cudaMemcpyHostToDevice));
    }
    for (size_t t = 0; gap_ > 0 && t + 1 < first_of_.size(); ++t) {
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          static_cast<float*>(device_) + DeviceOffset(t, first_of_[t]), host_.data() + first_of_[t],
          (first_of_[t + 1] - first_of_[t]) * sizeof(float), cudaMemcpyHostToDevice));
    }
#endif
    view.data = device_;
    view.device = client::Device::Cuda(device_index_);
    return view;
  }

  // Brings the averaged device values back to the host copy (no-op for host parameters).
  absl::Status Download() {
    if (!cuda_) return absl::OkStatus();
#ifdef MODELAVG_HAVE_CUDA
    if (gap_ == 0) {
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_.data(), device_, host_.size() * sizeof(float),
                                               cudaMemcpyDeviceToHost));
    }
    for (size_t t = 0; gap_ > 0 && t + 1 < first_of_.size(); ++t) {
      MODELAVG_CUDA_RETURN_IF_ERROR(cudaMemcpy(
          host_.data() + first_of_[t],
          static_cast<float*>(device_) + DeviceOffset(t, first_of_[t]),
          (first_of_[t + 1] - first_of_[t]) * sizeof(float), cudaMemcpyDeviceToHost));
    }
#endif
    return absl::OkStatus();
  }

 private:
  Parameters(bool cuda, int64_t numel, float initial)
      : cuda_(cuda), host_(static_cast<size_t>(numel), initial) {}

  const bool cuda_;
  std::vector<float> host_;
  void* device_ = nullptr;
  int device_index_ = 0;
  std::vector<int64_t> first_of_;
  int64_t gap_ = 0;
};

// The --save_state file: text, every float as a hexadecimal literal (exact).
//   step <s>
//   params <n> <v>...
//   anchor <level> <tensor> <n> <v>...     (float32 state: the worker's parameters are float32)
//   momentum <level> <tensor> <n> <v>...
//   fanchor <level> <fragment> <tensor> <n> <v>...      (streaming levels, per fragment)
//   fmomentum <level> <fragment> <tensor> <n> <v>...
//   fresidual <level> <fragment> <tensor> <n> <v>...    (error feedback's residual)
//   pending <level> <fragment> <start step> <apply step> <first 0|1>   (not applied yet)
//   presult <pending index> <tensor> <n> <v>...
std::string HexFloats(const float* v, int64_t n) {
  std::string out = absl::StrCat(n);
  for (int64_t i = 0; i < n; ++i) absl::StrAppend(&out, " ", absl::StrFormat("%a", v[i]));
  return out;
}

absl::Status SaveState(const std::string& path, const std::vector<float>& params,
                       const client::AveragerState& state) {
  std::string text = absl::StrCat("step ", state.step, "\nparams ",
                                  HexFloats(params.data(), params.size()), "\n");
  auto add = [&](const char* kind, const std::map<int, std::vector<client::StateTensor>>& m) {
    for (const auto& [level, tensors] : m) {
      for (size_t i = 0; i < tensors.size(); ++i) {
        const float* v = reinterpret_cast<const float*>(tensors[i].bytes.data());
        absl::StrAppend(&text, kind, " ", level, " ", i, " ", HexFloats(v, tensors[i].numel),
                        "\n");
      }
    }
  };
  add("anchor", state.anchors);
  add("momentum", state.momenta);
  auto add_list = [&](const std::string& head, const std::vector<client::StateTensor>& tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const float* v = reinterpret_cast<const float*>(tensors[i].bytes.data());
      absl::StrAppend(&text, head, " ", i, " ", HexFloats(v, tensors[i].numel), "\n");
    }
  };
  for (const client::FragmentState& fs : state.fragments) {
    add_list(absl::StrCat("fanchor ", fs.level, " ", fs.fragment), fs.anchor);
    add_list(absl::StrCat("fmomentum ", fs.level, " ", fs.fragment), fs.momentum);
    add_list(absl::StrCat("fresidual ", fs.level, " ", fs.fragment), fs.residual);
  }
  for (size_t k = 0; k < state.pending.size(); ++k) {
    const client::PendingState& ps = state.pending[k];
    if (!ps.error.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--save_state: a background all-reduce had failed: ", ps.error));
    }
    absl::StrAppend(&text, "pending ", ps.level, " ", ps.fragment, " ", ps.start_step, " ",
                    ps.apply_step, " ", ps.first ? 1 : 0, "\n");
    add_list(absl::StrCat("presult ", k), ps.result);
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << text;
    if (!f.good()) return absl::InternalError(absl::StrCat("--save_state: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("--save_state: cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

client::StateTensor Float32Tensor(const std::vector<float>& v) {
  client::StateTensor t;
  t.dtype = client::DType::kFloat32;
  t.numel = static_cast<int64_t>(v.size());
  t.bytes.resize(v.size() * sizeof(float));
  if (!v.empty()) std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

absl::Status LoadState(const std::string& path, std::vector<float>* params,
                       client::AveragerState* state) {
  MODELAVG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--load_state=", path, ": ", why));
  };
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto floats = [&](size_t at, std::vector<float>* out) -> absl::Status {
      int64_t n = 0;
      if (f.size() <= at || !absl::SimpleAtoi(f[at], &n) || n < 0 ||
          f.size() != at + 1 + static_cast<size_t>(n)) {
        return bad(absl::StrCat("malformed line: ", line));
      }
      out->clear();
      for (int64_t i = 0; i < n; ++i) out->push_back(std::strtof(f[at + 1 + i].c_str(), nullptr));
      return absl::OkStatus();
    };
    if (f.size() == 2 && f[0] == "step") {
      if (!absl::SimpleAtoi(f[1], &state->step)) return bad(absl::StrCat("bad step: ", line));
    } else if (!f.empty() && f[0] == "params") {
      MODELAVG_RETURN_IF_ERROR(floats(1, params));
    } else if (f.size() >= 3 && (f[0] == "anchor" || f[0] == "momentum")) {
      int level = 0;
      size_t index = 0;
      if (!absl::SimpleAtoi(f[1], &level) || !absl::SimpleAtoi(f[2], &index)) {
        return bad(absl::StrCat("malformed line: ", line));
      }
      std::vector<float> v;
      MODELAVG_RETURN_IF_ERROR(floats(3, &v));
      auto& tensors = (f[0] == "anchor" ? state->anchors : state->momenta)[level];
      if (tensors.size() != index) return bad(absl::StrCat("tensors out of order: ", line));
      client::StateTensor t;
      t.dtype = client::DType::kFloat32;
      t.numel = static_cast<int64_t>(v.size());
      t.bytes.resize(v.size() * sizeof(float));
      std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
      tensors.push_back(std::move(t));
    } else if (f.size() >= 4 && (f[0] == "fanchor" || f[0] == "fmomentum" ||
                              f[0] == "fresidual")) {
      int level = 0, fragment = 0;
      size_t index = 0;
      if (!absl::SimpleAtoi(f[1], &level) || !absl::SimpleAtoi(f[2], &fragment) ||
          !absl::SimpleAtoi(f[3], &index)) {
        return bad(absl::StrCat("malformed line: ", line));
      }
      std::vector<float> v;
      MODELAVG_RETURN_IF_ERROR(floats(4, &v));
      if (index == 0 && f[0] == "fanchor") {
        state->fragments.emplace_back();
        state->fragments.back().level = level;
        state->fragments.back().fragment = fragment;
      }
      if (state->fragments.empty() || state->fragments.back().level != level ||
          state->fragments.back().fragment != fragment) {
        return bad(absl::StrCat("fragment tensors out of order: ", line));
      }
      auto& tensors = f[0] == "fanchor"     ? state->fragments.back().anchor
                       : f[0] == "fmomentum" ? state->fragments.back().momentum
                                             : state->fragments.back().residual;
      if (tensors.size() != index) return bad(absl::StrCat("tensors out of order: ", line));
      tensors.push_back(Float32Tensor(v));
    } else if (f.size() == 6 && f[0] == "pending") {
      client::PendingState ps;
      int first = 0;
      if (!absl::SimpleAtoi(f[1], &ps.level) || !absl::SimpleAtoi(f[2], &ps.fragment) ||
          !absl::SimpleAtoi(f[3], &ps.start_step) || !absl::SimpleAtoi(f[4], &ps.apply_step) ||
          !absl::SimpleAtoi(f[5], &first)) {
        return bad(absl::StrCat("malformed line: ", line));
      }
      ps.first = first != 0;
      state->pending.push_back(std::move(ps));
    } else if (f.size() >= 3 && f[0] == "presult") {
      size_t k = 0, index = 0;
      if (!absl::SimpleAtoi(f[1], &k) || !absl::SimpleAtoi(f[2], &index) ||
          k >= state->pending.size() || state->pending[k].result.size() != index) {
        return bad(absl::StrCat("malformed line: ", line));
      }
      std::vector<float> v;
      MODELAVG_RETURN_IF_ERROR(floats(3, &v));
      state->pending[k].result.push_back(Float32Tensor(v));
    } else {
      return bad(absl::StrCat("unknown line: ", line));
    }
  }
  return absl::OkStatus();
}

// Leaves the job after a stop signal and says so in *stopped.
void LeaveOnStop(client::Client* client, const StopSignals& stop, const std::string& where,
                 std::string* stopped) {
  const std::string why = absl::StrCat("stopped by ", stop.name(), " ", where);
  absl::Status left = client->Leave(why);
  *stopped = left.ok() ? absl::StrCat(why, "; left job ", client->job_id())
                       : absl::StrCat(why, "; leaving job ", client->job_id(),
                                      " failed: ", left.ToString());
}

// Sets the configured element to NaN or +-Inf (--testing_nonfinite_*).
absl::Status MakeNonFinite(std::vector<float>& host, const std::vector<int64_t>& first_of) {
  const std::string what = absl::GetFlag(FLAGS_testing_nonfinite_value);
  float value = 0;
  if (what == "nan") {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (what == "inf") {
    value = std::numeric_limits<float>::infinity();
  } else if (what == "-inf") {
    value = -std::numeric_limits<float>::infinity();
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--testing_nonfinite_value=", what, ": expected nan, inf or -inf"));
  }
  const int32_t t = absl::GetFlag(FLAGS_testing_nonfinite_tensor);
  const int64_t e = absl::GetFlag(FLAGS_testing_nonfinite_element);
  if (t < 0 || t + 1 >= static_cast<int32_t>(first_of.size()) || e < 0 ||
      first_of[t] + e >= first_of[t + 1]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--testing_nonfinite_tensor=", t, " --testing_nonfinite_element=", e,
        ": no such element (", first_of.size() - 1, " tensors)"));
  }
  host[first_of[t] + e] = value;
  return absl::OkStatus();
}

absl::Status Run(StopSignals& stop, const TraceWorkerCommunicators& make_communicators,
                 std::string* stopped) {
  // The connection flags (--coordinator, --auth_token_file, --tls_*, --rpc_timeout_ms) and their
  // environment, as every modelavg program reads them.
  MODELAVG_ASSIGN_OR_RETURN(client::ConnectionOptions conn, client::ConnectionFromFlags());
  const std::string coordinator = conn.coordinator;
  const std::string job = absl::GetFlag(FLAGS_job);
  const int32_t requested_rank = absl::GetFlag(FLAGS_rank);
  const int32_t world_size = absl::GetFlag(FLAGS_world_size);
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  const int64_t numel = absl::GetFlag(FLAGS_numel);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (coordinator.empty()) {
    return absl::InvalidArgumentError(
        "--coordinator=HOST:PORT (or $MODELAVG_COORDINATOR) is required");
  }
  if (job.empty()) return absl::InvalidArgumentError("--job is required (an existing job's id)");
  if (world_size < 1) return absl::InvalidArgumentError("--world_size must be >= 1");
  if (requested_rank < -1 || requested_rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rank=", requested_rank, " is outside [0, --world_size=", world_size,
        ") (or -1: the coordinator picks)"));
  }
  if (steps < 0) return absl::InvalidArgumentError("--steps must be >= 0");
  const int64_t rounds = absl::GetFlag(FLAGS_rounds);
  if (rounds < 0) return absl::InvalidArgumentError("--rounds must be >= 1 (or 0: --steps)");
  if (rounds > 0 && steps > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rounds=", rounds, " and --steps=", steps,
        " together: give one (--rounds counts the rounds of a paced level, --steps the calls)"));
  }
  double tokens_per_step = 1;
  if (const std::string t = absl::GetFlag(FLAGS_tokens_per_step); !t.empty()) {
    if (!absl::SimpleAtod(t, &tokens_per_step) || !std::isfinite(tokens_per_step) ||
        tokens_per_step <= 0 || tokens_per_step > client::kMaxTokensPerStep) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tokens_per_step=", t, ": the tokens of one step are a finite number in (0, 1e12]"));
    }
  } else {
    MODELAVG_ASSIGN_OR_RETURN(tokens_per_step, client::TokensPerStepFromEnvironment(1));
  }
  if (numel < 1) return absl::InvalidArgumentError("--numel must be >= 1");
  if (backend != "gloo" && backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", backend, ": expected gloo or nccl"));
  }

  client::ClientOptions options;
  static_cast<client::ConnectionOptions&>(options) = std::move(conn);
  options.job_id = job;
  if (requested_rank >= 0) options.rank = requested_rank;
  options.expected_world_size = world_size;
  options.gloo_hostname = absl::GetFlag(FLAGS_gloo_hostname);
  options.join_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  options.collective_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_collective_timeout_ms));
  options.coordinator_outage_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_coordinator_outage_timeout_ms));
  options.schedule_window = absl::GetFlag(FLAGS_schedule_window);
  options.tokens_per_step = tokens_per_step;
  if (absl::GetFlag(FLAGS_step_delay_ms) < 0) {
    return absl::InvalidArgumentError("--step_delay_ms must be >= 0");
  }

  // The tests' variant may wrap the communicators (a lost commit: tests/testing/).
  std::unique_ptr<client::CommunicatorFactory> communicators;
  if (make_communicators) communicators = make_communicators(options.gloo_hostname);
  // A stop signal cuts a Join in progress (or its retry backoff) short.
  options.cancel = std::make_shared<client::CancelToken>();
  stop.OnStop([cancel = options.cancel](int) { cancel->Cancel(); });
  absl::StatusOr<std::unique_ptr<client::Client>> connected =
      communicators != nullptr ? client::Client::Connect(options, std::move(communicators))
                               : client::Client::Connect(options);
  if (!connected.ok() && stop.requested()) {
    *stopped = absl::StrCat("stopped by ", stop.name(), " while joining job ", job);
    return absl::OkStatus();
  }
  MODELAVG_RETURN_IF_ERROR(connected.status());
  std::unique_ptr<client::Client> client = *std::move(connected);
  if (client->world_size() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--world_size=", world_size, " but job ", job,
                                                   " has world size ", client->world_size()));
  }
  const int32_t rank = client->rank();
  joined_rank = rank;
  const int64_t die_after = absl::GetFlag(FLAGS_testing_die_after_step);
  const int64_t gap = absl::GetFlag(FLAGS_cuda_gap_elems);
  if (gap < 0 || (gap > 0 && backend != "nccl")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cuda_gap_elems=", gap, ": must be >= 0, and is for --backend=nccl only"));
  }
  MODELAVG_ASSIGN_OR_RETURN(
      std::unique_ptr<Parameters> params,
      Parameters::Create(backend == "nccl", numel, static_cast<float>(rank), rank,
                         gap * absl::GetFlag(FLAGS_tensors)));
  if (rounds > 0 && (client->schedule().spec().levels.empty() ||
                     !client->schedule().spec().levels.back().paced)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rounds=", rounds, ": job ", job,
        "'s last level is not paced (Level.paced): count its length with --steps"));
  }
  std::unique_ptr<client::ModelAverager> averager;
  if (client->schedule().spec().mode == AveragingMode::kPeriodic) {
    MODELAVG_ASSIGN_OR_RETURN(averager, client::PeriodicModelAverager::Create(client.get()));
  } else {
    MODELAVG_ASSIGN_OR_RETURN(averager, client::HierarchicalModelAverager::Create(client.get()));
  }

  absl::Duration step_delay = absl::Milliseconds(absl::GetFlag(FLAGS_step_delay_ms));
  int64_t delay_change_round = -1;
  absl::Duration changed_delay;
  if (const std::string change = absl::GetFlag(FLAGS_testing_step_delay_after_round);
      !change.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(change, ':');
    int64_t ms = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &delay_change_round) ||
        !absl::SimpleAtoi(parts[1], &ms) || delay_change_round < 0 || ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--testing_step_delay_after_round=", change, ": want R:MS (a round >= 0, a delay in "
          "milliseconds >= 0)"));
    }
    changed_delay = absl::Milliseconds(ms);
  }
  const bool print_unix_ms = absl::GetFlag(FLAGS_unix_ms);
  if (const std::string path = absl::GetFlag(FLAGS_load_state); !path.empty()) {
    client::AveragerState state;
    std::vector<float> saved;
    MODELAVG_RETURN_IF_ERROR(LoadState(path, &saved, &state));
    if (saved.size() != params->host().size()) {
      return absl::InvalidArgumentError(absl::StrCat("--load_state=", path, " holds ",
                                                     saved.size(), " parameters but --numel=",
                                                     numel));
    }
    params->host() = saved;
    MODELAVG_RETURN_IF_ERROR(Annotate(averager->load_state_dict(state), "--load_state"));
  }
  // A replacement's averager starts at its admission step; the others' at 0 (or the step of
  // --load_state).
  const int64_t first_step = averager->step();
  const bool replacement = client->admission_step() > 0;
  if (replacement && first_step != client->admission_step()) {
    return absl::InternalError(absl::StrCat("rank ", rank, " was admitted at step ",
                                            client->admission_step(),
                                            " but its averager starts at step ", first_step));
  }
  const int32_t tensors = absl::GetFlag(FLAGS_tensors);
  bool compressed = false;
  for (const ScheduleLevel& l : client->schedule().spec().levels) {
    compressed = compressed || l.payload != Payload::kFp32;
  }
  if (tensors < 1 || tensors > numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tensors must be in [1, --numel = ", numel, "], got ", tensors));
  }
  // Tensor t holds elements [first_of[t], first_of[t + 1]).
  std::vector<int64_t> first_of(tensors + 1, 0);
  for (int32_t t = 0; t < tensors; ++t) {
    first_of[t + 1] = first_of[t] + numel / tensors + (t < numel % tensors ? 1 : 0);
  }
  params->SetGaps(first_of, gap);
  const int64_t sleep_at = absl::GetFlag(FLAGS_testing_sleep_at_step);
  const int64_t nonfinite_at = absl::GetFlag(FLAGS_testing_nonfinite_at_step);
  bool nonfinite_at_admission = absl::GetFlag(FLAGS_testing_nonfinite_at_admission);
  // With --rounds the loop ends at the call that completes round rounds - 1 of the paced level.
  for (int64_t step = first_step; rounds > 0 || step < steps; ++step) {
    if (step_delay > absl::ZeroDuration()) stop.SleepFor(step_delay);
    if (step == sleep_at) stop.SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_testing_sleep_ms)));
    if (stop.requested()) {
      LeaveOnStop(client.get(), stop, absl::StrCat("at step ", step), stopped);
      return absl::OkStatus();
    }
    const float delta = static_cast<float>((rank + 1) * (step + 1)) * 0.5f;
    if (tensors == 1) {
      for (float& v : params->host()) v += delta;
    } else {
      for (int32_t t = 0; t < tensors; ++t) {
        const float d = delta * static_cast<float>(t + 1);
        for (int64_t i = first_of[t]; i < first_of[t + 1]; ++i) params->host()[i] += d;
      }
    }
    bool admitting = false;
    if (nonfinite_at_admission) {
      // Into the generation the heartbeat has seen, as the call does first, to read the step's
      // decision there.
      MODELAVG_RETURN_IF_ERROR(client->AdvanceGeneration());
      absl::StatusOr<Decision> next = client->DecisionAt(step);
      admitting = next.ok() && next->average && !next->joining.empty();
      nonfinite_at_admission = !admitting;
    }
    if (step == nonfinite_at || admitting) {
      MODELAVG_RETURN_IF_ERROR(MakeNonFinite(params->host(), first_of));
    }
    std::vector<float> before;
    if (absl::GetFlag(FLAGS_check_untouched)) before = params->host();
    MODELAVG_ASSIGN_OR_RETURN(client::TensorView view, params->Upload());
    std::vector<client::TensorView> views;
    for (int32_t t = 0; t < tensors; ++t) {
      client::TensorView v = view;
      v.data = static_cast<float*>(view.data) + params->DeviceOffset(t, first_of[t]);
      v.numel = first_of[t + 1] - first_of[t];
      views.push_back(v);
    }
    const absl::Time call_start = absl::Now();
    absl::StatusOr<Decision> decision = averager->AverageParameters(views);
    const absl::Duration call_time = absl::Now() - call_start;
    if (!decision.ok() && stop.requested()) {
      // The call ended because of the stop (a peer that stopped too left the round).
      LeaveOnStop(client.get(), stop,
                  absl::StrCat("at step ", step, " (its call: ", decision.status().message(), ")"),
                  stopped);
      return absl::OkStatus();
    }
    if (!decision.ok() && absl::GetFlag(FLAGS_check_untouched)) {
      // Bit for bit (a NaN the worker put there is equal to itself here).
      const bool untouched = params->Download().ok() && params->host().size() == before.size() &&
                             std::memcmp(params->host().data(), before.data(),
                                         before.size() * sizeof(float)) == 0;
      return Restate(decision.status(),
                     absl::StrCat("step ", step, ": AverageParameters: ",
                                  decision.status().message(),
                                  untouched ? " [parameters untouched]" : " [parameters CHANGED]"));
    }
    if (!decision.ok()) {
      return Annotate(decision.status(), absl::StrCat("step ", step, ": AverageParameters"));
    }
    MODELAVG_RETURN_IF_ERROR(params->Download());
    // Every element got the same update, so after any call they must all be equal up to
    // float32 rounding (a ring all-reduce sums each chunk in its own order: with a member count
    // that is not a power of two, as an elastic job's, elements may differ in their last bits).
    // The value printed (the first) stands for the whole tensor.
    // With --tensors, the same holds within each tensor (a fragment is whole tensors) — unless
    // a level sends compressed pseudo-gradients (Level.payload): each element then carries its
    // own rounding, within the bound of docs/streaming.md that the tests check.
    const std::vector<float>& host = params->host();
    for (int32_t t = 0; t < tensors && !compressed; ++t) {
      const float head = host[first_of[t]];
      const double tolerance = kUnevenTolerance * std::max(1.0, std::fabs(double{head}));
      for (int64_t i = first_of[t] + 1; i < first_of[t + 1]; ++i) {
        if (std::fabs(double{host[i]} - double{head}) > tolerance) {
          return absl::InternalError(absl::StrFormat(
              "step %d: element %d of the parameters is %.9g but element %d is %.9g after the "
              "call: an averaging call left the tensor uneven",
              step, i, host[i], first_of[t], head));
        }
      }
    }
    std::vector<int32_t> members;
    if (decision->average) members = decision->Members();
    // The generation the decision was taken in: a call that retried the round in a new
    // generation (elastic jobs) returns its decision there.
    const int64_t generation =
        decision->generation > 0 ? decision->generation : client->generation();
    std::string line = absl::StrFormat(
        "{\"step\": %d, \"rank\": %d, \"value\": %.9g, \"action\": \"%s\", \"level\": %d, "
        "\"generation\": %d, \"members\": [%s], \"joining\": [%s]",
        step, rank, params->host()[0], decision->average ? "AVERAGE" : "SKIP",
        decision->average ? decision->level : -1, generation, absl::StrJoin(members, ", "),
        absl::StrJoin(decision->joining, ", "));
    if (decision->average) {
      absl::StrAppend(&line, ", \"outer\": ", decision->outer ? "true" : "false");
    }
    if (decision->average && decision->fragments > 1) {
      absl::StrAppend(&line, ", \"fragment\": ", decision->fragment);
    }
    if (decision->plan > 0) absl::StrAppend(&line, ", \"plan\": ", decision->plan);
    // A paced level's round (docs/paced.md): its index and this member's own weight, its entry
    // of the round's weights at its index in the members.
    if (decision->average && decision->round >= 0) {
      absl::StrAppend(&line, ", \"round\": ", decision->round);
      const auto me = std::find(members.begin(), members.end(), rank);
      if (me != members.end() && decision->weights.size() == members.size()) {
        absl::StrAppend(&line, ", \"weight\": ",
                        absl::StrFormat("%.17g", decision->weights[me - members.begin()]));
      }
    }
    if (tensors > 1) {
      std::vector<std::string> heads;
      for (int32_t t = 0; t < tensors; ++t) {
        heads.push_back(absl::StrFormat("%.9g", host[first_of[t]]));
      }
      absl::StrAppend(&line, ", \"values\": [", absl::StrJoin(heads, ", "), "]");
    }
    if (replacement && step == first_step) absl::StrAppend(&line, ", \"admitted\": true");
    if (print_unix_ms) {
      absl::StrAppend(&line, ", \"unix_ms\": ", absl::ToUnixMillis(absl::Now()),
                      ", \"call_ms\": ", absl::ToInt64Milliseconds(call_time),
                      ", \"call_us\": ", absl::ToInt64Microseconds(call_time));
    }
    std::cout << line << "}" << std::endl;
    if (step == die_after) _exit(9);
    if (decision->average && decision->round >= 0 && decision->round == delay_change_round) {
      step_delay = changed_delay;
    }
    // The last round of the top (last, paced) level is done.
    const size_t levels = client->plans().Plan(decision->plan).spec().levels.size();
    if (rounds > 0 && decision->average && decision->round >= rounds - 1 &&
        decision->level == static_cast<int>(levels) - 1) {
      break;
    }
  }
  if (absl::GetFlag(FLAGS_print_traffic)) {
    std::vector<std::string> levels;
    const std::vector<client::ModelAverager::LevelTraffic> traffic = averager->traffic();
    for (size_t l = 0; l < traffic.size(); ++l) {
      levels.push_back(absl::StrFormat("{\"level\": %d, \"bytes_sent\": %d, \"waited_ms\": %.3f}",
                                       l, traffic[l].bytes_sent,
                                       absl::ToDoubleMilliseconds(traffic[l].waited)));
    }
    std::cout << "{\"traffic\": [" << absl::StrJoin(levels, ", ") << "]}" << std::endl;
  }
  if (const std::string path = absl::GetFlag(FLAGS_save_state); !path.empty()) {
    MODELAVG_RETURN_IF_ERROR(SaveState(path, params->host(), averager->state_dict()));
  }
  return client->Leave("finished");
}

}  // namespace

int TraceWorkerMain(int argc, char** argv, const TraceWorkerCommunicators& make_communicators) {
  absl::SetProgramUsageMessage(
      "Synthetic conformance worker: joins an existing modelavg job and prints one JSON line per "
      "step. See --helpfull for the flags.");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "modelavg-trace-worker: unexpected argument '" << rest[1]
              << "' (flags are --name=value)" << std::endl;
    return 2;
  }
  absl::Status logging = InitLogging(absl::GetFlag(FLAGS_log_level), "trace-worker");
  if (!logging.ok()) {
    std::cerr << "modelavg-trace-worker: --log_level: " << logging.message() << std::endl;
    return 2;
  }
  // Before any thread is started (the client's): SIGTERM and SIGINT are taken by its thread.
  StopSignals stop;
  std::string stopped;
  absl::Status status = Run(stop, make_communicators, &stopped);
  if (status.ok() && !stopped.empty()) {
    std::cerr << "modelavg-trace-worker: rank "
              << (joined_rank >= 0 ? joined_rank : absl::GetFlag(FLAGS_rank))
              << ": " << stopped << std::endl;
    return stop.exit_code();
  }
  if (!status.ok()) {
    std::cerr << "modelavg-trace-worker: rank "
              << (joined_rank >= 0 ? joined_rank : absl::GetFlag(FLAGS_rank))
              << ": "
              << status.ToString() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace modelavg
