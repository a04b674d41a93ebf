// A blocking library call run on its own thread while the calling Python thread waits without
// the GIL and stays responsive to signals: Ctrl-C raises KeyboardInterrupt at once, and the
// abandoned call ends on its own (at once when the interrupt cancels it, else at its own
// deadline) and frees what it captured. The calls still running are counted process-wide, so that
// the interpreter's exit can wait for them (WaitForBackgroundCalls) before the process tears down
// what they use (logging, gRPC).
#ifndef MODELAVG_PYTHON_BACKGROUND_CALL_H_
#define MODELAVG_PYTHON_BACKGROUND_CALL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pybind11/pybind11.h"
#include "spdlog/spdlog.h"

namespace modelavg::python {

// How often a waiting thread checks for signals.
inline constexpr absl::Duration kSignalPoll = absl::Milliseconds(20);

// The background calls still running in this process. Never destroyed: a call may end after the
// process's static destructors have started.
class BackgroundCalls {
 public:
  static BackgroundCalls& Get() {
    static BackgroundCalls* calls = new BackgroundCalls;
    return *calls;
  }
  void Started() {
    absl::MutexLock l(&mu_);
    ++running_;
  }
  void Ended() {
    absl::MutexLock l(&mu_);
    --running_;
  }
  // Waits up to `bound` for every call to end; the number still running. Without the GIL.
  int64_t WaitFor(absl::Duration bound) {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(this, &BackgroundCalls::NoneRunning), bound);
    return running_;
  }

 private:
  bool NoneRunning() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; }

  absl::Mutex mu_;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
};

// How long the interpreter's exit waits for the calls interrupted by Ctrl-C (at_exit in
// python/core.cc). An interrupted connect or leave is cancelled and ends well within it; an
// interrupted averaging step runs to its end or collective_timeout, an interrupted job RPC to
// rpc_timeout.
inline constexpr absl::Duration kExitWait = absl::Seconds(5);

// At the interpreter's exit: waits (kExitWait at most, without the GIL) for the background calls
// to end, and warns when some still run, since the process then exits under them.
inline void WaitForBackgroundCallsAtExit() {
  int64_t running;
  {
    pybind11::gil_scoped_release nogil;
    running = BackgroundCalls::Get().WaitFor(kExitWait);
  }
  if (running == 0) return;
  spdlog::warn(
      "modelavg: the process exits with {} call(s) interrupted by Ctrl-C still running after "
      "waiting {} for them (an averaging step runs until it ends or collective_timeout "
      "passes); the exit may tear logging and gRPC down under them",
      running, absl::FormatDuration(kExitWait));
}

// A thread kept for the calls of one owner (an averager), so that a call costs a hand-off to a
// waiting thread rather than the creation of one. Calls run one at a time, in order. Its
// destruction does not wait: the thread ends once the calls handed to it have ended (an
// interrupted averaging call may still run), owning what it needs.
class CallThread {
 public:
  CallThread() : state_(std::make_shared<State>()) {}
  ~CallThread() {
    absl::MutexLock l(&state_->mu);
    state_->stopping = true;
  }
  CallThread(const CallThread&) = delete;
  CallThread& operator=(const CallThread&) = delete;

  // Runs `job` on the thread (started at the first call).
  void Run(std::function<void()> job) {
    absl::MutexLock l(&state_->mu);
    state_->jobs.push_back(std::move(job));
    if (!state_->started) {
      state_->started = true;
      std::thread([state = state_] { Loop(state); }).detach();
    }
  }

 private:
  struct State {
    absl::Mutex mu;
    std::vector<std::function<void()>> jobs ABSL_GUARDED_BY(mu);
    bool started ABSL_GUARDED_BY(mu) = false;
    bool stopping ABSL_GUARDED_BY(mu) = false;
  };
  static void Loop(const std::shared_ptr<State>& state) {
    while (true) {
      std::vector<std::function<void()>> jobs;
      {
        absl::MutexLock l(&state->mu);
        auto ready = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
          return !state->jobs.empty() || state->stopping;
        };
        state->mu.Await(absl::Condition(&ready));
        if (state->jobs.empty()) return;  // stopping, and nothing left to run
        jobs.swap(state->jobs);
      }
      for (auto& job : jobs) job();
    }
  }

  std::shared_ptr<State> state_;
};

// One call running on its own thread (or on a CallThread). The thread owns a reference, so an
// abandoned (interrupted) call ends on its own and frees what it holds.
template <typename T>
class BackgroundCall {
 public:
  // `on`: the CallThread to run it on; null: a thread of its own.
  static std::shared_ptr<BackgroundCall> Start(std::function<T()> fn, CallThread* on = nullptr) {
    auto call = std::make_shared<BackgroundCall>();
    BackgroundCalls::Get().Started();
    auto job = [call, fn = std::move(fn)]() mutable {
      T result = fn();
      fn = nullptr;  // release what the call captured before saying it is done
      {
        absl::MutexLock l(&call->mu_);
        call->result_.emplace(std::move(result));
      }
      // An abandoned call's result goes here (a connected Client leaves the job): still counted.
      call = nullptr;
      BackgroundCalls::Get().Ended();
    };
    if (on != nullptr) {
      on->Run(std::move(job));
    } else {
      std::thread(std::move(job)).detach();
    }
    return call;
  }

  bool done() const {
    absl::MutexLock l(&mu_);
    return result_.has_value();
  }

  // Waits without the GIL until the call ends; checks for signals every kSignalPoll (with the
  // GIL) and throws the KeyboardInterrupt (or whatever a signal handler raised) at once, after
  // running `on_interrupt` (with the GIL; it must not block) when there is one.
  T Wait(const std::function<void()>& on_interrupt = nullptr) {
    while (true) {
      {
        pybind11::gil_scoped_release nogil;
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(this, &BackgroundCall::HasResult), kSignalPoll);
        if (result_.has_value()) return *std::move(result_);
      }
      if (PyErr_CheckSignals() != 0) {
        if (on_interrupt) on_interrupt();
        throw pybind11::error_already_set();
      }
    }
  }

 private:
  bool HasResult() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return result_.has_value(); }

  mutable absl::Mutex mu_;
  std::optional<T> result_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
T RunInterruptibly(std::function<T()> fn, const std::function<void()>& on_interrupt = nullptr) {
  return BackgroundCall<T>::Start(std::move(fn))->Wait(on_interrupt);
}

}  // namespace modelavg::python

#endif  // MODELAVG_PYTHON_BACKGROUND_CALL_H_
