#include "client/averager.h"

namespace modelavg::client {

class CommunicatorCache {};

ModelAverager::ModelAverager(Client* client) : client_(client) {}
ModelAverager::~ModelAverager() = default;

absl::StatusOr<Decision> ModelAverager::AverageParameters(absl::Span<const TensorView>) {
  return absl::UnimplementedError("not implemented yet");
}
int64_t ModelAverager::step() const {
  absl::MutexLock l(&mu_);
  return step_;
}
void ModelAverager::set_step(int64_t step) {
  absl::MutexLock l(&mu_);
  step_ = step;
}

absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> PeriodicModelAverager::Create(Client*) {
  return absl::UnimplementedError("not implemented yet");
}
absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> HierarchicalModelAverager::Create(
    Client*) {
  return absl::UnimplementedError("not implemented yet");
}

}  // namespace modelavg::client
