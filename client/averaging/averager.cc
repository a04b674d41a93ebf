// ModelAverager: decides each call's step and hands it to the part that averages it — the round
// of a plain level (RoundRunner), an outer level (OuterLevel) or a streaming level
// (StreamingLevel) — and checkpoints through Checkpoint. The parts keep their own state; this
// file wires them (an admission round's hand-over, the end of background rounds before a new
// generation's round note) and keeps the step.
#include "modelavg/client/averager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/averaging/checkpoint.h"
#include "client/averaging/fragments.h"
#include "client/averaging/outer_level.h"
#include "client/averaging/round_runner.h"
#include "client/averaging/round_weights.h"
#include "client/averaging/streaming_level.h"
#include "client/base/error_kind.h"
#include "client/session/pace_tracker.h"
#if MODELAVG_HAVE_CUDA
#include "client/outer/cuda/cuda_outer_device.h"
#endif
#include "client/outer/outer_device.h"
#include "client/outer/outer_state.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// The device the outer states of CUDA parameters run on: the CUDA device's operations and the
// outer optimizer's kernels, or none in a build without CUDA.
LocalDeviceFactory LocalDevices() {
#if MODELAVG_HAVE_CUDA
  return OpenCudaOuterDevice;
#else
  return nullptr;
#endif
}

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

// The parts, in the order they are built (and freed in reverse: the levels' states before the
// device they were allocated on). Used under ModelAverager::mu_ only.
class ModelAverager::Parts {
 public:
  Parts(Client* client, const AveragerOptions& options)
      : client_(client),
        device_(client->options().collective_timeout,
                options.backup_device == AveragerOptions::BackupDevice::kHost,
                LocalDevices()),
        rounds_(client, &traffic_, &device_,
                RoundRunner::Hooks{
                    [this](const Decision& decision, Communicator* comm,
                           absl::Span<const TensorView> layout) {
                      return HandOver(decision, comm, layout);
                    },
                    [this](int64_t generation) {
                      streaming_.EndBackgroundRoundsBefore(generation);
                    }}),
        outer_(client, &device_, &pseudo_gradient_, &rounds_),
        streaming_(client, &device_, &pseudo_gradient_, &rounds_, &traffic_),
        checkpoint_(client) {
    // A replacement starts at its admission step (the first call receives the parameters).
    if (client_->admission_step() > 0) step_ = client_->admission_step();
    plan_ = client_->plans().VersionAt(step_);
  }

  int64_t step() const { return step_; }
  void set_step(int64_t step) {
    step_ = step;
    client_->ReportStep(step_);
    SwitchTo(client_->plans().VersionAt(step_));
  }
  bool NeedsParametersAt(int64_t step) const { return streaming_.DueBy(step); }
  std::vector<LevelTraffic> traffic() const {
    return traffic_.PerLevel(client_->plans().Plan(plan_).spec().levels.size());
  }
  AveragerState Save() {
    // The states saved are those of the plan in force at the saved step (which Load reads them
    // with): a switch known already is made now.
    SwitchTo(client_->plans().VersionAt(step_));
    return checkpoint_.Save(step_, outer_, streaming_);
  }

  absl::Status Load(const AveragerState& state) {
    MODELAVG_ASSIGN_OR_RETURN(Checkpoint::Restored restored, checkpoint_.Restore(state));
    step_ = state.step;
    client_->ReportStep(step_);
    // The states are of the plan in force at the saved step.
    plan_ = client_->plans().VersionAt(step_);
    outer_.Replace(std::move(restored.outer));
    streaming_.Replace(std::move(restored.fragments), std::move(restored.pending));
    return absl::OkStatus();
  }

  // AverageParameters' step: decides, then increments — whatever happens next, like PyTorch.
  absl::StatusOr<Decision> Average(absl::Span<const TensorView> params) {
    const int64_t step = step_;
    ++step_;
    if (client_->elastic()) {
      // Into the generation the job moved to (a shrink, an admission), if any, before deciding.
      absl::Status usable = rounds_.EnterNewerGeneration();
      if (!usable.ok()) {
        client_->ReportStep(step_);
        return Annotate(usable, absl::StrCat("averaging at step ", step));
      }
    }
    absl::StatusOr<Decision> decision = client_->DecisionAt(step);
    client_->ReportStep(step_);
    if (!decision.ok()) return decision.status();
    // A plan update switches here (docs/plan-updates.md): the levels' states follow it first.
    SwitchTo(decision->plan);
    MODELAVG_ASSIGN_OR_RETURN(Device device, CommonDevice(params));
    call_params_ = params;
    // A fragment's background all-reduce due at this step is applied first (streaming sync).
    if (streaming_.DueBy(step)) {
      MODELAVG_RETURN_IF_ERROR(streaming_.ApplyDue(step, params, step_));
    }
    if (!decision->average) return *decision;
    // Streaming sync (docs/streaming.md): a fragmented level averages one fragment of the
    // parameters, split the same way on every member (the split's signature joins the layout
    // agreement). An admission to a plain level hands the replacement every fragment.
    const ScheduleLevel* level = LevelOf(*decision);
    absl::Span<const TensorView> fragment = params;
    RoundWire wire;
    if (decision->fragments > 1 &&
        (decision->joining.empty() || level == nullptr || level->outer.has_value())) {
      const FragmentSplit split = SplitIntoFragments(params, decision->fragments);
      fragment = split.Fragment(params, decision->fragment);
      wire.layout_signature = split.signature;
      wire.contents =
          absl::StrCat("fragment ", decision->fragment + 1, " of ", decision->fragments);
    }
    if (level != nullptr && StreamingOuterLevel(*level)) {
      return streaming_.Round(*decision, device, fragment, wire.layout_signature);
    }
    // The job's spec (as the coordinator sent it at join) says which levels are outer levels.
    if (outer_.Has(decision->level)) return outer_.Round(*decision, device, params, wire);
    return rounds_.Run(*decision, device, fragment, wire);
  }

 private:
  const ScheduleLevel* LevelOf(const Decision& decision) const {
    const std::vector<ScheduleLevel>& levels =
        client_->plans().Plan(decision.plan).spec().levels;
    return decision.level >= 0 && decision.level < static_cast<int>(levels.size())
               ? &levels[decision.level]
               : nullptr;
  }

  // An admission round: the replacements receive every outer state, and, at a streaming
  // level's step, the mean of their block's parameters. The states cover the call's parameters,
  // or `layout` (the round's tensors, in the state layout already) when the call passed none.
  absl::Status HandOver(const Decision& decision, Communicator* comm,
                        absl::Span<const TensorView> layout) {
    const absl::Span<const TensorView> all = call_params_.empty() ? layout : call_params_;
    MODELAVG_RETURN_IF_ERROR(outer_.HandOver(decision, comm, all, layout, streaming_.states()));
    const ScheduleLevel* level = LevelOf(decision);
    if (level != nullptr && StreamingOuterLevel(*level) && !call_params_.empty()) {
      MODELAVG_RETURN_IF_ERROR(streaming_.HandParameters(decision, comm, call_params_));
    }
    return absl::OkStatus();
  }

  // Moves the outer states from plan_ to `version`, one update at a time, by the carry rule
  // (plan_history.h): a kept level keeps its anchors, momenta and (same payload) residuals and
  // takes the new optimizer; a fresh one starts without an anchor (its first averaging step from
  // the switch sets it). Back to an earlier plan (set_step to a step before a switch): fresh
  // states of that plan. No background round is in flight across a switch step (the
  // coordinator chooses it so).
  void SwitchTo(int version) {
    if (version == plan_) return;
    const PlanHistory& plans = client_->plans();
    if (version < plan_) {
      spdlog::info("averager of rank {}: back to plan version {} (step {}): its outer states "
                   "start afresh",
                   client_->rank(), version, step_);
      outer_.Replace(OuterLevel::FreshStates(plans.Plan(version)));
      streaming_.Replace(FragmentStates{}, {});
      plan_ = version;
      return;
    }
    for (int w = plan_ + 1; w <= version; ++w) SwitchOne(plans, w);
    plan_ = version;
  }

  void SwitchOne(const PlanHistory& plans, int w) {
    const std::vector<ScheduleLevel>& prev = plans.Plan(w - 1).spec().levels;
    const std::vector<ScheduleLevel>& next = plans.Plan(w).spec().levels;
    std::vector<std::unique_ptr<OuterLevelState>> whole = outer_.TakeStates();
    FragmentStates& fragments = streaming_.states();
    std::vector<std::unique_ptr<OuterLevelState>> whole_next(next.size());
    FragmentStates fragments_next(next.size());
    std::vector<std::string> kept, fresh;
    for (size_t l = 0; l < next.size(); ++l) {
      if (!next[l].outer.has_value()) continue;
      const bool streaming_next = StreamingOuterLevel(next[l]);
      // A streaming level's whole-level state is only its marker (Has); its anchors are per
      // fragment.
      if (streaming_next) {
        whole_next[l] = std::make_unique<OuterLevelState>(static_cast<int>(l), *next[l].outer);
      }
      std::vector<std::unique_ptr<OuterLevelState>> old;
      if (l < prev.size() && prev[l].outer.has_value()) {
        if (StreamingOuterLevel(prev[l])) {
          if (l < fragments.size()) old = std::move(fragments[l]);
        } else if (l < whole.size() && whole[l] != nullptr) {
          old.push_back(std::move(whole[l]));
        }
      }
      if (plans.CarryAt(w, static_cast<int>(l)) != LevelCarry::kKeepOuter || old.empty()) {
        if (!streaming_next) {
          whole_next[l] = std::make_unique<OuterLevelState>(static_cast<int>(l), *next[l].outer);
        }
        fresh.push_back(std::to_string(l));
        continue;  // a streaming level's fragments are made at their first sync
      }
      for (auto& state : old) {
        state->set_rule(*next[l].outer);
        if (!ResidualCarries(prev[l], next[l])) state->ClearResidual();
      }
      // Same fragment count: a level that keeps its state and moves between the whole-level
      // and the per-fragment path has one fragment.
      if (streaming_next) {
        fragments_next[l] = std::move(old);
      } else {
        whole_next[l] = std::move(old[0]);
      }
      kept.push_back(std::to_string(l));
    }
    outer_.Replace(std::move(whole_next));
    fragments = std::move(fragments_next);
    spdlog::info("averager of rank {}: plan version {} from step {}: outer levels kept [{}], "
                 "starting afresh [{}]",
                 client_->rank(), w, plans.SwitchStep(w), absl::StrJoin(kept, ","),
                 absl::StrJoin(fresh, ","));
  }

  Client* const client_;
  int64_t step_ = 0;
  // The plan the levels' states are of (Decision::plan).
  int plan_ = 0;
  Traffic traffic_;
  OuterDevice device_;
  // The pseudo-gradient of an outer step on host parameters (one step runs at a time).
  OuterBuffer pseudo_gradient_;
  RoundRunner rounds_;
  OuterLevel outer_;
  StreamingLevel streaming_;
  Checkpoint checkpoint_;
  // The parameters of the AverageParameters call in progress (valid during the call only).
  absl::Span<const TensorView> call_params_;
};

ModelAverager::ModelAverager(Client* client, AveragerOptions options)
    : client_(client), options_(options), parts_(std::make_unique<Parts>(client, options)) {}

ModelAverager::~ModelAverager() {
  absl::MutexLock l(&mu_);
  // The parts go in reverse order: the background all-reduces are abandoned first, the
  // device last.
  parts_.reset();
}

bool ModelAverager::NeedsParametersAt(int64_t step) const {
  absl::MutexLock l(&mu_);
  return parts_->NeedsParametersAt(step);
}

int64_t ModelAverager::step() const {
  absl::MutexLock l(&mu_);
  return parts_->step();
}

void ModelAverager::set_step(int64_t step) {
  if (step < 0) {
    spdlog::warn("set_step({}): steps count from 0; restoring step 0 instead", step);
    step = 0;
  }
  // The time until the next call is a restore, not a step's compute.
  client_->pace()->Reset();
  absl::MutexLock l(&mu_);
  parts_->set_step(step);
  budget_spent_ = false;
}

bool ModelAverager::budget_spent() const {
  absl::MutexLock l(&mu_);
  return budget_spent_;
}

absl::StatusOr<Decision> ModelAverager::AverageParameters(absl::Span<const TensorView> params) {
  // The time between two calls is this member's compute (its pace, reported on every beat);
  // the time inside them, waiting at rounds, is not.
  client_->pace()->CallStarted();
  absl::StatusOr<Decision> result = Average(params);
  client_->pace()->CallEnded(result.ok() && result->average && result->round >= 0);
  return result;
}

absl::StatusOr<Decision> ModelAverager::Average(absl::Span<const TensorView> params) {
  absl::MutexLock l(&mu_);
  absl::StatusOr<Decision> result = parts_->Average(params);
  if (result.ok() &&
      CompletesPacedBudget(client_->plans().Plan(result->plan).spec().levels, *result)) {
    budget_spent_ = true;
  }
  // A failed round (not a call refused for its arguments) makes this worker's eventual Leave a
  // failure, which the coordinator counts as a death rather than an orderly departure.
  if (!result.ok() && (!absl::IsInvalidArgument(result.status()) ||
                       ErrorKindOf(result.status()) == ErrorKind::kLayoutMismatch)) {
    client_->RecordFailure(result.status());
  }
  return result;
}

std::vector<ModelAverager::LevelTraffic> ModelAverager::traffic() const {
  absl::MutexLock l(&mu_);
  return parts_->traffic();
}

AveragerState ModelAverager::state_dict() const {
  absl::MutexLock l(&mu_);
  return parts_->Save();
}

absl::Status ModelAverager::load_state_dict(const AveragerState& state) {
  absl::MutexLock l(&mu_);
  MODELAVG_RETURN_IF_ERROR(parts_->Load(state));
  client_->pace()->Reset();
  budget_spent_ = false;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> PeriodicModelAverager::Create(
    Client* client, AveragerOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kPeriodic) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is HIERARCHICAL: use HierarchicalModelAverager (or create the job with mode "
        "PERIODIC)"));
  }
  return std::unique_ptr<PeriodicModelAverager>(new PeriodicModelAverager(client, options));
}

absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> HierarchicalModelAverager::Create(
    Client* client, AveragerOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("client is null");
  if (client->schedule().spec().mode != AveragingMode::kHierarchical) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", client->job_id(),
        " is PERIODIC: use PeriodicModelAverager (or create the job with mode HIERARCHICAL)"));
  }
  return std::unique_ptr<HierarchicalModelAverager>(new HierarchicalModelAverager(client, options));
}

}  // namespace modelavg::client
