#include "common/stop_signals.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <utility>

namespace modelavg {
namespace {

sigset_t StopSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// How often the signal thread looks whether its object is going away.
constexpr long kPollNanos = 100 * 1000 * 1000;

}  // namespace

StopSignals::StopSignals() {
  const sigset_t set = StopSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  thread_ = std::thread([this] { Run(); });
}

StopSignals::~StopSignals() {
  quit_.store(true);
  thread_.join();
  const sigset_t set = StopSet();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

std::string StopSignals::name() const {
  switch (signal_.load()) {
    case 0:
      return "";
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    default:
      return "signal " + std::to_string(signal_.load());
  }
}

void StopSignals::Run() {
  const sigset_t set = StopSet();
  const timespec poll{0, kPollNanos};
  while (!quit_.load()) {
    const int sig = sigtimedwait(&set, nullptr, &poll);
    if (sig <= 0) continue;  // the poll's timeout, or EINTR
    if (requested()) {
      // The second one: the person asking will not wait for the clean exit.
      static constexpr char kMessage[] = "second stop signal: exiting at once\n";
      (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
      std::_Exit(128 + sig);
    }
    Request(sig);
  }
}

void StopSignals::Request(int sig) {
  std::vector<std::function<void(int)>> run;
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return;
    stopped_ = true;
    signal_.store(sig);
    run = callbacks_;
  }
  for (const auto& callback : run) callback(sig);
}

void StopSignals::OnStop(std::function<void(int)> callback) {
  {
    absl::MutexLock l(&mu_);
    if (!stopped_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  callback(signal_.load());
}

bool StopSignals::SleepFor(absl::Duration d) const {
  absl::MutexLock l(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&stopped_), d);
  return !stopped_;
}

}  // namespace modelavg
