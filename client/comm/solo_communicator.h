// The communicator of a round with one member (a group of one, or an elastic group whose others
// are gone): the mean is the member's own value, nothing is sent. Any backend, any device kind
// the caller's memory is on (host here; a CUDA group of one still runs NCCL).
#ifndef MODELAVG_CLIENT_COMM_SOLO_COMMUNICATOR_H_
#define MODELAVG_CLIENT_COMM_SOLO_COMMUNICATOR_H_

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/comm/communicator.h"

namespace modelavg::client {

// A communicator of one member: averaging is the identity, nothing is sent.
class SoloCommunicator : public Communicator {
 public:
  using Communicator::AllReduceAverage;
  absl::Status AllReduceAverage(absl::Span<const TensorView> tensors, const RoundOptions& options,
                                RoundOutcome* outcome) override;
  // Nothing is ever kept aside: FAILED_PRECONDITION.
  absl::Status AdoptPendingResult(absl::Span<const TensorView> tensors) override;
  void Abort(const absl::Status& why) override;
  int rank() const override { return 0; }
  int size() const override { return 1; }

 private:
  mutable absl::Mutex mu_;
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_SOLO_COMMUNICATOR_H_
