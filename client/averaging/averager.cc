#include "modelavg/client/averager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/averaging/device_outer_state.h"
#include "client/averaging/fragments.h"
#include "client/averaging/outer_state.h"
#include "client/averaging/pending_sync.h"
#include "client/base/error_kind.h"
#include "client/comm/communicator_cache.h"
#include "client/comm/nccl/nccl_core.h"
#include "client/rpc/coordinator_client.h"
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

ModelAverager::ModelAverager(Client* client, AveragerOptions options)
    : client_(client), options_(options) {
  // A replacement starts at its admission step (the first call receives the parameters).
  if (client_->admission_step() > 0) step_ = client_->admission_step();
  const std::vector<ScheduleLevel>& levels = client_->schedule().spec().levels;
  for (size_t i = 0; i < levels.size(); ++i) {
    outer_.push_back(levels[i].outer.has_value() ? std::make_unique<OuterLevelState>(
                                                       static_cast<int>(i), *levels[i].outer)
                                                 : nullptr);
  }
}
ModelAverager::~ModelAverager() {
  absl::MutexLock l(&mu_);
  AbandonPending();
  // The device states go before the operations they were allocated with.
  outer_.clear();
  if (device_gradient_ != nullptr && device_ops_ != nullptr) {
    device_gradient_->Release(*device_ops_);
  }
}

bool ModelAverager::NeedsParametersAt(int64_t step) const {
  absl::MutexLock l(&mu_);
  for (const auto& p : pending_) {
    if (p->apply_step <= step) return true;
  }
  return false;
}

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
  absl::StatusOr<Decision> result = AverageStep(params);
  // A failed round (not a call refused for its arguments) makes this worker's eventual Leave a
  // failure, which the coordinator counts as a death rather than an orderly departure.
  if (!result.ok() && (!absl::IsInvalidArgument(result.status()) ||
                       ErrorKindOf(result.status()) == ErrorKind::kLayoutMismatch)) {
    client_->RecordFailure(result.status());
  }
  return result;
}

absl::StatusOr<Decision> ModelAverager::AverageStep(absl::Span<const TensorView> params) {
  const int64_t step = step_;
  // Decide, then increment — whatever happens next, like PyTorch.
  ++step_;
  if (client_->elastic()) {
    // Into the generation the job moved to (a shrink, an admission), if any, before deciding.
    absl::Status usable = EnterNewerGeneration();
    if (!usable.ok()) {
      client_->ReportStep(step_);
      return Annotate(usable, absl::StrCat("averaging at step ", step));
    }
  }
  absl::StatusOr<Decision> decision = client_->DecisionAt(step);
  client_->ReportStep(step_);
  if (!decision.ok()) return decision.status();
  MODELAVG_ASSIGN_OR_RETURN(Device device, CommonDevice(params));
  round_params_ = params;
  // A fragment's background all-reduce due at this step is applied first (streaming sync).
  if (!pending_.empty()) MODELAVG_RETURN_IF_ERROR(ApplyPending(step, params));
  if (!decision->average) return *decision;
  // Streaming sync (docs/streaming.md): a fragmented level averages one fragment of the
  // parameters, split the same way on every member (the split's signature joins the layout
  // agreement). An admission to a plain level hands the replacement every fragment.
  const std::vector<ScheduleLevel>& levels = client_->schedule().spec().levels;
  const ScheduleLevel* spec_level = decision->level >= 0 &&
                                            decision->level < static_cast<int>(levels.size())
                                        ? &levels[decision->level]
                                        : nullptr;
  absl::Span<const TensorView> fragment = params;
  round_signature_ = 0;
  round_payload_ = Payload::kFp32;
  if (decision->fragments > 1 && (decision->joining.empty() || spec_level == nullptr ||
                                  spec_level->outer.has_value())) {
    const FragmentSplit split = SplitIntoFragments(params, decision->fragments);
    fragment = split.Fragment(params, decision->fragment);
    round_signature_ = split.signature;
  }
  const bool streaming = spec_level != nullptr && spec_level->outer.has_value() &&
                         (spec_level->fragments > 1 || spec_level->mix != 0 ||
                          spec_level->payload != Payload::kFp32 || spec_level->sync_delay != 0);
  if (streaming) return StreamingOuterRound(*decision, device, fragment);
  // The job's spec (as the coordinator sent it at join) says which levels are outer levels.
  if (decision->level >= 0 && decision->level < static_cast<int>(outer_.size()) &&
      outer_[decision->level] != nullptr) {
    return OuterRound(*decision, device, params);
  }
  return Round(*decision, device, fragment);
}

std::vector<ModelAverager::LevelTraffic> ModelAverager::traffic() const {
  absl::MutexLock l(&mu_);
  std::vector<LevelTraffic> out = traffic_;
  out.resize(client_->schedule().spec().levels.size());
  return out;
}

absl::StatusOr<Decision> ModelAverager::Round(const Decision& decision_in, const Device& device,
                                              absl::Span<const TensorView> params) {
  if (client_->elastic()) return AverageElastic(decision_in, device, params);
  const Decision* decision = &decision_in;
  const int64_t step = decision->step;
  const std::string where = absl::StrCat("averaging at step ", step, " (level ", decision->level,
                                         ", subgroup ", decision->subgroup.index, ")");
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision->subgroup), where));
  CommunicatorSetup setup = Setup(*decision);
  const SubgroupRange group = decision->subgroup;
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(setup, device);
  RoundOptions plain;
  plain.payload = round_payload_;
  plain.layout_signature = round_signature_;
  const int64_t sent_before = comm.ok() ? (*comm)->bytes_sent() : 0;
  absl::Status s = comm.ok() ? (*comm)->AllReduceAverage(params, plain, nullptr) : comm.status();
  if (comm.ok()) CountBytes(decision->level, (*comm)->bytes_sent() - sent_before);
  if (s.ok()) return *decision;
  if (s.code() == absl::StatusCode::kInvalidArgument) return Annotate(s, where);
  ReportUnreachablePeersOf(*decision, comm.ok() ? *comm : nullptr, s);
  // A transport failure usually means a peer died: give the coordinator up to a heartbeat
  // timeout to say so, so the error names the cause rather than a broken socket.
  const absl::Time until = absl::Now() + client_->heartbeat_timeout() +
                           2 * client_->options().heartbeat_interval + absl::Milliseconds(500);
  while (absl::Now() < until) {
    absl::Status why = client_->CheckCanAverage(group);
    // The collective was aborted for the reason the client gives: say it once.
    if (!why.ok() && ErrorKindOf(s) == ErrorKind::kGenerationMoved) return Annotate(why, where);
    if (!why.ok()) {
      return Restate(why, absl::StrCat(where, " failed: ", why.message(),
                                       " (transport error: ", s.message(), ")"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return Annotate(s, where);
}

AveragerState ModelAverager::state_dict() const {
  absl::MutexLock l(&mu_);
  AveragerState out;
  out.step = step_;
  for (const auto& state : outer_) {
    if (state == nullptr || !state->has_anchor()) continue;
    out.anchors[state->level()] = state->AnchorTensors();
    if (state->has_momentum()) out.momenta[state->level()] = state->MomentumTensors();
  }
  StreamingStateInto(&out);
  return out;
}

absl::Status ModelAverager::load_state_dict(const AveragerState& state) {
  const int levels = static_cast<int>(client_->schedule().spec().levels.size());
  auto check_level = [&](int level, const char* what) -> absl::Status {
    if (level < 0 || level >= levels) {
      return absl::InvalidArgumentError(absl::StrCat(what, " has level ", level, "; the job has ",
                                                     levels, " levels"));
    }
    if (!client_->schedule().spec().levels[level].outer.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has level ", level, ", which has no outer optimizer in job ",
          client_->job_id(), ": was the state_dict saved from another job's averager?"));
    }
    if (StreamingOuterLevel(client_->schedule().spec().levels[level])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has level ", level, ", a streaming level of job ", client_->job_id(),
          ", whose state is per fragment (AveragerState::fragments)"));
    }
    return absl::OkStatus();
  };
  for (const auto& [level, tensors] : state.anchors) {
    MODELAVG_RETURN_IF_ERROR(check_level(level, "anchors"));
  }
  for (const auto& [level, tensors] : state.momenta) {
    MODELAVG_RETURN_IF_ERROR(check_level(level, "momenta"));
    if (state.anchors.count(level) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("momenta has level ", level, " but anchors does not"));
    }
  }
  // Built apart, swapped in at the end: nothing changes on an error.
  std::vector<std::unique_ptr<OuterLevelState>> loaded;
  const std::vector<ScheduleLevel>& spec_levels = client_->schedule().spec().levels;
  for (int i = 0; i < levels; ++i) {
    if (!spec_levels[i].outer.has_value()) {
      loaded.push_back(nullptr);
      continue;
    }
    auto s = std::make_unique<OuterLevelState>(i, *spec_levels[i].outer);
    auto a = state.anchors.find(i);
    if (a != state.anchors.end()) {
      auto m = state.momenta.find(i);
      MODELAVG_RETURN_IF_ERROR(
          s->Load(a->second, m == state.momenta.end() ? nullptr : &m->second));
    }
    loaded.push_back(std::move(s));
  }
  std::vector<std::vector<std::unique_ptr<OuterLevelState>>> fragments;
  std::vector<std::unique_ptr<PendingSync>> pending;
  MODELAVG_RETURN_IF_ERROR(LoadStreamingState(state, &fragments, &pending));
  set_step(state.step);
  absl::MutexLock l(&mu_);
  AbandonPending();
  outer_ = std::move(loaded);
  fragment_outer_ = std::move(fragments);
  pending_ = std::move(pending);
  return absl::OkStatus();
}

CommunicatorSetup ModelAverager::Setup(const Decision& decision) const {
  CommunicatorSetup setup;
  setup.coordinator = client_->coordinator();
  setup.job_id = client_->job_id();
  setup.generation = decision.generation > 0 ? decision.generation : client_->generation();
  setup.level = decision.level;
  setup.subgroup = decision.subgroup;
  setup.members = decision.members;
  setup.rank = client_->rank();
  setup.credential = client_->credential();
  setup.timeout = client_->options().collective_timeout;
  // A committed round needs its backup (ClientOptions::gloo_in_place is for strict jobs).
  setup.gloo_in_place = client_->options().gloo_in_place && !client_->elastic();
  Client* client = client_;
  const SubgroupRange group = decision.subgroup;
  setup.check_alive = [client, group] { return client->CheckCanAverage(group); };
  setup.request_new_generation = [client](const absl::Status& why) { client->FailOut(why); };
  return setup;
}

// After a failed round: probes the round's peers over the data network and, when some do not
// answer, reports them to the coordinator (a gray failure: they still beat to it, so only their
// peers can tell). The coordinator evicts nobody on one report alone (docs/cluster.md, "Gray
// failures"); when the reports agree it declares the unreachable dead and the job moves on,
// which the caller's wait for a newer generation then sees.
void ModelAverager::ReportUnreachablePeersOf(const Decision& decision, Communicator* comm,
                                             const absl::Status& failure) const {
  const int64_t generation =
      decision.generation > 0 ? decision.generation : client_->generation();
  if (comm == nullptr || ErrorKindOf(failure) == ErrorKind::kGenerationMoved ||
      client_->latest_generation() != generation) {
    return;  // aborted for a generation change: nothing to report
  }
  // A quarter of the collective timeout, at most 1 s: a host answers a connect in a round trip.
  const absl::Duration timeout = std::clamp(client_->options().collective_timeout / 4,
                                            absl::Milliseconds(100), absl::Seconds(1));
  absl::StatusOr<std::vector<PeerReach>> reach = comm->ProbePeers(timeout);
  if (!reach.ok()) {
    spdlog::debug("not probing the peers of the failed round: {}", reach.status().ToString());
    return;
  }
  const std::vector<int32_t> members = decision.Members();
  v1::ReportPeerFailureRequest req;
  std::vector<std::string> notes;
  for (const PeerReach& p : *reach) {
    if (p.member < 0 || p.member >= static_cast<int>(members.size())) continue;
    const int32_t rank = members[p.member];
    if (p.reachable) {
      req.add_reachable_ranks(rank);
    } else {
      req.add_unreachable_ranks(rank);
      notes.push_back(absl::StrCat("rank ", rank, ": ", p.detail));
    }
  }
  if (req.unreachable_ranks().empty()) return;  // every host answers: not a gray failure
  req.set_job_id(client_->job_id());
  req.set_rank(client_->rank());
  req.set_generation(generation);
  req.set_credential(client_->credential());
  req.set_step(decision.step);
  req.set_level(decision.level);
  req.set_reason(std::string(failure.message().substr(0, 256)));
  spdlog::warn("averaging at step {} (level {}) failed and peers do not answer on the data "
               "network ({}); reporting them to the coordinator",
               decision.step, decision.level, absl::StrJoin(notes, "; "));
  absl::StatusOr<v1::ReportPeerFailureResponse> reply =
      client_->coordinator()->ReportPeerFailure(req);
  if (!reply.ok()) {
    spdlog::warn("the coordinator took no peer failure report{}: {}",
                 absl::IsUnimplemented(reply.status()) ? " (it predates them)" : "",
                 reply.status().ToString());
  } else if (!reply->declared_dead().empty()) {
    spdlog::warn("the coordinator confirmed the report: ranks {} declared dead, generation {}",
                 absl::StrJoin(reply->declared_dead(), ","), reply->generation());
  }
}

absl::Status ModelAverager::EnterNewerGeneration() {
  return client_->AdvanceGeneration([this](int64_t generation) {
    mu_.AssertHeld();  // called back inside this averager's call
    EndBackgroundRoundsBefore(generation);
  });
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
