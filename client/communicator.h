// A communicator averages tensors across the members of one subgroup. One exists per
// (generation, level, subgroup, device kind), created lazily at the first averaging step that
// needs it and cached by CommunicatorCache (communicator_cache.h).
#ifndef MODELAVG_CLIENT_COMMUNICATOR_H_
#define MODELAVG_CLIENT_COMMUNICATOR_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/tensor.h"

namespace modelavg::client {

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Replaces every tensor, in place, with the element-wise mean of the members' tensors (the
  // same list layout on every member). On an error the tensors are left untouched; the
  // communicator is then broken and every later call fails with the same error.
  // Errors: INVALID_ARGUMENT (tensors on the wrong device for this communicator; the members'
  // layouts differ: total element count or dtype), DEADLINE_EXCEEDED (a member did not take
  // part in time), ABORTED / FAILED_PRECONDITION (the generation changed), INTERNAL (transport
  // failure, with the cause).
  virtual absl::Status AllReduceAverage(absl::Span<const TensorView> tensors) = 0;

  // Makes the call in flight on another thread (if any) and every later call fail with `why`
  // promptly, leaving their tensors as AllReduceAverage promises on an error. Thread-safe and
  // non-blocking: called by the client's heartbeat thread when the job moves to a new
  // generation, so that no collective outlives its generation (a stopped or hung peer must not
  // hold the survivors for the collective timeout). Idempotent; the first `why` is kept.
  virtual void Abort(const absl::Status& why) = 0;

  // This member's index in the subgroup and the subgroup's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMMUNICATOR_H_
