// modelavg-trace-worker-faults: the tests' variant of modelavg-trace-worker (not installed). It
// runs the same program (tools/trace_worker.cc) and also takes --testing_fail_commit_at_step,
// whose lost commit comes from a communicator wrapped around the real one (tests/testing/).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "client/session/backends.h"
#include "tests/testing/faulty_communicator.h"
#include "tools/trace_worker.h"

ABSL_FLAG(int64_t, testing_fail_commit_at_step, -1,
          "tests: the committed round of this step loses its confirmation on this rank after "
          "its peers completed it (elastic jobs, gloo)");

namespace {

// The flag's lost commit, from a communicator wrapped around the build's own; none without it.
std::unique_ptr<modelavg::client::CommunicatorFactory> Communicators(
    const std::string& gloo_hostname) {
  const int64_t at = absl::GetFlag(FLAGS_testing_fail_commit_at_step);
  if (at < 0) return nullptr;
  auto faults = std::make_shared<modelavg::testing::CommunicatorFaults>();
  faults->LoseCommitAt(at);
  return std::make_unique<modelavg::testing::FaultyCommunicatorFactory>(
      std::make_unique<modelavg::client::BackendFactory>(gloo_hostname), std::move(faults),
      gloo_hostname);
}

}  // namespace

int main(int argc, char** argv) { return modelavg::TraceWorkerMain(argc, argv, Communicators); }
