#include "client/comm/communicator.h"

#include <utility>

namespace modelavg::client {

void SetupCanceller::Cancel(absl::Status why) {
  if (why.ok()) why = absl::AbortedError("the communicator's set-up was cancelled");
  std::vector<std::function<void(const absl::Status&)>> hooks;
  {
    absl::MutexLock l(&mu_);
    if (!why_.ok()) return;
    why_ = why;
    hooks.swap(hooks_);
  }
  for (auto& hook : hooks) hook(why);
}

absl::Status SetupCanceller::status() const {
  absl::MutexLock l(&mu_);
  return why_;
}

void SetupCanceller::OnCancel(std::function<void(const absl::Status&)> hook) {
  absl::Status why;
  {
    absl::MutexLock l(&mu_);
    if (why_.ok()) {
      hooks_.push_back(std::move(hook));
      return;
    }
    why = why_;
  }
  hook(why);
}

}  // namespace modelavg::client
