#include "client/rpc/coordinator_outage.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

void CoordinatorOutage::NoteReachable() {
  absl::MutexLock l(&mu_);
  if (!out_) return;
  out_ = false;
  spdlog::warn("coordinator {} answers again after {} unreachable", coordinator_,
               absl::FormatDuration(absl::Trunc(clock_->Now() - since_, absl::Milliseconds(1))));
}

void CoordinatorOutage::NoteUnreachable(const absl::Status& error) {
  absl::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  last_error_ = error;
  if (!out_) {
    out_ = true;
    since_ = now;
    next_log_ = now + absl::Seconds(30);
    spdlog::warn("coordinator {} unreachable ({}); training goes on with the local schedule and "
                 "the existing communicators; work that needs the coordinator waits for it up "
                 "to {}",
                 coordinator_, error.ToString(), absl::FormatDuration(timeout_));
    return;
  }
  if (now >= next_log_) {
    next_log_ = now + absl::Seconds(30);
    spdlog::warn("coordinator {} still unreachable after {} ({})", coordinator_,
                 absl::FormatDuration(absl::Trunc(now - since_, absl::Seconds(1))),
                 error.ToString());
  }
}

absl::Duration CoordinatorOutage::OutageLength() const {
  absl::MutexLock l(&mu_);
  return out_ ? clock_->Now() - since_ : absl::ZeroDuration();
}

bool CoordinatorOutage::IsOutage(const absl::Status& status) const {
  if (absl::IsUnavailable(status)) return true;
  if (!absl::IsDeadlineExceeded(status)) return false;
  absl::MutexLock l(&mu_);
  return out_;
}

absl::Status CoordinatorOutage::Error(absl::string_view what, const absl::Status& last) const {
  return absl::UnavailableError(absl::StrCat(
      "the coordinator at ", coordinator_, " has not answered for ",
      absl::FormatDuration(absl::Trunc(OutageLength(), absl::Milliseconds(1))),
      " (ClientOptions.coordinator_outage_timeout is ", absl::FormatDuration(timeout_),
      "; last error: ", last.ToString(), "): ", what,
      " needs it. Restart the coordinator (a --state_dir keeps the job), or raise the timeout"));
}

}  // namespace modelavg::client
