#include "client/comm/solo_communicator.h"

#include "absl/strings/str_cat.h"
#include "client/comm/finite_check.h"
#include "client/payload/finite_scan.h"
#include "common/status_util.h"

namespace modelavg::client {

void SoloCommunicator::Abort(const absl::Status& why) {
  absl::MutexLock l(&mu_);
  if (aborted_.ok()) aborted_ = why.ok() ? absl::AbortedError("aborted") : why;
}

absl::Status SoloCommunicator::AdoptPendingResult(absl::Span<const TensorView> /*tensors*/) {
  return absl::FailedPreconditionError("a one-member round keeps nothing aside");
}

absl::Status SoloCommunicator::AllReduceAverage(absl::Span<const TensorView> tensors,
                                                const RoundOptions& options,
                                                RoundOutcome* outcome) {
  if (outcome != nullptr) *outcome = RoundOutcome::kFailedWithoutResult;
  if (!options.contribute) {
    return absl::InvalidArgumentError(
        "a round of one member that does not contribute has nothing to average");
  }
  {
    absl::MutexLock l(&mu_);
    if (!aborted_.ok()) return aborted_;
  }
  // The mean of one member is its own value; only the arguments are checked.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel < 0 || (tensors[i].numel > 0 && tensors[i].data == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " has numel ", tensors[i].numel, " and data ",
                       tensors[i].data == nullptr ? "null" : "set"));
    }
  }
  // Alone, a member spreads its values to nobody; its call still fails on its own non-finite
  // values as a subgroup's would (host tensors: CUDA ones are not read here).
  if (options.check_finite && !tensors.empty() && tensors[0].device.is_host()) {
    const NonFiniteFinding finding = ScanTensors(tensors);
    const int64_t code = FindingCode(finding);
    MODELAVG_RETURN_IF_ERROR(DecideFinite(absl::MakeConstSpan(&code, 1), options.step));
  }
  if (outcome != nullptr) *outcome = RoundOutcome::kCompleted;
  return absl::OkStatus();
}

}  // namespace modelavg::client
