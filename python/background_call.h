// A blocking library call run on its own thread while the calling Python thread waits without
// the GIL and stays responsive to signals: Ctrl-C raises KeyboardInterrupt at once, and the
// abandoned call ends on its own (at its own deadline) and frees what it captured.
#ifndef MODELAVG_PYTHON_BACKGROUND_CALL_H_
#define MODELAVG_PYTHON_BACKGROUND_CALL_H_

#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pybind11/pybind11.h"

namespace modelavg::python {

// How often a waiting thread checks for signals.
inline constexpr absl::Duration kSignalPoll = absl::Milliseconds(20);

// One call running on its own thread. The thread owns a reference, so an abandoned (interrupted)
// call ends on its own and frees what it holds.
template <typename T>
class BackgroundCall {
 public:
  static std::shared_ptr<BackgroundCall> Start(std::function<T()> fn) {
    auto call = std::make_shared<BackgroundCall>();
    std::thread([call, fn = std::move(fn)]() mutable {
      T result = fn();
      fn = nullptr;  // release what the call captured before saying it is done
      absl::MutexLock l(&call->mu_);
      call->result_.emplace(std::move(result));
    }).detach();
    return call;
  }

  bool done() const {
    absl::MutexLock l(&mu_);
    return result_.has_value();
  }

  // Waits without the GIL until the call ends; checks for signals every kSignalPoll (with the
  // GIL) and throws the KeyboardInterrupt (or whatever a signal handler raised) at once.
  T Wait() {
    while (true) {
      {
        pybind11::gil_scoped_release nogil;
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(this, &BackgroundCall::HasResult), kSignalPoll);
        if (result_.has_value()) return *std::move(result_);
      }
      if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
    }
  }

 private:
  bool HasResult() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return result_.has_value(); }

  mutable absl::Mutex mu_;
  std::optional<T> result_ ABSL_GUARDED_BY(mu_);
};

template <typename T>
T RunInterruptibly(std::function<T()> fn) {
  return BackgroundCall<T>::Start(std::move(fn))->Wait();
}

}  // namespace modelavg::python

#endif  // MODELAVG_PYTHON_BACKGROUND_CALL_H_
