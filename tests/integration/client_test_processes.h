// Child processes for the client's integration tests: a modelavg-coordinator on 127.0.0.1:0
// (the port from its --port_file) and worker processes, each in its own process group with
// stdout and stderr captured in files, killed as a group when the Process goes away.
#ifndef MODELAVG_TESTS_INTEGRATION_CLIENT_TEST_PROCESSES_H_
#define MODELAVG_TESTS_INTEGRATION_CLIENT_TEST_PROCESSES_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/tools/process.h"
#include "tests/tools/temp_dir.h"

namespace modelavg::testing {

// modelavg-coordinator on 127.0.0.1:0; address() once it serves ("" if it did not start).
class CoordinatorProcess {
 public:
  CoordinatorProcess(const std::string& binary, const std::string& dir,
                     std::vector<std::string> extra_flags = {}) {
    const std::string port_file = dir + "/coordinator.port";
    std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0",
                                     "--port_file=" + port_file, "--log_level=warn"};
    for (std::string& f : extra_flags) argv.push_back(std::move(f));
    process_ = std::make_unique<Process>(argv, dir + "/coordinator");
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      std::string addr(absl::StripAsciiWhitespace(ReadWholeFile(port_file)));
      if (!addr.empty()) {
        address_ = addr;
        break;
      }
      if (process_->Wait(absl::ZeroDuration()).has_value()) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  const std::string& address() const { return address_; }
  Process& process() { return *process_; }

 private:
  std::unique_ptr<Process> process_;
  std::string address_;
};

// The command line of a modelavg-trace-worker (`binary`) of rank `rank` in `job`, a Gloo rank of
// `world` with `numel` parameters, for `steps` steps (<= 0: no --steps; the caller's flags say
// how long, e.g. --rounds of a paced job). The caller appends its own flags.
inline std::vector<std::string> TraceWorkerArgv(const std::string& binary,
                                                const std::string& coordinator,
                                                const std::string& job, int rank, int world,
                                                int64_t numel, int64_t steps) {
  std::vector<std::string> argv = {binary,
                                   "--coordinator=" + coordinator,
                                   "--job=" + job,
                                   absl::StrCat("--rank=", rank),
                                   absl::StrCat("--world_size=", world),
                                   absl::StrCat("--numel=", numel),
                                   "--backend=gloo"};
  if (steps > 0) argv.push_back(absl::StrCat("--steps=", steps));
  return argv;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_CLIENT_TEST_PROCESSES_H_
