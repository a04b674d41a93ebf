// Streaming sync on outer levels (docs/streaming.md): the outer step of one fragment at a
// time, each fragment with its own anchor and momentum, the pseudo-gradient sent in the level's
// payload, and the result mixed with the local parameters.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/averaging/fragments.h"
#include "client/averaging/outer_state.h"
#include "client/averaging/pending_sync.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/communicator_cache.h"
#include "common/status_util.h"
#include "modelavg/client/averager.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

double Read(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(t.data)[i];
    case DType::kFloat64:
      return static_cast<const double*>(t.data)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(t.data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(t.data)[i]);
  }
  return 0;
}

void Write(const TensorView& t, int64_t i, double v) {
  switch (t.dtype) {
    case DType::kFloat32:
      static_cast<float*>(t.data)[i] = static_cast<float>(v);
      return;
    case DType::kFloat64:
      static_cast<double*>(t.data)[i] = v;
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(t.data)[i] = FloatToHalf(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(t.data)[i] = FloatToBFloat16(static_cast<float>(v));
      return;
  }
}

// The parameters passed to the call (x_local), kept while the round rewrites them.
class LocalCopy {
 public:
  void Take(absl::Span<const TensorView> params) {
    bytes_.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const uint8_t* p = static_cast<const uint8_t*>(params[i].data);
      bytes_[i].assign(p, p + params[i].nbytes());
    }
  }
  // params := (1 - mix) * params + mix * x_local, element-wise in double.
  void MixInto(absl::Span<const TensorView> params, double mix) const {
    for (size_t i = 0; i < params.size(); ++i) {
      TensorView local = params[i];
      local.data = const_cast<uint8_t*>(bytes_[i].data());
      for (int64_t j = 0; j < params[i].numel; ++j) {
        Write(params[i], j, (1.0 - mix) * Read(params[i], j) + mix * Read(local, j));
      }
    }
  }

 private:
  std::vector<std::vector<uint8_t>> bytes_;
};

// The first step at which `level` syncs `fragment`, or -1 within the search bound.
int64_t FirstSyncOf(const Schedule& schedule, int level, int32_t fragment) {
  const ScheduleLevel& l = schedule.spec().levels[level];
  const int64_t p = l.StepPeriod();
  const int64_t warmup = schedule.spec().warmup_steps;
  int64_t s = schedule.spec().mode == AveragingMode::kPeriodic ? warmup
                                                                : (warmup + p - 1) / p * p;
  for (int64_t n = 0; n < kFirstStepSearch; ++n, s += p) {
    if (schedule.LevelAt(s) == level && schedule.FragmentAt(level, s) == fragment) return s;
  }
  return -1;
}

// The body of a background all-reduce's thread. It owns nothing but the buffer's round: it
// never touches the parameters. `notes`: the client of an elastic job, whose round notes get
// the outcome (null in a strict job).
void RunInBackground(PendingSync* p, const std::vector<TensorView>& views, Client* notes) {
  p->result = p->comm->AllReduceAverage(views, p->options, &p->outcome);
  p->bytes_after = p->comm->bytes_sent();
  if (notes != nullptr) {
    if (p->outcome == RoundOutcome::kFailedHoldingResult) {
      // Kept apart from the inputs, which a re-run would need.
      p->held = std::make_unique<OuterBuffer>();
      p->held->Shape(views);
      absl::Status kept = p->comm->AdoptPendingResult(p->held->Views());
      if (!kept.ok()) {
        spdlog::warn("the result of fragment {}'s sync started at step {} is lost: {}",
                     p->decision.fragment, p->decision.step, kept.ToString());
        p->held.reset();
        p->outcome = RoundOutcome::kFailedWithoutResult;
      }
    }
    // Before `done`: a round note published once this round has ended says how it ended.
    notes->RecordRound(p->decision.level, p->decision.step, p->decision.generation, p->outcome);
  }
  p->done.Notify();
}

}  // namespace

absl::StatusOr<Decision> ModelAverager::StreamingOuterRound(const Decision& decision,
                                                            const Device& device,
                                                            absl::Span<const TensorView> fragment) {
  const int level = decision.level;
  const ScheduleLevel& spec = client_->schedule().spec().levels[level];
  const std::string where =
      absl::StrCat("outer step at step ", decision.step, " (level ", level, ", fragment ",
                   decision.fragment, " of ", decision.fragments, ", subgroup ",
                   decision.subgroup.index, ")");
  if (!device.is_host() && spec.sync_delay != 0 && client_->elastic()) {
    // The elastic settle of a background round (docs/streaming.md, "Elastic jobs") runs on
    // host buffers; the device's background sync has no such path yet.
    return absl::UnimplementedError(absl::StrCat(
        where, ": levels[", level, "].sync_delay ", spec.sync_delay,
        " on CUDA parameters runs in strict jobs only in this version (elastic jobs: host "
        "parameters, or sync_delay 0); the parameters are on ", device.ToString()));
  }
  // A replacement admitted at this step (elastic jobs) receives, inside the round, every outer
  // state and the mean of its block's parameters (TransferOuterState), contributes nothing, and
  // takes the same branch as its peers: the fragment's first sync or an outer step.
  const bool me_joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                             client_->rank());
  if (fragment_outer_.size() <= static_cast<size_t>(level)) fragment_outer_.resize(level + 1);
  std::vector<std::unique_ptr<OuterLevelState>>& states = fragment_outer_[level];
  if (states.empty()) {
    for (int f = 0; f < std::max(1, spec.fragments); ++f) {
      states.push_back(std::make_unique<OuterLevelState>(level, *spec.outer));
    }
  }
  OuterLevelState* state = states[decision.fragment].get();
  if (!device.is_host()) {
    return DeviceStreamingRound(decision, device, fragment, state, me_joining,
                                FirstSyncOf(client_->schedule(), level, decision.fragment));
  }
  LocalCopy local;
  if (spec.mix != 0 && !me_joining) local.Take(fragment);
  if (me_joining) {
    const bool first = FirstSyncOf(client_->schedule(), level, decision.fragment) == decision.step;
    if (spec.sync_delay != 0) return StartPending(decision, device, fragment, state, first);
    if (first) {
      MODELAVG_ASSIGN_OR_RETURN(Decision done, Round(decision, device, fragment));
      MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(fragment), where));
      return done;
    }
    if (pseudo_gradient_ == nullptr) pseudo_gradient_ = std::make_unique<OuterBuffer>();
    pseudo_gradient_->Shape(fragment);
    std::vector<TensorView> d = pseudo_gradient_->Views();
    round_payload_ = spec.payload;
    absl::StatusOr<Decision> done = Round(decision, device, d);
    round_payload_ = Payload::kFp32;
    if (!done.ok()) return done.status();
    // x_local of a replacement: the block's mean it has just received.
    if (spec.mix != 0) local.Take(fragment);
    MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, fragment), where));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, fragment), where));
    if (spec.mix != 0) local.MixInto(fragment, spec.mix);
    return done;
  }
  if (!state->has_anchor()) {
    const int64_t first = FirstSyncOf(client_->schedule(), level, decision.fragment);
    if (first >= 0 && decision.step != first) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": this rank has no outer state for this fragment (its first sync was step ",
          first, "): restore the averager with load_state_dict() from a checkpoint's "
                 "state_dict() rather than set_step() alone"));
    }
    if (spec.sync_delay != 0) return StartPending(decision, device, fragment, state, true);
    // The fragment's first sync: a plain average (FP32), its result the anchor.
    MODELAVG_ASSIGN_OR_RETURN(Decision done, Round(decision, device, fragment));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(fragment), where));
    if (spec.mix != 0) local.MixInto(fragment, spec.mix);
    return done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, fragment), where));
  if (spec.sync_delay != 0) return StartPending(decision, device, fragment, state, false);
  if (pseudo_gradient_ == nullptr) pseudo_gradient_ = std::make_unique<OuterBuffer>();
  pseudo_gradient_->Shape(fragment);
  std::vector<TensorView> d = pseudo_gradient_->Views();
  MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, fragment, d), where));
  // The pseudo-gradient travels in the level's payload; the state and the parameters change
  // only once the round has succeeded.
  round_payload_ = spec.payload;
  absl::StatusOr<Decision> done = Round(decision, device, d);
  round_payload_ = Payload::kFp32;
  if (!done.ok()) return done.status();
  MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, fragment), where));
  if (spec.mix != 0) local.MixInto(fragment, spec.mix);
  return done;
}

std::unique_ptr<PendingSync> ModelAverager::NewPendingSync(const Decision& decision,
                                                          OuterLevelState* state,
                                                          bool first) const {
  auto p = std::make_unique<PendingSync>();
  p->decision = decision;
  p->apply_step =
      decision.step + client_->schedule().spec().levels[decision.level].sync_delay;
  p->first = first;
  p->state = state;
  return p;
}

absl::StatusOr<Decision> ModelAverager::StartPending(const Decision& decision,
                                                     const Device& device,
                                                     absl::Span<const TensorView> fragment,
                                                     OuterLevelState* state, bool first) {
  const ScheduleLevel& spec = client_->schedule().spec().levels[decision.level];
  const std::string where = absl::StrCat(
      "starting the sync of fragment ", decision.fragment, " at step ", decision.step,
      " (level ", decision.level, device.is_host() ? "" : absl::StrCat(", ", device.ToString()),
      ")");
  if (!device.is_host()) {
    return StartDevicePending(decision, device, fragment, state, first, spec, where);
  }
  std::unique_ptr<PendingSync> p = NewPendingSync(decision, state, first);
  p->buffer = std::make_unique<OuterBuffer>();
  p->buffer->Shape(fragment);
  std::vector<TensorView> views = p->buffer->Views();
  const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                          client_->rank());
  if (joining) {
    // A replacement contributes nothing (it receives the outer state in the round).
  } else if (first) {
    for (size_t i = 0; i < fragment.size(); ++i) {
      for (int64_t j = 0; j < fragment[i].numel; ++j) Write(views[i], j, Read(fragment[i], j));
    }
  } else {
    MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, fragment, views), where));
  }
  const Payload payload = first ? Payload::kFp32 : spec.payload;
  if (client_->elastic() && !decision.joining.empty()) {
    // An admission at a delayed sync step: the replacement needs its parameters now, so the
    // round runs in this call, handing it the outer state and the parameters first, like any
    // admission round; its result is applied at the apply step like any other.
    round_payload_ = payload;
    absl::StatusOr<Decision> done = AverageElastic(decision, device, views);
    round_payload_ = Payload::kFp32;
    if (!done.ok()) return done.status();
    p->result = absl::OkStatus();
    p->outcome = RoundOutcome::kCompleted;
    p->done.Notify();
    pending_.push_back(std::move(p));
    return *done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision.subgroup), where));
  absl::StatusOr<Communicator*> comm = client_->communicators()->Get(Setup(decision), device);
  if (!comm.ok()) return Annotate(comm.status(), where);
  p->comm = *comm;
  if (client_->elastic()) {
    // Committed at the sync step like a blocking round, so that the call at the apply step
    // can settle a failure exactly (SettleBackgroundRound).
    MODELAVG_ASSIGN_OR_RETURN(p->options, ElasticRoundOptions(decision));
  }
  p->options.payload = payload;
  p->options.layout_signature = round_signature_;
  p->bytes_before = p->comm->bytes_sent();
  PendingSync* raw = p.get();
  Client* client = client_->elastic() ? client_ : nullptr;
  p->thread = std::thread([raw, views, client] { RunInBackground(raw, views, client); });
  pending_.push_back(std::move(p));
  return decision;
}

void ModelAverager::EndBackgroundRoundsBefore(int64_t generation) {
  for (const std::unique_ptr<PendingSync>& p : pending_) {
    if (p->done.HasBeenNotified() || p->decision.generation >= generation) continue;
    p->comm->Abort(SetErrorKind(
        absl::AbortedError(absl::StrCat(
            "the job moved to generation ", generation, " while fragment ", p->decision.fragment,
            "'s sync started at step ", p->decision.step, " ran; it is settled at step ",
            p->apply_step)),
        ErrorKind::kGenerationMoved));
    // An aborted round returns promptly; past the bound the note goes out without it.
    const absl::Duration bound = client_->options().collective_timeout + absl::Seconds(5);
    if (!p->done.WaitForNotificationWithTimeout(bound)) {
      spdlog::error("fragment {}'s sync started at step {} did not end within {} of its abort",
                    p->decision.fragment, p->decision.step, absl::FormatDuration(bound));
    }
  }
}

absl::Status ModelAverager::SettleBackgroundRound(PendingSync& p) {
  const Decision& failed = p.decision;
  if (absl::IsInvalidArgument(p.result) || ErrorKindOf(p.result) == ErrorKind::kRoundMismatch) {
    return p.result;
  }
  // Its communicator is gone once this client has moved on.
  if (client_->generation() == failed.generation) {
    ReportUnreachablePeersOf(failed, p.comm, p.result);
  }
  absl::StatusOr<Decision> next = MoveOnAfterFailure(failed, p.result);
  int attempt = 1;
  absl::StatusOr<bool> completed =
      next.ok() ? PeerCompletedAttempt(failed, &*next, &attempt) : next.status();
  client_->ReportStep(step_);  // deciding the sync step again reported that step
  MODELAVG_RETURN_IF_ERROR(completed.status());
  if (*completed) {
    if (p.held == nullptr) {
      return absl::InternalError(absl::StrCat(
          "a peer completed the round but this rank holds no result (", p.result.message(),
          "); restore a checkpoint"));
    }
    for (size_t i = 0; i < p.buffer->size(); ++i) {
      std::memcpy(p.buffer->data(i), p.held->data(i), p.buffer->nbytes(i));
    }
    client_->RecordRound(failed.level, failed.step, failed.generation, RoundOutcome::kCompleted);
    spdlog::info("the sync of fragment {} started at step {} completed on a peer before the "
                 "failure ({}); its result is kept",
                 failed.fragment, failed.step, std::string(p.result.message()));
    return absl::OkStatus();
  }
  // Nobody kept it: the same inputs, now, with the live members of the sync step.
  spdlog::warn("the sync of fragment {} started at step {} failed ({}); running it again in "
               "generation {} with ranks {}",
               failed.fragment, failed.step, std::string(p.result.message()), next->generation,
               absl::StrJoin(next->Members(), ","));
  const int64_t signature = round_signature_;
  round_payload_ = p.options.payload;
  round_signature_ = p.options.layout_signature;
  absl::StatusOr<Decision> again =
      AverageElastic(*next, Device::Host(), p.buffer->Views(), !next->joining.empty());
  round_payload_ = Payload::kFp32;
  round_signature_ = signature;
  client_->ReportStep(step_);
  return again.status();
}

absl::Status ModelAverager::ApplyPending(int64_t step, absl::Span<const TensorView> params) {
  // Due ones, oldest first; each is taken out before it is applied (a failure drops it).
  absl::Status first_error;
  for (size_t i = 0; i < pending_.size();) {
    if (pending_[i]->apply_step > step) {
      ++i;
      continue;
    }
    std::unique_ptr<PendingSync> p = std::move(pending_[i]);
    pending_.erase(pending_.begin() + i);
    absl::Status s = ApplyOne(std::move(p), step, params);
    if (first_error.ok()) first_error = s;
  }
  return first_error;
}

absl::Status ModelAverager::ApplyOne(std::unique_ptr<PendingSync> p, int64_t step,
                                     absl::Span<const TensorView> params) {
  const Decision& d = p->decision;
  const ScheduleLevel& spec = client_->schedule().spec().levels[d.level];
  const std::string where =
      absl::StrCat("applying at step ", step, " the sync of fragment ", d.fragment,
                   " started at step ", d.step, " (level ", d.level, ", subgroup ",
                   d.subgroup.index, ")");
  const absl::Time start = absl::Now();
  // The round is bounded by the collective timeout; past it (and a margin) it is aborted.
  const absl::Duration bound = client_->options().collective_timeout + absl::Seconds(5);
  if (!p->done.WaitForNotificationWithTimeout(bound) && p->comm != nullptr) {
    p->comm->Abort(absl::DeadlineExceededError(
        absl::StrCat(where, ": the background all-reduce did not end within ",
                     absl::FormatDuration(bound))));
    p->done.WaitForNotification();  // an aborted round returns promptly
  }
  if (p->thread.joinable()) p->thread.join();
  if (traffic_.size() <= static_cast<size_t>(d.level)) traffic_.resize(d.level + 1);
  traffic_[d.level].waited += absl::Now() - start;
  CountBytes(d.level, p->bytes_after - p->bytes_before);
  if (!p->result.ok() && client_->elastic()) {
    absl::Status settled = SettleBackgroundRound(*p);
    if (!settled.ok()) return Annotate(settled, where);
    p->result = absl::OkStatus();
  }
  if (!p->result.ok()) {
    // Name the cause (a peer's death, a new generation) rather than the broken socket: give
    // the coordinator up to a heartbeat timeout to declare it, as a blocking round does.
    const absl::Time until = absl::Now() + client_->heartbeat_timeout() +
                             2 * client_->options().heartbeat_interval + absl::Milliseconds(500);
    while (p->result.code() != absl::StatusCode::kInvalidArgument) {
      absl::Status why = client_->CheckCanAverage(d.subgroup);
      if (!why.ok()) {
        return absl::Status(why.code(), absl::StrCat(where, " failed: ", why.message(),
                                                     " (round: ", p->result.message(), ")"));
      }
      if (absl::Now() >= until) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return Annotate(p->result, where);
  }
  if (step != p->apply_step) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": it was due at step ", p->apply_step,
        " (the step was moved with set_step); its result is dropped"));
  }
  const FragmentSplit split = SplitIntoFragments(params, std::max(1, d.fragments));
  absl::Span<const TensorView> fragment =
      d.fragments > 1 ? split.Fragment(params, d.fragment) : params;
  if (p->device != nullptr || (!fragment.empty() && !fragment[0].device.is_host())) {
    return Annotate(ApplyDevicePending(p.get(), fragment, spec.mix), where);
  }
  std::vector<TensorView> mean = p->buffer->Views();
  if (mean.size() != fragment.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": the fragment had ", mean.size(), " tensors when it started and has ",
        fragment.size(), " now; pass the same parameter list to every call"));
  }
  for (size_t i = 0; i < fragment.size(); ++i) {
    if (mean[i].numel != fragment[i].numel) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": tensor ", i, " of the fragment had ", mean[i].numel,
          " elements when it started and has ", fragment[i].numel, " now"));
    }
  }
  LocalCopy local;
  if (spec.mix != 0) local.Take(fragment);
  if (p->first) {
    MODELAVG_RETURN_IF_ERROR(Annotate(p->state->SetAnchor(mean), where));
    for (size_t i = 0; i < fragment.size(); ++i) {
      for (int64_t j = 0; j < fragment[i].numel; ++j) Write(fragment[i], j, Read(mean[i], j));
    }
  } else {
    MODELAVG_RETURN_IF_ERROR(Annotate(p->state->Step(0, mean, fragment), where));
  }
  if (spec.mix != 0) local.MixInto(fragment, spec.mix);
  return absl::OkStatus();
}

absl::Status ModelAverager::TransferParameters(const Decision& decision, Communicator* comm) {
  const bool me_joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                             client_->rank());
  OuterBuffer buffer;
  buffer.Shape(round_params_);
  std::vector<TensorView> views = buffer.Views();
  if (!me_joining) {
    for (size_t i = 0; i < views.size(); ++i) {
      for (int64_t j = 0; j < views[i].numel; ++j) Write(views[i], j, Read(round_params_[i], j));
    }
  }
  RoundOptions options;
  options.step = decision.step;
  options.contribute = !me_joining;
  options.contributors =
      static_cast<int>(decision.Members().size() - decision.joining.size());
  // A round of its own between the hand-over and the step's round: agreed afresh, like them
  // (client/comm/round_agreement.h).
  options.layout_signature = 0x626c6f636b;  // "block"
  MODELAVG_RETURN_IF_ERROR(Annotate(comm->AllReduceAverage(views, options, nullptr),
                                    "handing the replacement its block's parameters"));
  if (me_joining) {
    for (size_t i = 0; i < views.size(); ++i) {
      for (int64_t j = 0; j < views[i].numel; ++j) Write(round_params_[i], j, Read(views[i], j));
    }
    spdlog::info("step {}: received the mean of the parameters of {} members", decision.step,
                 options.contributors);
  }
  return absl::OkStatus();
}

namespace {

std::vector<StateTensor> BufferTensors(OuterBuffer& buffer) {
  std::vector<StateTensor> out(buffer.size());
  for (size_t i = 0; i < buffer.size(); ++i) {
    out[i].dtype = buffer.dtype(i);
    out[i].numel = buffer.numel(i);
    const uint8_t* p = static_cast<const uint8_t*>(buffer.data(i));
    out[i].bytes.assign(p, p + buffer.nbytes(i));
  }
  return out;
}

}  // namespace

void ModelAverager::StreamingStateInto(AveragerState* out) const {
  for (size_t level = 0; level < fragment_outer_.size(); ++level) {
    for (size_t f = 0; f < fragment_outer_[level].size(); ++f) {
      const OuterLevelState* state = fragment_outer_[level][f].get();
      if (state == nullptr || !state->has_anchor()) continue;
      FragmentState fs;
      fs.level = static_cast<int>(level);
      fs.fragment = static_cast<int>(f);
      fs.anchor = state->AnchorTensors();
      if (state->has_momentum()) fs.momentum = state->MomentumTensors();
      out->fragments.push_back(std::move(fs));
    }
  }
  for (const std::unique_ptr<PendingSync>& p : pending_) {
    // Its result is part of the state: wait for it, as the call at its apply step would.
    const absl::Duration bound = client_->options().collective_timeout + absl::Seconds(5);
    if (!p->done.WaitForNotificationWithTimeout(bound) && p->comm != nullptr) {
      p->comm->Abort(absl::DeadlineExceededError(absl::StrCat(
          "state_dict(): the background all-reduce of fragment ", p->decision.fragment,
          " started at step ", p->decision.step, " did not end within ",
          absl::FormatDuration(bound))));
      p->done.WaitForNotification();
    }
    if (p->thread.joinable()) p->thread.join();
    PendingState ps;
    ps.level = p->decision.level;
    ps.fragment = p->decision.fragment;
    ps.start_step = p->decision.step;
    ps.apply_step = p->apply_step;
    ps.first = p->first;
    if (p->result.ok() && p->device != nullptr) {
      absl::StatusOr<std::vector<StateTensor>> r = p->device->ResultTensors();
      if (r.ok()) ps.result = *std::move(r);
      if (!r.ok()) ps.error = r.status().ToString();
    } else if (p->result.ok()) {
      ps.result = BufferTensors(*p->buffer);
    } else {
      ps.error = p->result.ToString();
    }
    out->pending.push_back(std::move(ps));
  }
}

absl::Status ModelAverager::LoadStreamingState(
    const AveragerState& state, std::vector<std::vector<std::unique_ptr<OuterLevelState>>>* states,
    std::vector<std::unique_ptr<PendingSync>>* pending) const {
  const std::vector<ScheduleLevel>& levels = client_->schedule().spec().levels;
  states->clear();
  states->resize(levels.size());
  for (size_t level = 0; level < levels.size(); ++level) {
    if (!StreamingOuterLevel(levels[level])) continue;
    for (int f = 0; f < std::max(1, levels[level].fragments); ++f) {
      (*states)[level].push_back(
          std::make_unique<OuterLevelState>(static_cast<int>(level), *levels[level].outer));
    }
  }
  auto check = [&](int level, int fragment, const std::string& what) -> absl::Status {
    if (level < 0 || level >= static_cast<int>(levels.size()) ||
        !StreamingOuterLevel(levels[level])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " names level ", level, ", which is not a streaming outer level of job ",
          client_->job_id(), ": was the state_dict saved from another job's averager?"));
    }
    const int fragments = std::max(1, levels[level].fragments);
    if (fragment < 0 || fragment >= fragments) {
      return absl::InvalidArgumentError(absl::StrCat(what, " names fragment ", fragment,
                                                     " of level ", level, ", which has ",
                                                     fragments, " fragments"));
    }
    return absl::OkStatus();
  };
  for (const FragmentState& fs : state.fragments) {
    const std::string what = absl::StrCat("fragments[level ", fs.level, ", fragment ",
                                          fs.fragment, "]");
    MODELAVG_RETURN_IF_ERROR(check(fs.level, fs.fragment, what));
    OuterLevelState* s = (*states)[fs.level][fs.fragment].get();
    if (s->has_anchor()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " appears twice"));
    }
    MODELAVG_RETURN_IF_ERROR(
        Annotate(s->Load(fs.anchor, fs.momentum.empty() ? nullptr : &fs.momentum), what));
  }
  pending->clear();
  for (const PendingState& ps : state.pending) {
    const std::string what = absl::StrCat("pending[level ", ps.level, ", fragment ",
                                          ps.fragment, ", started at step ", ps.start_step, "]");
    MODELAVG_RETURN_IF_ERROR(check(ps.level, ps.fragment, what));
    const ScheduleLevel& spec = levels[ps.level];
    if (!ps.error.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the background all-reduce had failed when the state was saved (", ps.error,
          "); resume from an earlier checkpoint"));
    }
    if (spec.sync_delay == 0 || ps.apply_step != ps.start_step + spec.sync_delay ||
        ps.apply_step < state.step || ps.start_step >= state.step) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": due at step ", ps.apply_step, " does not fit level ", ps.level,
          "'s sync_delay ", spec.sync_delay, " and the saved step ", state.step));
    }
    OuterLevelState* s = (*states)[ps.level][ps.fragment].get();
    if (ps.first == s->has_anchor()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ps.first ? ": the fragment's first sync, but the fragment has an anchor"
                         : ": an outer step, but the fragment has no anchor"));
    }
    std::vector<TensorView> shape(ps.result.size());
    for (size_t i = 0; i < ps.result.size(); ++i) {
      const StateTensor& t = ps.result[i];
      if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": result tensor ", i, " is not float32 or float64"));
      }
      if (t.numel < 0 || t.bytes.size() != static_cast<size_t>(t.numel) * DTypeSize(t.dtype)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": result tensor ", i, " has ",
                                                       t.bytes.size(), " bytes for ", t.numel,
                                                       " elements"));
      }
      shape[i].numel = t.numel;
      shape[i].dtype = t.dtype;
    }
    auto p = std::make_unique<PendingSync>();
    p->decision.step = ps.start_step;
    p->decision.average = true;
    p->decision.level = ps.level;
    p->decision.period = spec.period;
    p->decision.fragment = ps.fragment;
    p->decision.fragments = std::max(1, spec.fragments);
    p->decision.outer = true;
    p->apply_step = ps.apply_step;
    p->first = ps.first;
    p->state = s;
    p->buffer = std::make_unique<OuterBuffer>();
    p->buffer->Shape(shape);
    for (size_t i = 0; i < ps.result.size(); ++i) {
      if (!ps.result[i].bytes.empty()) {
        std::memcpy(p->buffer->data(i), ps.result[i].bytes.data(), ps.result[i].bytes.size());
      }
    }
    p->result = absl::OkStatus();
    p->done.Notify();
    pending->push_back(std::move(p));
  }
  return absl::OkStatus();
}

void ModelAverager::AbandonPending() {
  for (auto& p : pending_) {
    if (!p->done.HasBeenNotified()) {
      p->comm->Abort(absl::CancelledError(
          "the averager was destroyed while a fragment's all-reduce was in flight"));
    }
  }
  pending_.clear();  // joins the threads
}

}  // namespace modelavg::client
