// Runs a job of real worker processes (tests/integration/client_worker.cc) against a real
// coordinator process, and simulates what every rank must print from an independent reference.
#ifndef MODELAVG_TESTS_INTEGRATION_CLIENT_JOB_HARNESS_H_
#define MODELAVG_TESTS_INTEGRATION_CLIENT_JOB_HARNESS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/base/half.h"
#include "client/rpc/coordinator_client.h"
#include "tests/integration/client_test_processes.h"
#include "tests/reference/naive_schedule.h"
#include "tests/tools/make_job_spec.h"

namespace modelavg::testing {

struct StepLine {
  int64_t step = -1;
  int rank = -1;
  std::string action;
  int level = -1;
  std::vector<double> values;  // NaN for an empty tensor ("null")
};

// Parses one line of client_worker's output; false if it is not one.
inline bool ParseStepLine(const std::string& line, StepLine* out) {
  auto field = [&](const std::string& name) -> std::string {
    const std::string key = absl::StrCat("\"", name, "\": ");
    size_t at = line.find(key);
    if (at == std::string::npos) return "";
    at += key.size();
    size_t end = name == "values" ? line.find(']', at) + 1 : line.find_first_of(",}", at);
    return line.substr(at, end - at);
  };
  if (!absl::SimpleAtoi(field("step"), &out->step) || !absl::SimpleAtoi(field("rank"), &out->rank) ||
      !absl::SimpleAtoi(field("level"), &out->level)) {
    return false;
  }
  out->action = std::string(absl::StripPrefix(absl::StripSuffix(field("action"), "\""), "\""));
  std::string values = field("values");
  values = std::string(absl::StripSuffix(absl::StripPrefix(values, "["), "]"));
  out->values.clear();
  for (absl::string_view v : absl::StrSplit(values, ", ", absl::SkipEmpty())) {
    double d = std::nan("");
    if (v != "null" && !absl::SimpleAtod(v, &d)) return false;
    out->values.push_back(d);
  }
  return true;
}

// --layout as client_worker reads it.
struct LayoutItem {
  std::string dtype;
  int64_t numel;
};
inline std::vector<LayoutItem> ParseLayout(const std::string& layout) {
  std::vector<LayoutItem> out;
  if (layout == "none") return out;
  for (absl::string_view item : absl::StrSplit(layout, ',')) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    int64_t n = 0;
    (void)absl::SimpleAtoi(kv[1], &n);
    out.push_back({kv[0], n});
  }
  return out;
}

// A value as the worker stores it in `dtype`.
inline double RoundTo(const std::string& dtype, double v) {
  using namespace modelavg::client;
  if (dtype == "f64") return v;
  const float f = static_cast<float>(v);
  if (dtype == "f32") return f;
  if (dtype == "f16") return HalfToFloat(FloatToHalf(f));
  return BFloat16ToFloat(FloatToBFloat16(f));
}

// expected[step][rank] = the values client_worker must print (exact arithmetic: group sizes
// are powers of two, so dividing, summing and converting are exact at these magnitudes). The
// decisions come from NaiveDecide (tests/reference/naive_schedule.h), not from the library.
inline std::vector<std::vector<StepLine>> Simulate(const v1::JobSpec& spec,
                                                   const std::string& layout, int64_t first_step,
                                                   int64_t steps) {
  const std::vector<LayoutItem> items = ParseLayout(layout);
  const int world = spec.world_size();
  bool any64 = false;
  for (const auto& it : items) any64 = any64 || it.dtype == "f64";
  const std::string staging = any64 ? "f64" : "f32";
  std::vector<std::vector<double>> v(world, std::vector<double>(items.size()));
  for (int r = 0; r < world; ++r) {
    for (size_t k = 0; k < items.size(); ++k) v[r][k] = RoundTo(items[k].dtype, r);
  }
  std::vector<std::vector<StepLine>> out;
  for (int64_t s = first_step; s < first_step + steps; ++s) {
    for (int r = 0; r < world; ++r) {
      for (size_t k = 0; k < items.size(); ++k) {
        v[r][k] = RoundTo(items[k].dtype, v[r][k] + (r + 1) * (s + 1) * 0.5);
      }
    }
    std::vector<std::vector<double>> next = v;
    std::vector<StepLine> lines(world);
    for (int r = 0; r < world; ++r) {
      const NaiveDecision d = NaiveDecide(spec, s, r);
      lines[r].step = s;
      lines[r].rank = r;
      lines[r].action = d.average ? "AVERAGE" : "SKIP";
      lines[r].level = d.level;
      if (d.average) {
        const double n = static_cast<double>(d.group.size());
        for (size_t k = 0; k < items.size(); ++k) {
          double sum = 0;
          for (int m : d.group) sum += RoundTo(staging, v[m][k] / n);
          next[r][k] = RoundTo(items[k].dtype, RoundTo(staging, sum));
        }
      }
    }
    v = next;
    for (int r = 0; r < world; ++r) {
      for (size_t k = 0; k < items.size(); ++k) {
        lines[r].values.push_back(items[k].numel == 0 ? std::nan("") : v[r][k]);
      }
    }
    out.push_back(std::move(lines));
  }
  return out;
}

// Waits until `p` has printed at least `lines` lines; false if it exits first or `timeout`
// passes.
inline bool WaitForLines(Process& p, size_t lines, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (p.OutLines().size() >= lines) return true;
    if (p.Wait(absl::ZeroDuration()).has_value()) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// A coordinator process plus an admin connection to it, in a temporary directory that holds
// every process's output and is removed with the Cluster. Start workers after the Cluster so
// that they are stopped before it.
class Cluster {
 public:
  explicit Cluster(const std::string& name, std::vector<std::string> coordinator_flags = {})
      : dir_(name) {
    if (dir_.path().empty()) return;
    coordinator_ = std::make_unique<CoordinatorProcess>(MODELAVG_COORDINATOR_BIN, dir_.path(),
                                                        std::move(coordinator_flags));
    if (coordinator_->address().empty()) return;
    client::ConnectionOptions o;
    o.coordinator = coordinator_->address();
    auto c = client::CoordinatorClient::Create(o);
    if (c.ok()) admin_ = *std::move(c);
  }
  bool ok() const { return admin_ != nullptr; }
  const std::string& dir() const { return dir_.path(); }
  CoordinatorProcess& coordinator() { return *coordinator_; }
  client::CoordinatorClient* admin() { return admin_.get(); }

  // Starts `world` workers for `job`.
  std::vector<std::unique_ptr<Process>> StartWorkers(const std::string& job, int world,
                                                     std::vector<std::string> flags) {
    std::vector<std::unique_ptr<Process>> out;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {MODELAVG_CLIENT_WORKER_BIN,
                                       "--coordinator=" + coordinator_->address(),
                                       "--job=" + job, absl::StrCat("--rank=", r)};
      for (const auto& f : flags) argv.push_back(f);
      out.push_back(
          std::make_unique<Process>(argv, absl::StrCat(dir_.path(), "/", job, "-rank", r)));
    }
    return out;
  }

 private:
  TempDir dir_;  // removed last, after the coordinator has stopped
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<client::CoordinatorClient> admin_;
};

// The last `n` bytes of `s` (a process's log), for a failing test's message.
inline std::string TailOf(const std::string& s, size_t n) {
  return s.size() <= n ? s : s.substr(s.size() - n);
}

// The coordinator's log and every worker's stderr (their last `n` bytes each), for a failing
// test's message.
inline std::string WorkersDiagnostics(Cluster& cluster,
                                      const std::vector<std::unique_ptr<Process>>& workers,
                                      size_t n = 2000) {
  std::string s = absl::StrCat("\ncoordinator log (tail):\n",
                               TailOf(cluster.coordinator().process().err(), n));
  for (size_t i = 0; i < workers.size(); ++i) {
    absl::StrAppend(&s, "\nworker ", i, " stderr (tail):\n", TailOf(workers[i]->err(), n));
  }
  return s;
}

// Polls `done` every 10 ms until it holds (true) or `timeout` passes (false).
inline bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_CLIENT_JOB_HARNESS_H_
