// How a CommunicatorCache makes the communicator of one key: the backends of this build (Gloo on
// host memory, NCCL on CUDA memory: client/session/backends.h), or a test's own (a faulty or
// fake communicator wrapped around a real one, tests/testing/). The cache owns what it makes.
#ifndef MODELAVG_CLIENT_COMM_COMMUNICATOR_FACTORY_H_
#define MODELAVG_CLIENT_COMM_COMMUNICATOR_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "client/comm/communicator.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;

  // The communicator of member setup.MemberIndex() of setup.MemberCount() (at least 2) on
  // `device`, bootstrapped through setup.coordinator: blocks until every member has joined it,
  // at most setup.timeout; setup.cancel (set by the cache) ends the wait at once.
  // setup.bootstrap_attempt numbers the bootstraps of one key (NCCL takes a fresh id each time).
  // Errors: the backend's (DEADLINE_EXCEEDED, UNAVAILABLE, the cancel's status, ...);
  // UNIMPLEMENTED for a device this build has no backend for.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Create(const CommunicatorSetup& setup,
                                                               const Device& device) = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_COMMUNICATOR_FACTORY_H_
