// The communicators this build can make: Gloo over TCP on host memory, NCCL on CUDA memory
// (when built with CUDA). The Client hands one to its CommunicatorCache; tests hand their own
// factory instead (tests/testing/).
#ifndef MODELAVG_CLIENT_SESSION_BACKENDS_H_
#define MODELAVG_CLIENT_SESSION_BACKENDS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/comm/communicator_factory.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace modelavg::client {

class BackendFactory : public CommunicatorFactory {
 public:
  // `gloo_hostname`: the address the shared Gloo TCP device binds to (made at the first Gloo
  // communicator).
  explicit BackendFactory(std::string gloo_hostname);
  ~BackendFactory() override;

  // Host memory: a GlooCommunicator over the coordinator's rendezvous store. CUDA memory: an
  // NcclCommunicator on the tensor's device, or UNIMPLEMENTED in a build without CUDA.
  absl::StatusOr<std::unique_ptr<Communicator>> Create(const CommunicatorSetup& setup,
                                                       const Device& device) override;

 private:
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> GlooDevice() ABSL_LOCKS_EXCLUDED(mu_);

  const std::string gloo_hostname_;
  absl::Mutex mu_;
  std::shared_ptr<gloo::transport::Device> gloo_device_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_BACKENDS_H_
