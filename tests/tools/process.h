// A child process for tests: its own process group, stdout and stderr captured in files, killed
// as a group when the Process goes away (and when the test process dies without running its
// destructors).
#ifndef MODELAVG_TESTS_TOOLS_PROCESS_H_
#define MODELAVG_TESTS_TOOLS_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace modelavg::testing {

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Process {
 public:
  // Starts argv[0] with `argv`; stdout/stderr go to <out_prefix>.out / .err.
  Process(const std::vector<std::string>& argv, const std::string& out_prefix)
      : out_(out_prefix + ".out"), err_(out_prefix + ".err") {
    // Everything the child needs is prepared before fork(): after it, only async-signal-safe
    // calls (the parent has gRPC threads).
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      // Its own process group, so that it is stopped and killed as a group; and killed if
      // this test process dies without running its destructors.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      const int out = open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out >= 0) dup2(out, 1);
      if (err >= 0) dup2(err, 2);
      execv(args[0], args.data());
      _exit(127);
    }
    if (pid_ > 0) setpgid(pid_, pid_);  // also here: no race with a signal sent right away
  }
  // Kills the child's whole process group (a stopped one too) and reaps the child.
  ~Process() {
    if (!exit_code_.has_value() && pid_ > 0) {
      kill(-pid_, SIGKILL);
      kill(pid_, SIGKILL);
      int st;
      waitpid(pid_, &st, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // Sends `sig` to the child's process group.
  void Signal(int sig) { kill(-pid_, sig); }

  // The exit code (128 + signal for a signal), or nullopt if still running at the deadline.
  std::optional<int> Wait(absl::Duration timeout) {
    if (exit_code_) return exit_code_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return exit_code_;
      }
      if (absl::Now() > deadline) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  std::string out() const { return ReadWholeFile(out_); }
  std::string err() const { return ReadWholeFile(err_); }
  std::vector<std::string> OutLines() const {
    std::vector<std::string> lines;
    for (absl::string_view l : absl::StrSplit(out(), '\n', absl::SkipEmpty())) {
      lines.emplace_back(l);
    }
    return lines;
  }

 private:
  pid_t pid_ = -1;
  std::string out_, err_;
  std::optional<int> exit_code_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TOOLS_PROCESS_H_
