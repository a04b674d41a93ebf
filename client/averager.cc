#include "client/averager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/communicator_cache.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// All host, or all CUDA on one device. INVALID_ARGUMENT naming the first odd tensor otherwise.
absl::StatusOr<Device> CommonDevice(absl::Span<const TensorView> params) {
  if (params.empty()) return Device::Host();
  const Device first = params[0].device;
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorView& t = params[i];
    if (t.device != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " is on ", t.device.ToString(), " but tensor 0 is on ", first.ToString(),
          ": every parameter of one AverageParameters call must be on the same device"));
    }
    if (absl::Status s = ValidateTensorView(i, t); !s.ok()) return s;
  }
  return first;
}

}  // namespace

ModelAverager::ModelAverager(Client* client) : client_(client) {
  // A replacement starts at its admission step (the first call receives the parameters).
  if (client_->admission_step() > 0) step_ = client_->admission_step();
}
ModelAverager::~ModelAverager() = default;

int64_t ModelAverager::step() const {
  absl::MutexLock l(&mu_);
  return step_;
}

void ModelAverager::set_step(int64_t step) {
  if (step < 0) {
    spdlog::warn("set_step({}): steps count from 0; restoring step 0 instead", step);
    step = 0;
  }
  absl::MutexLock l(&mu_);
  step_ = step;
  client_->ReportStep(step_);
}

absl::StatusOr<Decision> ModelAverager::AverageParameters(absl::Span<const TensorView> params) {
  absl::MutexLock l(&mu_);
  const int64_t step = step_;
  // Decide, then increment — whatever happens next, like PyTorch.
  ++step_;
  absl::StatusOr<Decision> decision = client_->DecisionAt(step);
  client_->ReportStep(step_);
  if (!decision.ok()) return decision.status();
  MODELAVG_ASSIGN_OR_RETURN(Device device, CommonDevice(params));
  if (!decision->average) return *decision;

  const std::string where = absl::StrCat("averaging at step ", step, " (level ", decision->level,
                                         ", subgroup ", decision->subgroup.index, ")");
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision->subgroup), where));
  CommunicatorSetup setup;
  setup.coordinator = client_->coordinator();
  setup.job_id = client_->job_id();
  setup.generation = client_->generation();
  setup.level = decision->level;
  setup.subgroup = decision->subgroup;
  setup.rank = client_->rank();
  setup.credential = client_->credential();
  setup.timeout = client_->options().collective_timeout;
  setup.gloo_in_place = client_->options().gloo_in_place;
  const SubgroupRange group = decision->subgroup;
  Client* client = client_;
  setup.check_alive = [client, group] { return client->CheckCanAverage(group); };

  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(setup, device);
  absl::Status s = comm.ok() ? (*comm)->AllReduceAverage(params) : comm.status();
  if (s.ok()) return *decision;
  if (s.code() == absl::StatusCode::kInvalidArgument) return Annotate(s, where);
  // A transport failure usually means a peer died: give the coordinator up to a heartbeat
  // timeout to say so, so the error names the cause rather than a broken socket.
  const absl::Time until = absl::Now() + client_->heartbeat_timeout() +
                           2 * client_->options().heartbeat_interval + absl::Milliseconds(500);
  while (absl::Now() < until) {
    absl::Status why = client_->CheckCanAverage(group);
    if (!why.ok() && why.message() == s.message()) return Annotate(why, where);  // aborted
    if (!why.ok()) {
      return absl::Status(why.code(), absl::StrCat(where, " failed: ", why.message(),
                                                   " (transport error: ", s.message(), ")"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return Annotate(s, where);
}

absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> PeriodicModelAverager::Create(
    Client* client) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kPeriodic) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is HIERARCHICAL: use HierarchicalModelAverager (or create the job with mode "
        "PERIODIC)"));
  }
  return std::unique_ptr<PeriodicModelAverager>(new PeriodicModelAverager(client));
}

absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> HierarchicalModelAverager::Create(
    Client* client) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kHierarchical) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is PERIODIC: use PeriodicModelAverager (or create the job with mode HIERARCHICAL)"));
  }
  return std::unique_ptr<HierarchicalModelAverager>(new HierarchicalModelAverager(client));
}

}  // namespace modelavg::client
