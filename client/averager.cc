#include "client/averager.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/communicator_cache.h"
#include "client/coordinator_client.h"
#include "client/error_kind.h"
#include "client/fragments.h"
#include "client/outer_state.h"
#include "client/pending_sync.h"
#include "client/nccl_core.h"
#include "client/nccl_outer.h"
#if MODELAVG_HAVE_CUDA
#include "client/cuda_local_ops.h"
#endif
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

// Runs `round` on a device copy of the host buffer that `views` cover (one allocation of
// `bytes` from views[0]), placed like `like` (device, stream), and copies the result back.
absl::Status TransferThroughDevice(
    NcclDeviceOps* ops, const TensorView& like, std::vector<TensorView>& views, size_t bytes,
    const std::function<absl::Status(absl::Span<const TensorView>)>& round) {
  GrowableBuffer scratch;
  absl::Status s = scratch.Reserve(*ops, bytes);
  char* host = static_cast<char*>(views[0].data);
  std::vector<TensorView> on_device = views;
  for (TensorView& v : on_device) {
    if (v.data != nullptr) v.data = static_cast<char*>(scratch.data()) + (static_cast<char*>(v.data) - host);
    v.device = like.device;
    v.cuda_stream = like.cuda_stream;
  }
  if (s.ok()) s = ops->Copy(scratch.data(), host, bytes, like.cuda_stream);
  if (s.ok()) s = ops->WaitLocal(like.cuda_stream, "copying the outer state to the device");
  if (s.ok()) s = round(on_device);
  if (s.ok()) s = ops->Copy(host, scratch.data(), bytes, like.cuda_stream);
  if (s.ok()) s = ops->WaitLocal(like.cuda_stream, "copying the outer state from the device");
  scratch.Release(*ops);
  return s;
}

// After a failed round: probes the round's peers over the data network and, when some do not
// answer, reports them to the coordinator (a gray failure: they still beat to it, so only their
// peers can tell). The coordinator evicts nobody on one report alone (docs/cluster.md, "Gray
// failures"); when the reports agree it declares the unreachable dead and the job moves on,
// which the caller's wait for a newer generation then sees.
void ReportUnreachablePeers(Client* client, const Decision& decision, Communicator* comm,
                            const absl::Status& failure) {
  const int64_t generation =
      decision.generation > 0 ? decision.generation : client->generation();
  if (comm == nullptr || ErrorKindOf(failure) == ErrorKind::kGenerationMoved ||
      client->latest_generation() != generation) {
    return;  // aborted for a generation change: nothing to report
  }
  // A quarter of the collective timeout, at most 1 s: a host answers a connect in a round trip.
  const absl::Duration timeout = std::clamp(client->options().collective_timeout / 4,
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
  req.set_job_id(client->job_id());
  req.set_rank(client->rank());
  req.set_generation(generation);
  req.set_credential(client->credential());
  req.set_step(decision.step);
  req.set_level(decision.level);
  req.set_reason(std::string(failure.message().substr(0, 256)));
  spdlog::warn("averaging at step {} (level {}) failed and peers do not answer on the data "
               "network ({}); reporting them to the coordinator",
               decision.step, decision.level, absl::StrJoin(notes, "; "));
  absl::StatusOr<v1::ReportPeerFailureResponse> reply =
      client->coordinator()->ReportPeerFailure(req);
  if (!reply.ok()) {
    spdlog::warn("the coordinator took no peer failure report{}: {}",
                 absl::IsUnimplemented(reply.status()) ? " (it predates them)" : "",
                 reply.status().ToString());
  } else if (!reply->declared_dead().empty()) {
    spdlog::warn("the coordinator confirmed the report: ranks {} declared dead, generation {}",
                 absl::StrJoin(reply->declared_dead(), ","), reply->generation());
  }
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
  ReportUnreachablePeers(client_, *decision, comm.ok() ? *comm : nullptr, s);
  // A transport failure usually means a peer died: give the coordinator up to a heartbeat
  // timeout to say so, so the error names the cause rather than a broken socket.
  const absl::Time until = absl::Now() + client_->heartbeat_timeout() +
                           2 * client_->options().heartbeat_interval + absl::Milliseconds(500);
  while (absl::Now() < until) {
    absl::Status why = client_->CheckCanAverage(group);
    // The collective was aborted for the reason the client gives: say it once.
    if (!why.ok() && ErrorKindOf(s) == ErrorKind::kGenerationMoved) return Annotate(why, where);
    if (!why.ok()) {
      return absl::Status(why.code(), absl::StrCat(where, " failed: ", why.message(),
                                                   " (transport error: ", s.message(), ")"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return Annotate(s, where);
}

absl::StatusOr<Decision> ModelAverager::OuterRound(const Decision& decision,
                                                   const Device& device,
                                                   absl::Span<const TensorView> params) {
  const int level = decision.level;
  const std::string where = absl::StrCat("outer step at step ", decision.step, " (level ", level,
                                         ", subgroup ", decision.subgroup.index, ")");
  OuterLevelState* state =
      level >= 0 && level < static_cast<int>(outer_.size()) ? outer_[level].get() : nullptr;
  if (state == nullptr) {
    return absl::InternalError(absl::StrCat(where, ": the coordinator's decision says outer but "
                                            "the job's spec has no outer optimizer at level ",
                                            level));
  }
  const ScheduleLevel& rule = client_->schedule().spec().levels[level];
  if (rule.fragments > 1 || rule.sync_delay > 0 || rule.payload != Payload::kFp32) {
    // Not silently a whole-model fp32 outer step: the streaming fields change the rule.
    return absl::UnimplementedError(absl::StrCat(
        where, ": this client applies an outer level as a whole (fragments 1, sync_delay 0, "
               "payload FP32); level ", level, " asks for streaming sync (docs/streaming.md)"));
  }
  // A replacement at its admission step receives the outer state in the round (see
  // TransferOuterState) and contributes no pseudo-gradient.
  const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                          client_->rank());
  const int64_t first = client_->schedule().FirstStepOf(level);
  const bool first_step = first < 0 || decision.step == first;
  const auto no_anchor = [&] {
    // A later step without an anchor would mix a plain average into the group's outer step.
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": this rank has no outer state for level ", level,
        " (its first averaging step was ", first,
        "): restore the averager with load_state_dict() from a checkpoint's state_dict() "
        "rather than set_step() alone"));
  };
  if (!device.is_host()) {
    // CUDA parameters (nccl_outer.h): the same rule, on the device.
    MODELAVG_ASSIGN_OR_RETURN(DeviceOuterState * on_device, DeviceState(state, device));
    if (!joining && !on_device->has_anchor() && !first_step) return no_anchor();
    Decision done = decision;
    absl::Status s = RunDeviceOuterStep(
        on_device, device_gradient_.get(), params, first_step, joining,
        [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
          // The pseudo-gradient's rounds agree on their own layout (nccl_outer.h).
          const int64_t signature = round_signature_;
          round_signature_ = signature ^ layout_signature;
          absl::StatusOr<Decision> r = Round(decision, device, tensors);
          round_signature_ = signature;
          if (r.ok()) done = *r;
          return r.status();
        });
    if (!s.ok()) return Annotate(s, where);
    return done;
  }
  if (joining && !first_step) {
    if (pseudo_gradient_ == nullptr) pseudo_gradient_ = std::make_unique<OuterBuffer>();
    pseudo_gradient_->Shape(params);
    std::vector<TensorView> d = pseudo_gradient_->Views();
    MODELAVG_ASSIGN_OR_RETURN(Decision done, Round(decision, device, d));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, params), where));
    return done;
  }
  if (!state->has_anchor()) {
    // The level's first averaging step: a plain average; the result is the anchor.
    if (!first_step) return no_anchor();
    MODELAVG_ASSIGN_OR_RETURN(Decision done, Round(decision, device, params));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(params), where));
    return done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, params), where));
  if (pseudo_gradient_ == nullptr) pseudo_gradient_ = std::make_unique<OuterBuffer>();
  pseudo_gradient_->Shape(params);
  std::vector<TensorView> d = pseudo_gradient_->Views();
  MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, params, d), where));
  // The parameters and the state change only once the round has succeeded.
  MODELAVG_ASSIGN_OR_RETURN(Decision done, Round(decision, device, d));
  MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, params), where));
  return done;
}

absl::StatusOr<NcclDeviceOps*> ModelAverager::DeviceOps(const Device& device) {
#if MODELAVG_HAVE_CUDA
  if (device_ops_ == nullptr) {
    device_ops_ = std::make_unique<CudaLocalOps>(device.index,
                                                 client_->options().collective_timeout);
    device_gradient_ = std::make_unique<GrowableBuffer>();
  }
  const int on = static_cast<CudaLocalOps*>(device_ops_.get())->device();
  if (on != device.index) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the parameters are on ", device.ToString(), " but this averager's outer state is on cuda:",
        on, ": keep the model on one device (or make a new averager)"));
  }
  return device_ops_.get();
#else
  return absl::UnimplementedError(absl::StrCat(
      "the parameters are on ", device.ToString(),
      " but this build of modelavg has no CUDA support (configure with -DMODELAVG_WITH_CUDA=ON)"));
#endif
}

absl::StatusOr<DeviceOuterState*> ModelAverager::DeviceState(OuterLevelState* state,
                                                             const Device& device) {
  MODELAVG_ASSIGN_OR_RETURN(NcclDeviceOps * ops, DeviceOps(device));
  if (state->device() == nullptr) {
    MODELAVG_RETURN_IF_ERROR(state->AttachDevice(std::make_unique<DeviceOuterState>(
        ops, state->level(), state->rule(),
        options_.backup_device == AveragerOptions::BackupDevice::kHost)));
  }
  return state->device();
}

absl::Status ModelAverager::TransferOuterState(const Decision& decision, Communicator* comm,
                                               absl::Span<const TensorView> layout) {
  if (decision.joining.empty()) return absl::OkStatus();
  // Every outer state to hand over, with the parameter tensors it covers: a whole outer level
  // all of them, a streaming level's fragment its run of tensors (docs/streaming.md). The
  // parameters of the call (round_params_), or `layout` (the round's tensors, in the state
  // layout already) when the call passed none.
  const absl::Span<const TensorView> all = round_params_.empty() ? layout : round_params_;
  struct Entry {
    OuterLevelState* state;
    size_t first;
    size_t n;
    int fragment;  // -1: the whole level
  };
  std::vector<Entry> entries;
  const std::vector<ScheduleLevel>& spec_levels = client_->schedule().spec().levels;
  for (const auto& state : outer_) {
    if (state == nullptr) continue;
    const ScheduleLevel& l = spec_levels[state->level()];
    if (!StreamingOuterLevel(l)) {
      entries.push_back({state.get(), 0, all.size(), -1});
      continue;
    }
    const int level = state->level();
    if (fragment_outer_.size() <= static_cast<size_t>(level)) fragment_outer_.resize(level + 1);
    std::vector<std::unique_ptr<OuterLevelState>>& states = fragment_outer_[level];
    if (states.empty()) {
      for (int f = 0; f < std::max(1, l.fragments); ++f) {
        states.push_back(std::make_unique<OuterLevelState>(level, *l.outer));
      }
    }
    const FragmentSplit split = SplitIntoFragments(all, std::max(1, l.fragments));
    for (int f = 0; f < static_cast<int>(states.size()); ++f) {
      entries.push_back({states[f].get(), split.begin[f], split.begin[f + 1] - split.begin[f], f});
    }
  }
  if (entries.empty()) return absl::OkStatus();
  const int32_t me = client_->rank();
  const std::vector<int32_t> members = decision.Members();
  auto joining = [&](int32_t r) {
    return std::binary_search(decision.joining.begin(), decision.joining.end(), r);
  };
  OuterBuffer state_layout;
  state_layout.Shape(all);
  auto name = [](const Entry& e) {
    return e.fragment < 0 ? absl::StrCat("level ", e.state->level())
                          : absl::StrCat("level ", e.state->level(), " fragment ", e.fragment);
  };
  // One round per replacement: a header (per entry: anchor set, momentum set), then per entry
  // its anchor and, with momentum, its momentum buffer. Each entry's donor — the lowest
  // contributing member of the replacement's block at that level — writes its part, everyone
  // else zeros, and the divisor is 1: an exact broadcast on the round's communicator.
  for (int32_t j : decision.joining) {
    std::vector<TensorView> shape(1);
    shape[0].numel = static_cast<int64_t>(2 * entries.size());
    shape[0].dtype = DType::kFloat64;
    std::vector<int32_t> donors;
    for (const Entry& e : entries) {
      const int32_t g = spec_levels[e.state->level()].group_size;
      int32_t donor = -1;
      for (int32_t m : members) {
        if (!joining(m) && m / g == j / g) {
          donor = m;
          break;
        }
      }
      donors.push_back(donor);
      const int copies = e.state->rule().momentum != 0 ? 2 : 1;
      for (int c = 0; c < copies; ++c) {
        for (size_t i = e.first; i < e.first + e.n; ++i) {
          TensorView v;
          v.numel = state_layout.numel(i);
          v.dtype = state_layout.dtype(i);
          shape.push_back(v);
        }
      }
    }
    OuterBuffer buffer;
    buffer.Shape(shape);  // zeros
    std::vector<TensorView> views = buffer.Views();
    double* header = static_cast<double*>(views[0].data);
    size_t at = 1;
    for (size_t k = 0; k < entries.size(); ++k) {
      const Entry& e = entries[k];
      OuterLevelState* level = e.state;
      const size_t n = e.n;
      const bool momentum = level->rule().momentum != 0;
      if (donors[k] == me && level->has_anchor()) {
        MODELAVG_RETURN_IF_ERROR(level->CheckLayout(0, absl::MakeConstSpan(views).subspan(at, n)));
        header[2 * k] = 1;
        const std::vector<StateTensor> a = level->AnchorTensors();
        for (size_t i = 0; i < n; ++i) {
          if (!a[i].bytes.empty()) std::memcpy(views[at + i].data, a[i].bytes.data(), a[i].bytes.size());
        }
        if (level->has_momentum()) {
          header[2 * k + 1] = 1;
          const std::vector<StateTensor> m = level->MomentumTensors();
          for (size_t i = 0; i < n; ++i) {
            if (!m[i].bytes.empty()) {
              std::memcpy(views[at + n + i].data, m[i].bytes.data(), m[i].bytes.size());
            }
          }
        }
      }
      at += momentum ? 2 * n : n;
    }
    RoundOptions options;
    options.step = decision.step;
    options.contributors = 1;
    if (!layout.empty() && layout[0].device.is_cuda()) {
      // An NCCL round: the hand-over travels through a device copy of the buffer.
      MODELAVG_ASSIGN_OR_RETURN(NcclDeviceOps * ops, DeviceOps(layout[0].device));
      MODELAVG_RETURN_IF_ERROR(TransferThroughDevice(ops, layout[0], views, buffer.total_bytes(),
                                                     [&](absl::Span<const TensorView> on_device) {
                                                       return comm->AllReduceAverage(
                                                           on_device, options, nullptr);
                                                     }));
    } else {
      MODELAVG_RETURN_IF_ERROR(comm->AllReduceAverage(views, options, nullptr));
    }
    if (j != me) continue;
    at = 1;
    for (size_t k = 0; k < entries.size(); ++k) {
      const Entry& e = entries[k];
      OuterLevelState* level = e.state;
      const size_t n = e.n;
      const bool momentum = level->rule().momentum != 0;
      const size_t width = momentum ? 2 * n : n;
      if (donors[k] < 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", me, " is admitted at step ", decision.step,
            " but no live member of its block at level ", level->level(),
            " takes part in the round to hand it that level's outer state; start the "
            "replacement again"));
      }
      if (header[2 * k] == 1) {
        auto copy = [&](size_t from) {
          std::vector<StateTensor> out(n);
          for (size_t i = 0; i < n; ++i) {
            out[i].dtype = views[from + i].dtype;
            out[i].numel = views[from + i].numel;
            const uint8_t* p = static_cast<const uint8_t*>(views[from + i].data);
            out[i].bytes.assign(p, p + views[from + i].nbytes());
          }
          return out;
        };
        const std::vector<StateTensor> a = copy(at);
        std::vector<StateTensor> m;
        if (header[2 * k + 1] == 1) m = copy(at + n);
        MODELAVG_RETURN_IF_ERROR(level->Load(a, header[2 * k + 1] == 1 ? &m : nullptr));
        spdlog::info("step {}: received the outer state of {} from rank {}", decision.step,
                     name(e), donors[k]);
      } else if (header[2 * k] != 0) {
        return absl::InternalError(absl::StrCat("outer state of ", name(e),
                                                " received from several members at once"));
      }
      at += width;
    }
  }
  // An admission at a streaming level's step syncs one fragment only: the replacement receives
  // the mean of its block's parameters first (the others' parameters do not change).
  if (decision.level >= 0 && decision.level < static_cast<int>(spec_levels.size()) &&
      StreamingOuterLevel(spec_levels[decision.level]) && !round_params_.empty()) {
    MODELAVG_RETURN_IF_ERROR(TransferParameters(decision, comm));
  }
  return absl::OkStatus();
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

absl::Duration ModelAverager::RetryWait() const {
  return 2 * client_->heartbeat_timeout() + 2 * client_->options().heartbeat_interval +
         absl::Seconds(2);
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

namespace {

// A round lost to a failure is retried in the next generation, at most this many times (each
// retry needs the job to have moved on: a death, a departure or an admission).
constexpr int kMaxElasticAttempts = 16;

std::string ElasticWhere(const Decision& d) {
  return absl::StrCat("averaging at step ", d.step, " (level ", d.level, ", subgroup ",
                      d.subgroup.index, ", generation ", d.generation, ")");
}

}  // namespace

// What one attempt of an elastic round left: its failure (OK once committed), how far it got
// on this rank, and its communicator (null when none could be set up).
struct ModelAverager::ElasticAttempt {
  absl::Status status;
  RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
  Communicator* comm = nullptr;
};

absl::StatusOr<Decision> ModelAverager::AverageElastic(Decision decision, const Device& device,
                                                       absl::Span<const TensorView> params,
                                                       bool transfer) {
  for (int attempt = 1;; ++attempt) {
    MODELAVG_ASSIGN_OR_RETURN(ElasticAttempt tried,
                              RunElasticAttempt(decision, device, params, transfer));
    if (tried.status.ok()) return CommitElasticRound(decision, attempt);
    if (tried.status.code() == absl::StatusCode::kInvalidArgument ||
        ErrorKindOf(tried.status) == ErrorKind::kRoundMismatch) {
      return Annotate(tried.status, ElasticWhere(decision));
    }
    ReportUnreachablePeersOf(decision, tried.comm, tried.status);
    MODELAVG_ASSIGN_OR_RETURN(Decision next, MoveOnAfterFailure(decision, tried.status));
    MODELAVG_ASSIGN_OR_RETURN(bool completed, PeerCompletedAttempt(decision, &next, &attempt));
    if (completed) {
      MODELAVG_RETURN_IF_ERROR(AdoptLostCommit(decision, tried, params));
      return decision;
    }
    if (attempt >= kMaxElasticAttempts) {
      return Annotate(tried.status,
                      absl::StrCat(ElasticWhere(decision), " (", attempt, " attempts)"));
    }
    spdlog::warn("{} failed ({}); retrying in generation {} with ranks {}", ElasticWhere(decision),
                 std::string(tried.status.message()), next.generation,
                 absl::StrJoin(next.Members(), ","));
    decision = std::move(next);
  }
}

absl::StatusOr<RoundOptions> ModelAverager::ElasticRoundOptions(const Decision& decision) const {
  const std::vector<int32_t> members = decision.Members();
  if (!std::binary_search(members.begin(), members.end(), client_->rank())) {
    return absl::InternalError(absl::StrCat(ElasticWhere(decision), ": rank ", client_->rank(),
                                            " is not among the round's members"));
  }
  RoundOptions options;
  options.step = decision.step;
  options.contribute =
      !std::binary_search(decision.joining.begin(), decision.joining.end(), client_->rank());
  options.contributors = static_cast<int>(members.size() - decision.joining.size());
  // Every round is committed (retried exactly), on Gloo and NCCL alike.
  options.commit = true;
  options.payload = round_payload_;
  options.layout_signature = round_signature_;
  if (options.contributors == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        ElasticWhere(decision), ": rank ", client_->rank(),
        " is admitted at this step but no live member of its subgroup can give it the "
        "parameters; start the replacement again"));
  }
  return options;
}

absl::StatusOr<ModelAverager::ElasticAttempt> ModelAverager::RunElasticAttempt(
    const Decision& decision, const Device& device, absl::Span<const TensorView> params,
    bool transfer) {
  MODELAVG_ASSIGN_OR_RETURN(RoundOptions options, ElasticRoundOptions(decision));
  ElasticAttempt tried;
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
  if (!comm.ok()) {
    tried.status = comm.status();
    client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
    return tried;
  }
  tried.comm = *comm;
  // An admission hands the replacements the outer state first (their part of this step's
  // round needs it); a failure there is a failure of the round, retried the same way.
  if (transfer) tried.status = TransferOuterState(decision, tried.comm, params);
  const int64_t sent_before = tried.comm->bytes_sent();
  if (tried.status.ok()) {
    tried.status = tried.comm->AllReduceAverage(params, options, &tried.outcome);
  }
  CountBytes(decision.level, tried.comm->bytes_sent() - sent_before);
  client_->RecordRound(decision.level, decision.step, decision.generation, tried.outcome);
  return tried;
}

Decision ModelAverager::CommitElasticRound(const Decision& decision, int attempt) {
  const bool joining =
      std::binary_search(decision.joining.begin(), decision.joining.end(), client_->rank());
  if (attempt > 1 || joining) {
    spdlog::info("{}: averaged with ranks {}{}", ElasticWhere(decision),
                 absl::StrJoin(decision.Members(), ","),
                 joining ? " (admitted: received the parameters)" : "");
  }
  // Older generations' communicators are of no use any more.
  client_->communicators()->DropBefore(decision.generation);
  return decision;
}

void ModelAverager::ReportUnreachablePeersOf(const Decision& decision, Communicator* comm,
                                             const absl::Status& failure) const {
  ReportUnreachablePeers(client_, decision, comm, failure);
}

absl::Status ModelAverager::EnterNewerGeneration() {
  return client_->AdvanceGeneration([this](int64_t generation) {
    mu_.AssertHeld();  // called back inside this averager's call
    EndBackgroundRoundsBefore(generation);
  });
}

absl::StatusOr<Decision> ModelAverager::MoveOn(int64_t generation, int64_t step) {
  // The wait ends as soon as this rank hears of the change; its bound only matters when the
  // job does not move on (a transport failure with every member alive).
  MODELAVG_RETURN_IF_ERROR(client_->AwaitNewerGeneration(generation, absl::Now() + RetryWait()));
  MODELAVG_RETURN_IF_ERROR(EnterNewerGeneration());
  return client_->DecisionAt(step);
}

absl::StatusOr<Decision> ModelAverager::MoveOnAfterFailure(const Decision& failed,
                                                           const absl::Status& why) {
  // Wait for the job to move on without the failed member (its death is declared within the
  // heartbeat timeout). If it does not move on in time, the call fails with the round's error.
  absl::StatusOr<Decision> next = MoveOn(failed.generation, failed.step);
  if (next.ok()) return next;
  if (absl::IsDeadlineExceeded(next.status())) return Annotate(why, ElasticWhere(failed));
  return absl::Status(next.status().code(),
                      absl::StrCat(ElasticWhere(failed), " failed: ", next.status().message(),
                                   " (round: ", why.message(), ")"));
}

absl::StatusOr<bool> ModelAverager::PeerCompletedAttempt(const Decision& failed, Decision* next,
                                                         int* attempt) {
  // If any live member completed the round, every member holds its result (the commit phase).
  absl::StatusOr<bool> completed = client_->PeerCompletedRound(*next, failed.generation);
  // ABORTED: the job moved on while a note was awaited; FAILED_PRECONDITION: before (a stale
  // generation). Either way: read the notes again in the newer generation.
  while (!completed.ok() &&
         (absl::IsAborted(completed.status()) ||
          absl::IsFailedPrecondition(completed.status())) &&
         *attempt < kMaxElasticAttempts) {
    ++*attempt;
    const int64_t read_in = next->generation;
    absl::StatusOr<Decision> again = MoveOn(read_in, failed.step);
    if (!again.ok()) {
      return Annotate(again.status(), absl::StrCat(ElasticWhere(failed),
                                                   " (round notes of generation ", read_in, ")"));
    }
    *next = *std::move(again);
    completed = client_->PeerCompletedRound(*next, failed.generation);
  }
  if (!completed.ok()) return Annotate(completed.status(), ElasticWhere(*next));
  return *completed;
}

absl::Status ModelAverager::AdoptLostCommit(const Decision& decision, const ElasticAttempt& tried,
                                            absl::Span<const TensorView> params) {
  if (tried.outcome != RoundOutcome::kFailedHoldingResult || tried.comm == nullptr) {
    return absl::InternalError(absl::StrCat(
        ElasticWhere(decision), ": a peer completed the round but this rank holds no result (",
        tried.status.message(), "); restore a checkpoint"));
  }
  MODELAVG_RETURN_IF_ERROR(
      Annotate(tried.comm->AdoptPendingResult(params), ElasticWhere(decision)));
  client_->RecordRound(decision.level, decision.step, decision.generation,
                       RoundOutcome::kCompleted);
  spdlog::info("{}: the round completed on a peer before the failure ({}); its result is kept",
               ElasticWhere(decision), std::string(tried.status.message()));
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
