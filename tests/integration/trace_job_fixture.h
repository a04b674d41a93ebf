// A test fixture that runs whole jobs of modelavg-trace-worker processes (tests/tools/
// trace_worker.cc) over Gloo on loopback against a coordinator of its own, and hands back each
// rank's trace for the test to compare with a reference.
#ifndef MODELAVG_TESTS_INTEGRATION_TRACE_JOB_FIXTURE_H_
#define MODELAVG_TESTS_INTEGRATION_TRACE_JOB_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/integration/client_job_harness.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {

class TraceJobTest : public ::testing::Test {
 protected:
  // `name` names the temporary directory of the coordinator and the workers' output.
  explicit TraceJobTest(const std::string& name) : cluster_(name) {}
  ~TraceJobTest() override { workers_.clear(); }

  // Creates `spec`'s job and runs its ranks 0..world-1 for `steps` steps (<= 0: no --steps, the
  // flags give the length, e.g. --rounds) of `numel` elements,
  // every rank with `flags` and rank r also with `rank_flags[r]`; waits up to kRunDeadline for
  // each. Returns the traces by rank, or empty with a test failure if the job was not made.
  // Without `errors`, every rank must exit 0 and print a valid trace; with it, each rank's
  // "exit <code>: <stderr>" is appended there for the test to check instead.
  std::vector<Trace> RunJob(const v1::JobSpec& spec, int64_t steps, int64_t numel,
                            const std::vector<std::string>& flags = {},
                            const std::vector<std::vector<std::string>>& rank_flags = {},
                            std::vector<std::string>* errors = nullptr) {
    EXPECT_TRUE(cluster_.ok()) << cluster_.dir();
    if (!cluster_.ok()) return {};
    absl::StatusOr<v1::Job> made = cluster_.admin()->CreateJob(spec);
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return {};
    const int world = spec.world_size();
    std::vector<std::unique_ptr<Process>> procs;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv =
          TraceWorkerArgv(MODELAVG_TRACE_WORKER_BIN, cluster_.coordinator().address(),
                          spec.job_id(), r, world, numel, steps);
      argv.push_back("--join_timeout_ms=30000");
      argv.push_back("--collective_timeout_ms=30000");
      argv.insert(argv.end(), flags.begin(), flags.end());
      if (static_cast<size_t>(r) < rank_flags.size()) {
        argv.insert(argv.end(), rank_flags[r].begin(), rank_flags[r].end());
      }
      procs.push_back(std::make_unique<Process>(
          argv, absl::StrCat(cluster_.dir(), "/", spec.job_id(), "-rank", r)));
    }
    std::vector<Trace> traces;
    for (int r = 0; r < world; ++r) {
      std::optional<int> code = procs[r]->Wait(kRunDeadline);
      EXPECT_TRUE(code.has_value()) << "rank " << r << " still running";
      if (errors != nullptr) {
        errors->push_back(absl::StrCat("exit ", code.value_or(-1), ": ", procs[r]->err()));
      } else {
        EXPECT_EQ(code.value_or(-1), 0) << "rank " << r << ": " << procs[r]->err();
      }
      absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), procs[r]->out());
      if (errors == nullptr) EXPECT_TRUE(t.ok()) << t.status();
      traces.push_back(t.ok() ? *std::move(t) : Trace{});
    }
    for (auto& p : procs) workers_.push_back(std::move(p));
    return traces;
  }

  static constexpr absl::Duration kRunDeadline = absl::Seconds(90);

  Cluster cluster_;
  std::vector<std::unique_ptr<Process>> workers_;  // finished ones, stopped before the Cluster
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_TRACE_JOB_FIXTURE_H_
