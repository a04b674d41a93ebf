// SIGTERM and SIGINT as a request to stop: how a program leaves its job cleanly when a container
// engine, a scheduler or a person asks it to (`docker stop`, `podman stop`, `kubectl delete`,
// Ctrl-C). The coordinator takes its signals in main (server/main.cc); the programs that train
// (modelavg-demo, modelavg-trace-worker) use this.
//
//   int main(int argc, char** argv) {
//     absl::ParseCommandLine(argc, argv);
//     modelavg::StopSignals stop;                // before any thread is started
//     stop.OnStop([token](int) { token->Cancel(); });
//     ... between steps: if (stop.requested()) { leave the job; return stop.exit_code(); }
//   }
//
// The signals are blocked in the constructing thread, and so in every thread started after it,
// and taken by a thread of the object's own (sigtimedwait), so that nothing runs inside a signal
// handler: the first one is recorded and the OnStop callbacks run on that thread (a blocking call
// can be cancelled from there). A second signal ends the process at once with 128 + its number,
// for a person who will not wait for the clean exit.
#ifndef MODELAVG_COMMON_STOP_SIGNALS_H_
#define MODELAVG_COMMON_STOP_SIGNALS_H_

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace modelavg {

class StopSignals {
 public:
  // Blocks SIGTERM and SIGINT in this thread and starts the thread that takes them. Construct
  // one per process, before any other thread is started (a thread started earlier keeps the
  // signals unblocked and may take them with their default action: the process ends at once).
  StopSignals();
  // Stops the signal thread and unblocks the signals in this thread.
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Whether a stop was asked for.
  bool requested() const { return signal_.load() != 0; }
  // The first signal's number, 0 if none came.
  int signal() const { return signal_.load(); }
  // "SIGTERM", "SIGINT" ("" if none came).
  std::string name() const;
  // The exit code of a program that stopped on request: 128 + the signal, as a shell reports a
  // process ended by it (143 for SIGTERM, 130 for SIGINT).
  int exit_code() const { return 128 + signal_.load(); }

  // Runs `callback(signal)` on the signal thread at the first signal (at once, on this thread,
  // if one came already). It must not block for long.
  void OnStop(std::function<void(int)> callback);

  // Sleeps up to `d`; returns early, false, once a stop is asked for.
  bool SleepFor(absl::Duration d) const;

  // Asks for a stop as the signal `sig` would (for tests and for a program that stops itself).
  void Request(int sig);

 private:
  void Run();

  std::atomic<int> signal_{0};
  std::atomic<bool> quit_{false};
  mutable absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void(int)>> callbacks_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace modelavg

#endif  // MODELAVG_COMMON_STOP_SIGNALS_H_
