// A worker process for the client's integration tests: joins an existing job, holds a set of
// parameter tensors, applies a deterministic per-rank update before every averaging call, and
// prints one JSON line per step:
//   {"step": s, "rank": r, "action": "AVERAGE"|"SKIP", "level": l, "values": [v0, v1, ...]}
// where v_i is the first element of tensor i after the call (the worker checks that every
// element of a tensor is equal to its first). Every parameter starts at the rank's number;
// before each call (rank + 1) * (step + 1) * 0.5 is added to every element.
// Exits 1 with one line "error: ..." on stderr if anything fails.
#include <unistd.h>

#include <cmath>
#include <cstdint>
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
#include "client/base/half.h"
#include "client/session/backends.h"
#include "common/logging.h"
#include "common/status_util.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "tests/testing/faulty_communicator.h"

ABSL_FLAG(std::string, coordinator, "", "Coordinator HOST:PORT.");
ABSL_FLAG(std::string, job, "", "Job id (the job must exist).");
ABSL_FLAG(int32_t, rank, -1, "Rank to ask for; -1: any.");
ABSL_FLAG(int64_t, steps, 10, "AverageParameters calls.");
ABSL_FLAG(std::string, layout, "f32:16",
          "Comma-separated tensors DTYPE:NUMEL (f32, f64, f16, bf16); 'none' for an empty list.");
ABSL_FLAG(int64_t, step_sleep_ms, 0, "Sleep before each step (fault tests).");
ABSL_FLAG(int64_t, collective_timeout_ms, 30000, "ClientOptions.collective_timeout.");
ABSL_FLAG(int64_t, heartbeat_interval_ms, 100, "ClientOptions.heartbeat_interval.");
ABSL_FLAG(std::string, heartbeat_relay_dir, "", "ClientOptions.heartbeat_relay_dir.");
ABSL_FLAG(int64_t, coordinator_outage_timeout_ms, 300000,
          "ClientOptions.coordinator_outage_timeout.");
ABSL_FLAG(int64_t, start_step, 0, "set_step() before the first call (checkpoint restore).");
ABSL_FLAG(bool, check_untouched, false,
          "On a failed call, say whether the parameters are exactly as before it.");
ABSL_FLAG(std::string, log_level, "warn", "spdlog level.");
ABSL_FLAG(bool, testing_stray_connection, false,
          "Fault: at the first Gloo mesh set-up, a stray socket connects to the peer's port "
          "ahead of this member (CommunicatorFaults::StrayConnectionFirst, tests/testing/).");
ABSL_FLAG(std::string, testing_stray_kind, "silent",
          "What the stray of --testing_stray_connection does: silent (holds the connection), "
          "junk (writes random bytes) or echo (sends back what it receives).");

namespace modelavg::client {
namespace {

struct Tensor {
  DType dtype;
  std::vector<double> f64;
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  int64_t numel = 0;

  void* data() {
    switch (dtype) {
      case DType::kFloat64:
        return f64.data();
      case DType::kFloat32:
        return f32.data();
      default:
        return f16.data();
    }
  }
  double Get(int64_t i) const {
    switch (dtype) {
      case DType::kFloat64:
        return f64[i];
      case DType::kFloat32:
        return f32[i];
      case DType::kFloat16:
        return HalfToFloat(f16[i]);
      default:
        return BFloat16ToFloat(f16[i]);
    }
  }
  void Set(int64_t i, double v) {
    switch (dtype) {
      case DType::kFloat64:
        f64[i] = v;
        break;
      case DType::kFloat32:
        f32[i] = static_cast<float>(v);
        break;
      case DType::kFloat16:
        f16[i] = FloatToHalf(static_cast<float>(v));
        break;
      default:
        f16[i] = FloatToBFloat16(static_cast<float>(v));
        break;
    }
  }
};

absl::StatusOr<std::vector<Tensor>> ParseLayout(const std::string& layout) {
  std::vector<Tensor> out;
  if (layout == "none") return out;
  for (absl::string_view item : absl::StrSplit(layout, ',')) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    int64_t n = 0;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &n) || n < 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad --layout item '", item, "'"));
    }
    Tensor t;
    t.numel = n;
    if (kv[0] == "f32") {
      t.dtype = DType::kFloat32;
      t.f32.resize(n);
    } else if (kv[0] == "f64") {
      t.dtype = DType::kFloat64;
      t.f64.resize(n);
    } else if (kv[0] == "f16" || kv[0] == "bf16") {
      t.dtype = kv[0] == "f16" ? DType::kFloat16 : DType::kBFloat16;
      t.f16.resize(n);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("bad dtype in --layout: '", kv[0], "'"));
    }
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status Run() {
  ClientOptions opts;
  opts.coordinator = absl::GetFlag(FLAGS_coordinator);
  opts.job_id = absl::GetFlag(FLAGS_job);
  if (absl::GetFlag(FLAGS_rank) >= 0) opts.rank = absl::GetFlag(FLAGS_rank);
  opts.join_timeout = absl::Seconds(60);
  opts.collective_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_collective_timeout_ms));
  opts.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  opts.heartbeat_relay_dir = absl::GetFlag(FLAGS_heartbeat_relay_dir);
  opts.coordinator_outage_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_coordinator_outage_timeout_ms));
  opts.rpc_timeout = absl::Seconds(5);
  std::unique_ptr<Client> client;
  if (absl::GetFlag(FLAGS_testing_stray_connection)) {
    const std::string kind_name = absl::GetFlag(FLAGS_testing_stray_kind);
    ::modelavg::testing::StrayKind kind;
    if (kind_name == "silent") {
      kind = ::modelavg::testing::StrayKind::kSilent;
    } else if (kind_name == "junk") {
      kind = ::modelavg::testing::StrayKind::kJunk;
    } else if (kind_name == "echo") {
      kind = ::modelavg::testing::StrayKind::kEcho;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--testing_stray_kind='", kind_name, "': expected silent, junk or echo"));
    }
    // The stray comes from a store view around the real set-up (tests/testing/).
    auto faults = std::make_shared<::modelavg::testing::CommunicatorFaults>();
    faults->StrayConnectionFirst();
    auto communicators = std::make_unique<::modelavg::testing::FaultyCommunicatorFactory>(
        std::make_unique<BackendFactory>(opts.gloo_hostname), std::move(faults),
        opts.gloo_hostname, kind);
    MODELAVG_ASSIGN_OR_RETURN(client, Client::Connect(opts, std::move(communicators)));
  } else {
    MODELAVG_ASSIGN_OR_RETURN(client, Client::Connect(opts));
  }
  std::unique_ptr<ModelAverager> averager;
  if (client->schedule().spec().mode == AveragingMode::kPeriodic) {
    MODELAVG_ASSIGN_OR_RETURN(averager, PeriodicModelAverager::Create(client.get()));
  } else {
    MODELAVG_ASSIGN_OR_RETURN(averager, HierarchicalModelAverager::Create(client.get()));
  }
  averager->set_step(absl::GetFlag(FLAGS_start_step));
  const int rank = client->rank();
  MODELAVG_ASSIGN_OR_RETURN(std::vector<Tensor> tensors,
                            ParseLayout(absl::GetFlag(FLAGS_layout)));
  for (Tensor& t : tensors) {
    for (int64_t i = 0; i < t.numel; ++i) t.Set(i, rank);
  }
  std::vector<TensorView> views;
  for (Tensor& t : tensors) views.push_back(TensorView{t.data(), t.numel, t.dtype});

  const int64_t first = averager->step();
  for (int64_t s = first; s < first + absl::GetFlag(FLAGS_steps); ++s) {
    if (absl::GetFlag(FLAGS_step_sleep_ms) > 0) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_step_sleep_ms)));
    }
    const double add = (rank + 1) * (s + 1) * 0.5;
    for (Tensor& t : tensors) {
      for (int64_t i = 0; i < t.numel; ++i) t.Set(i, t.Get(i) + add);
    }
    std::vector<Tensor> before;
    if (absl::GetFlag(FLAGS_check_untouched)) before = tensors;
    absl::StatusOr<Decision> result = averager->AverageParameters(views);
    if (!result.ok()) {
      if (!absl::GetFlag(FLAGS_check_untouched)) return result.status();
      bool untouched = true;
      for (size_t k = 0; k < tensors.size(); ++k) {
        for (int64_t i = 0; i < tensors[k].numel; ++i) {
          untouched = untouched && tensors[k].Get(i) == before[k].Get(i);
        }
      }
      return absl::Status(result.status().code(),
                          absl::StrCat(result.status().message(),
                                       untouched ? " [parameters untouched]"
                                                 : " [parameters CHANGED]"));
    }
    const Decision d = *result;
    std::string values;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const Tensor& t = tensors[k];
      // Equal inputs give equal results up to the order of the ring's sum: the checked round
      // (ClientOptions::check_finite) divides before it sums, as PyTorch's averagers do, so
      // segments reduced from different members may differ in their last bit.
      const double ulp = t.dtype == DType::kFloat64   ? 0x1p-52
                         : t.dtype == DType::kFloat32 ? 0x1p-23
                                                      : 0x1p-10;
      for (int64_t i = 1; i < t.numel; ++i) {
        if (std::fabs(t.Get(i) - t.Get(0)) > 2 * ulp * std::fabs(t.Get(0))) {
          return absl::InternalError(absl::StrCat("tensor ", k, " element ", i, " is ", t.Get(i),
                                                  " but element 0 is ", t.Get(0)));
        }
      }
      absl::StrAppend(&values, k ? ", " : "",
                      t.numel ? absl::StrFormat("%.17g", t.Get(0)) : std::string("null"));
    }
    std::printf("{\"step\": %lld, \"rank\": %d, \"action\": \"%s\", \"level\": %d, \"values\": [%s]}\n",
                static_cast<long long>(d.step), rank, d.average ? "AVERAGE" : "SKIP",
                d.average ? d.level : -1, values.c_str());
    std::fflush(stdout);
  }
  return client->Leave("finished");
}

}  // namespace
}  // namespace modelavg::client

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  modelavg::InitLogging(absl::GetFlag(FLAGS_log_level)).IgnoreError();
  absl::Status s = modelavg::client::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
