// The fixture of the tests that run one elastic job of modelavg-trace-worker processes against a
// coordinator process: the workers are started one at a time, each with the flags every such
// test gives them (the coordinator, the job, the world size, Gloo, the join and collective
// timeouts, info logs) and its own; a worker started without a rank is a replacement in a
// running job (the coordinator picks its rank). Each test's fixture derives from it and adds
// what its job needs (its step flags, its checks).
#ifndef MODELAVG_TESTS_INTEGRATION_ELASTIC_WORKERS_FIXTURE_H_
#define MODELAVG_TESTS_INTEGRATION_ELASTIC_WORKERS_FIXTURE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/trace_check.h"
#include "tests/tools/process.h"

namespace modelavg::testing {

class ElasticWorkersTest : public ::testing::Test {
 protected:
  // How long a whole job's worker may take by default (WaitFor, WaitForStep).
  static constexpr absl::Duration kWorkerDeadline = absl::Seconds(90);

  // `name`: the cluster's folder's; `world`: the job's world size, given to every worker.
  ElasticWorkersTest(const std::string& name, int world) : cluster_(name), world_(world) {}
  ~ElasticWorkersTest() override {
    workers_.clear();  // killed (as a process group) if still running, before the coordinator
  }

  // Starts a worker of `job` as `rank` (-1: none, the coordinator picks one) with `flags` after
  // the common ones; returns its index in workers_.
  size_t StartWorker(const std::string& job, int rank, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {MODELAVG_TRACE_WORKER_BIN,
                                     "--coordinator=" + cluster_.coordinator().address(),
                                     "--job=" + job,
                                     absl::StrCat("--world_size=", world_),
                                     "--backend=gloo",
                                     "--join_timeout_ms=30000",
                                     "--collective_timeout_ms=60000",
                                     "--log_level=info"};
    if (rank >= 0) argv.push_back(absl::StrCat("--rank=", rank));
    argv.insert(argv.end(), flags.begin(), flags.end());
    const size_t i = workers_.size();
    who_.push_back(rank >= 0 ? absl::StrCat("rank ", rank)
                             : absl::StrCat("worker ", i, " (no --rank)"));
    workers_.push_back(
        std::make_unique<Process>(argv, absl::StrCat(cluster_.dir(), "/", job, "-worker", i)));
    return i;
  }

  // Kills every worker still running and forgets them all: the next one started is index 0.
  void ClearWorkers() {
    workers_.clear();
    who_.clear();
  }

  // What worker i printed so far, parsed; a line that does not parse fails the test.
  Trace TraceOf(size_t i) {
    absl::StatusOr<Trace> t = ParseTrace(who_[i], workers_[i]->out());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : Trace{who_[i], {}};
  }
  // The same without failing the test on a line that does not parse (empty then): for polls
  // that may read a worker killed in the middle of a line.
  Trace TraceSoFar(size_t i) {
    absl::StatusOr<Trace> t = ParseTrace(who_[i], workers_[i]->out());
    return t.ok() ? *std::move(t) : Trace{who_[i], {}};
  }

  // Polls `done` every 10 ms until it holds (true) or `timeout` passes (false).
  static bool WaitFor(absl::Duration timeout, const std::function<bool()>& done) {
    return WaitUntil(done, timeout);
  }
  static bool WaitFor(const std::function<bool()>& done) { return WaitFor(kWorkerDeadline, done); }

  // Waits until worker i has printed step `step` (false: it exited first, or the deadline).
  bool WaitForStep(size_t i, int64_t step, absl::Duration timeout = kWorkerDeadline) {
    bool reached = false;
    WaitFor(timeout, [&] {
      const Trace t = TraceOf(i);
      reached = !t.lines.empty() && t.lines.back().step >= step;
      return reached || workers_[i]->Wait(absl::ZeroDuration()).has_value();
    });
    return reached;
  }

  // The coordinator's log and every worker's stderr (the last `n` bytes of each).
  std::string Diagnostics(size_t n = 2000) { return WorkersDiagnostics(cluster_, workers_, n); }

  Cluster cluster_;
  const int world_;
  std::vector<std::unique_ptr<Process>> workers_;  // after cluster_: stopped before it
  std::vector<std::string> who_;                   // each worker's name in messages
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_ELASTIC_WORKERS_FIXTURE_H_
