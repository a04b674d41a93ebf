#include "client/session/backends.h"

#include <utility>

#include "client/comm/gloo/coordinator_store.h"
#include "client/comm/gloo/gloo_communicator.h"
#include "common/status_util.h"
#if MODELAVG_HAVE_CUDA
#include "client/comm/nccl/cuda/nccl_communicator.h"
#endif

namespace modelavg::client {

BackendFactory::BackendFactory(std::string gloo_hostname)
    : gloo_hostname_(std::move(gloo_hostname)) {}

BackendFactory::~BackendFactory() = default;

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> BackendFactory::GlooDevice() {
  absl::MutexLock l(&mu_);
  if (gloo_device_ == nullptr) {
    MODELAVG_ASSIGN_OR_RETURN(gloo_device_, CreateGlooDevice(gloo_hostname_));
  }
  return gloo_device_;
}

absl::StatusOr<std::unique_ptr<Communicator>> BackendFactory::Create(
    const CommunicatorSetup& setup, const Device& device) {
  if (device.is_host()) {
    MODELAVG_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> dev, GlooDevice());
    CoordinatorStore store(setup, "gloo/" + setup.MemberScope());
    GlooAlgorithms algorithms;
    algorithms.scatter_max_bytes = setup.gloo_scatter_max_bytes;
    MODELAVG_ASSIGN_OR_RETURN(
        std::unique_ptr<GlooCommunicator> gloo,
        GlooCommunicator::Create(store, std::move(dev), setup.MemberIndex(), setup.MemberCount(),
                                 setup.timeout, [&store] { return store.last_error(); },
                                 setup.gloo_in_place, setup.cancel, algorithms));
    gloo->SetNewGenerationRequest(setup.request_new_generation);
    return gloo;
  }
#if MODELAVG_HAVE_CUDA
  MODELAVG_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> nccl,
                            NcclCommunicator::Create(setup, device.index));
  return nccl;
#else
  return absl::UnimplementedError(
      "CUDA tensors need a modelavg built with CUDA and NCCL (-DMODELAVG_WITH_CUDA=ON); this "
      "build has only the Gloo (host) path");
#endif
}

}  // namespace modelavg::client
