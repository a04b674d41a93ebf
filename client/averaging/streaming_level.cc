#include "client/averaging/streaming_level.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/averaging/fragments.h"
#include "client/averaging/round_weights.h"
#include "client/base/error_kind.h"
#include "client/base/half.h"
#include "client/comm/communicator_cache.h"
#include "client/payload/payload_codec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {


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
        SetElementAt(params[i], j,
                     (1.0 - mix) * ElementAt(params[i], j) + mix * ElementAt(local, j));
      }
    }
  }

 private:
  std::vector<std::vector<uint8_t>> bytes_;
};

// What a round of `decision`'s fragment carries, as a non-finite report names it: the
// fragment's parameters at its first sync, its pseudo-gradient at an outer step.
std::string ContentsOf(const Decision& decision, bool first) {
  const std::string what = first ? "parameters" : "pseudo-gradient";
  if (decision.fragments <= 1) return what;
  return absl::StrCat(what, " of fragment ", decision.fragment + 1, " of ", decision.fragments);
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

StreamingLevel::StreamingLevel(Client* client, OuterDevice* device, OuterBuffer* pseudo_gradient,
                               RoundRunner* rounds, Traffic* traffic)
    : client_(client),
      device_(device),
      pseudo_gradient_(pseudo_gradient),
      rounds_(rounds),
      traffic_(traffic) {}

StreamingLevel::~StreamingLevel() { Abandon(); }

std::string StreamingLevel::Where(const Decision& decision, const Device* device) {
  return absl::StrCat("outer step at step ", decision.step, " (level ", decision.level,
                      ", fragment ", decision.fragment, " of ", decision.fragments, ", subgroup ",
                      decision.subgroup.index,
                      device != nullptr ? absl::StrCat(", ", device->ToString()) : "", ")");
}

bool StreamingLevel::DueBy(int64_t step) const {
  for (const auto& p : pending_) {
    if (p->apply_step <= step) return true;
  }
  return false;
}

absl::StatusOr<Decision> StreamingLevel::Round(const Decision& decision, const Device& device,
                                               absl::Span<const TensorView> fragment,
                                               int64_t split_signature) {
  const int level = decision.level;
  const ScheduleLevel& spec = client_->plans().Plan(decision.plan).spec().levels[level];
  const std::string where = Where(decision, nullptr);
  if (!decision.weights.empty() && spec.sync_delay != 0 &&
      (client_->elastic() || !device.is_host())) {
    // An elastic settle re-runs a failed background sync from its buffer, already weighted with
    // the failed round's weights, and the device's background sync has no weighted buffer yet:
    // neither would average with the right weights (round_weights.h).
    return absl::UnimplementedError(absl::StrCat(
        where, ": a paced (weighted) round with levels[", level, "].sync_delay ",
        spec.sync_delay, " runs in strict jobs on host parameters only in this version (",
        client_->elastic() ? "this job is elastic" : absl::StrCat("the parameters are on ",
                                                                   device.ToString()),
        "; sync_delay 0 is weighted in strict and elastic jobs alike)"));
  }
  if (!device.is_host() && spec.sync_delay != 0 && client_->elastic()) {
    // The elastic settle of a background round (docs/streaming.md, "Elastic jobs") runs on
    // host buffers; the device's background sync has no such path yet.
    return absl::UnimplementedError(absl::StrCat(
        where, ": levels[", level, "].sync_delay ", spec.sync_delay,
        " on CUDA parameters runs in strict jobs only in this version (elastic jobs: host "
        "parameters, or sync_delay 0); the parameters are on ", device.ToString()));
  }
  // A replacement admitted at this step (elastic jobs) receives, inside the round, every outer
  // state and the mean of its block's parameters (the round's hand-over), contributes nothing, and
  // takes the same branch as its peers: the fragment's first sync or an outer step.
  const bool me_joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                             client_->rank());
  OuterLevelState* state = FragmentsOf(states_, level, spec)[decision.fragment].get();
  if (!device.is_host()) {
    return DeviceRound(decision, device, fragment, state, me_joining,
                       client_->plans().FirstSyncOf(decision.plan, level, decision.fragment),
                       split_signature);
  }
  const RoundWire plain{Payload::kFp32, split_signature, 0, ContentsOf(decision, true)};
  // The pseudo-gradient travels in the level's payload.
  const RoundWire outer{spec.payload, split_signature, TopkPerBlock(spec.topk_density),
                        ContentsOf(decision, false)};
  const WireFormat format(spec.payload, outer.topk);
  LocalCopy local;
  if (spec.mix != 0 && !me_joining) local.Take(fragment);
  if (me_joining) {
    const bool first =
        client_->plans().FirstSyncOf(decision.plan, level, decision.fragment) == decision.step;
    if (spec.sync_delay != 0) {
      return Start(decision, device, fragment, state, first, split_signature);
    }
    if (first) {
      MODELAVG_ASSIGN_OR_RETURN(Decision done, rounds_->Run(decision, device, fragment, plain));
      MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(fragment), where));
      return done;
    }
    pseudo_gradient_->Shape(fragment);
    std::vector<TensorView> d = pseudo_gradient_->Views();
    absl::StatusOr<Decision> done = rounds_->Run(decision, device, d, outer);
    if (!done.ok()) return done.status();
    // x_local of a replacement: the block's mean it has just received.
    if (spec.mix != 0) local.Take(fragment);
    MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, fragment), where));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, fragment), where));
    if (spec.mix != 0) local.MixInto(fragment, spec.mix);
    return done;
  }
  if (!state->has_anchor()) {
    const int64_t first = client_->plans().FirstSyncOf(decision.plan, level, decision.fragment);
    if (first >= 0 && decision.step != first) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": this rank has no outer state for this fragment (its first sync was step ",
          first, "): restore the averager with load_state_dict() from a checkpoint's "
                 "state_dict() rather than set_step() alone"));
    }
    if (spec.sync_delay != 0) {
      return Start(decision, device, fragment, state, true, split_signature);
    }
    // The fragment's first sync: a plain average (FP32), its result the anchor.
    MODELAVG_ASSIGN_OR_RETURN(Decision done, rounds_->Run(decision, device, fragment, plain));
    MODELAVG_RETURN_IF_ERROR(Annotate(state->SetAnchor(fragment), where));
    if (spec.mix != 0) local.MixInto(fragment, spec.mix);
    return done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(state->CheckLayout(0, fragment), where));
  if (spec.sync_delay != 0) {
    return Start(decision, device, fragment, state, false, split_signature);
  }
  pseudo_gradient_->Shape(fragment);
  std::vector<TensorView> d = pseudo_gradient_->Views();
  MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, fragment, d), where));
  // Error feedback: U = beta * E + D is sent, and E := U - decode(encode(U)) once it is.
  OuterBuffer residual;
  RoundWire sent = outer;
  if (spec.error_feedback != 0 && !decision.weights.empty()) {
    // A paced round (round_weights.h): the weight multiplies D before the residual is added
    // and the payload encodes, U = beta * E + s * D, in each attempt with that attempt's s; D
    // itself stays unscaled for a retry, and the round's copy receives the weighted mean.
    sent.weigh = [&](double scale, absl::Span<const TensorView> u) {
      return WeighWithFeedback(*state, spec.error_feedback, format, d, scale, u, &residual);
    };
  } else if (spec.error_feedback != 0) {
    MODELAVG_RETURN_IF_ERROR(Annotate(state->AddResidual(spec.error_feedback, d), where));
    residual = OuterLevelState::NextResidual(format, d);
  }
  // The state and the parameters change only once the round has succeeded.
  absl::StatusOr<Decision> done = rounds_->Run(decision, device, d, sent);
  if (!done.ok()) return done.status();
  if (spec.error_feedback != 0) state->SwapResidual(std::move(residual), true);
  MODELAVG_RETURN_IF_ERROR(Annotate(state->Step(0, d, fragment), where));
  if (spec.mix != 0) local.MixInto(fragment, spec.mix);
  return done;
}

std::unique_ptr<PendingSync> StreamingLevel::NewPendingSync(const Decision& decision,
                                                           OuterLevelState* state,
                                                           bool first) const {
  auto p = std::make_unique<PendingSync>();
  p->decision = decision;
  p->apply_step =
      decision.step + client_->plans().Plan(decision.plan).spec().levels[decision.level].sync_delay;
  p->first = first;
  p->state = state;
  return p;
}

absl::StatusOr<Decision> StreamingLevel::Start(const Decision& decision, const Device& device,
                                               absl::Span<const TensorView> fragment,
                                               OuterLevelState* state, bool first,
                                               int64_t split_signature) {
  const ScheduleLevel& spec = client_->plans().Plan(decision.plan).spec().levels[decision.level];
  const std::string where = absl::StrCat(
      "starting the sync of fragment ", decision.fragment, " at step ", decision.step,
      " (level ", decision.level, device.is_host() ? "" : absl::StrCat(", ", device.ToString()),
      ")");
  if (!device.is_host()) {
    return StartDevice(decision, device, fragment, state, first, split_signature, where);
  }
  std::unique_ptr<PendingSync> p = NewPendingSync(decision, state, first);
  p->buffer = std::make_unique<OuterBuffer>();
  p->buffer->Shape(fragment);
  std::vector<TensorView> views = p->buffer->Views();
  const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                          client_->rank());
  std::unique_ptr<OuterBuffer> next_residual;
  // A paced round (strict jobs, round_weights.h): the buffer holds this member's weighted
  // contribution, s x at the first sync, else s D (then beta E added and the residual kept from
  // the weighted U), which the background round averages dividing by the contributing members
  // as always. Its result is applied at the apply step like any other.
  double scale = 1;
  const bool weighted = !decision.weights.empty();
  if (weighted) {
    absl::StatusOr<RoundWeight> weight = WeightOf(decision, client_->rank());
    if (!weight.ok()) return Annotate(weight.status(), where);
    scale = weight->scale;
  }
  if (joining) {
    // A replacement contributes nothing (it receives the outer state in the round).
  } else if (first) {
    for (size_t i = 0; i < fragment.size(); ++i) {
      for (int64_t j = 0; j < fragment[i].numel; ++j) {
        SetElementAt(views[i], j, ElementAt(fragment[i], j));
      }
    }
    if (weighted) ScaleInto(views, scale, views);
  } else {
    MODELAVG_RETURN_IF_ERROR(Annotate(state->PseudoGradient(0, fragment, views), where));
    if (weighted) ScaleInto(views, scale, views);
    if (spec.error_feedback != 0) {
      // U = beta * E + D is sent; E := U - decode(encode(U)) now, restored by the apply step's
      // call if the round fails (so that a checkpoint taken with the sync pending holds the
      // residual the sync leaves).
      MODELAVG_RETURN_IF_ERROR(Annotate(state->AddResidual(spec.error_feedback, views), where));
      next_residual = std::make_unique<OuterBuffer>(OuterLevelState::NextResidual(
          WireFormat(spec.payload, TopkPerBlock(spec.topk_density)), views));
    }
  }
  // Once the round starts: the state takes the residual it leaves, the record the one before.
  const auto keep_residual = [&] {
    if (next_residual == nullptr) return;
    auto [before, had] = state->SwapResidual(std::move(*next_residual), true);
    p->residual_before = std::make_unique<OuterBuffer>(std::move(before));
    p->had_residual = had;
  };
  const RoundWire wire{first ? Payload::kFp32 : spec.payload, split_signature,
                       TopkPerBlock(spec.topk_density), ContentsOf(decision, first)};
  if (client_->elastic() && !decision.joining.empty()) {
    // An admission at a delayed sync step: the replacement needs its parameters now, so the
    // round runs in this call, handing it the outer state and the parameters first, like any
    // admission round; its result is applied at the apply step like any other.
    keep_residual();
    absl::StatusOr<Decision> done = rounds_->RunElastic(decision, device, views, wire);
    if (!done.ok()) {
      if (p->residual_before != nullptr) {
        state->SwapResidual(std::move(*p->residual_before), p->had_residual);
      }
      return done.status();
    }
    p->result = absl::OkStatus();
    p->outcome = RoundOutcome::kCompleted;
    p->done.Notify();
    pending_.push_back(std::move(p));
    return *done;
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision.subgroup), where));
  absl::StatusOr<Communicator*> comm =
      client_->communicators()->Get(rounds_->Setup(decision), device);
  if (!comm.ok()) return Annotate(comm.status(), where);
  p->comm = *comm;
  if (client_->elastic()) {
    // Committed at the sync step like a blocking round, so that the call at the apply step
    // can settle a failure exactly (Settle).
    MODELAVG_ASSIGN_OR_RETURN(p->options, rounds_->ElasticOptions(decision, wire));
  }
  p->options.payload = wire.payload;
  p->options.topk = wire.topk;
  p->options.layout_signature = wire.layout_signature;
  // Checked like a blocking round (finite_check.h): a member's NaN fails the round on every
  // member, which the call at the apply step then reports (ApplyOneInner, Settle).
  p->options.step = decision.step;
  p->options.round = decision.round;
  p->options.check_finite = client_->options().check_finite;
  p->bytes_before = p->comm->bytes_sent();
  keep_residual();
  PendingSync* raw = p.get();
  Client* client = client_->elastic() ? client_ : nullptr;
  p->thread = std::thread([raw, views, client] { RunInBackground(raw, views, client); });
  pending_.push_back(std::move(p));
  return decision;
}

void StreamingLevel::EndBackgroundRoundsBefore(int64_t generation) {
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

absl::Status StreamingLevel::Settle(PendingSync& p, int64_t report_step) {
  const Decision& failed = p.decision;
  absl::Status why = p.result;
  if (ErrorKindOf(why) == ErrorKind::kNonFinite) {
    // As a blocking round (RoundRunner::RunElastic): the member that contributed them reports
    // it (the coordinator retires it) and fails its call; the others run the sync again
    // without it, in the generation that follows, with the same inputs.
    why = rounds_->OnNonFinite(
        failed, RoundWire{p.options.payload, p.options.layout_signature, p.options.topk,
                          ContentsOf(failed, p.first)},
        std::move(why));
    const std::optional<NonFiniteDetail> detail = NonFiniteDetailOf(why);
    if (detail.has_value() && detail->rank == client_->rank()) return why;
    spdlog::warn("the sync of fragment {} started at step {}: {}; running it again without its "
                 "member",
                 failed.fragment, failed.step, std::string(why.message()));
  } else if (absl::IsInvalidArgument(why) || ErrorKindOf(why) == ErrorKind::kRoundMismatch) {
    return why;
  } else if (client_->generation() == failed.generation) {
    // Its communicator is gone once this client has moved on.
    rounds_->ReportUnreachablePeersOf(failed, p.comm, why);
  }
  absl::StatusOr<Decision> next = rounds_->MoveOnAfterFailure(failed, why);
  int attempt = 1;
  absl::StatusOr<bool> completed =
      next.ok() ? rounds_->PeerCompletedAttempt(failed, &*next, &attempt) : next.status();
  client_->ReportStep(report_step);  // deciding the sync step again reported that step
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
               failed.fragment, failed.step, std::string(why.message()), next->generation,
               absl::StrJoin(next->Members(), ","));
  absl::StatusOr<Decision> again = rounds_->RunElastic(
      *next, Device::Host(), p.buffer->Views(),
      RoundWire{p.options.payload, p.options.layout_signature, p.options.topk,
                ContentsOf(failed, p.first)},
      !next->joining.empty());
  client_->ReportStep(report_step);
  return again.status();
}

absl::Status StreamingLevel::ApplyDue(int64_t step, absl::Span<const TensorView> params,
                                      int64_t report_step) {
  // Due ones, oldest first; each is taken out before it is applied (a failure drops it).
  absl::Status first_error;
  for (size_t i = 0; i < pending_.size();) {
    if (pending_[i]->apply_step > step) {
      ++i;
      continue;
    }
    std::unique_ptr<PendingSync> p = std::move(pending_[i]);
    pending_.erase(pending_.begin() + i);
    absl::Status s = ApplyOne(std::move(p), step, params, report_step);
    if (first_error.ok()) first_error = s;
  }
  return first_error;
}

absl::Status StreamingLevel::ApplyOne(std::unique_ptr<PendingSync> p, int64_t step,
                                      absl::Span<const TensorView> params, int64_t report_step) {
  absl::Status s = ApplyOneInner(p.get(), step, params, report_step);
  if (!s.ok() && p->residual_before != nullptr && p->state != nullptr) {
    // The sync was not applied: the residual is as it was before its start.
    p->state->SwapResidual(std::move(*p->residual_before), p->had_residual);
  }
  if (!s.ok() && p->device_residual_swapped && p->state != nullptr &&
      p->state->device() != nullptr) {
    p->state->device()->SwapResidual(std::move(p->device_residual_before));
  }
  return s;
}

absl::Status StreamingLevel::ApplyOneInner(PendingSync* p, int64_t step,
                                           absl::Span<const TensorView> params,
                                           int64_t report_step) {
  const Decision& d = p->decision;
  const ScheduleLevel& spec = client_->plans().Plan(d.plan).spec().levels[d.level];
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
  traffic_->AddWaited(d.level, absl::Now() - start);
  traffic_->AddBytes(d.level, p->bytes_after - p->bytes_before);
  if (!p->result.ok() && client_->elastic()) {
    absl::Status settled = Settle(*p, report_step);
    if (!settled.ok()) return Annotate(settled, where);
    p->result = absl::OkStatus();
  }
  if (!p->result.ok() && ErrorKindOf(p->result) == ErrorKind::kNonFinite) {
    // A strict job: every member's call fails naming the member, and nothing changes (the
    // round wrote nothing; the residual is restored by ApplyOne). Its member reports it.
    return Annotate(
        rounds_->OnNonFinite(d,
                             RoundWire{p->options.payload, p->options.layout_signature,
                                       p->options.topk, ContentsOf(d, p->first)},
                             p->result),
        where);
  }
  if (!p->result.ok()) {
    // Name the cause (a peer's death, a new generation) rather than the broken socket: give
    // the coordinator up to a heartbeat timeout to declare it, as a blocking round does.
    if (p->result.code() != absl::StatusCode::kInvalidArgument) {
      absl::Status why = client_->AwaitCannotAverage(d.subgroup, rounds_->CauseWait());
      if (!why.ok()) {
        return Restate(why, absl::StrCat(where, " failed: ", why.message(), " (round: ",
                                         p->result.message(), ")"));
      }
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
    return Annotate(ApplyDevice(p, fragment, spec.mix), where);
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
      for (int64_t j = 0; j < fragment[i].numel; ++j) {
        SetElementAt(fragment[i], j, ElementAt(mean[i], j));
      }
    }
  } else {
    MODELAVG_RETURN_IF_ERROR(Annotate(p->state->Step(0, mean, fragment), where));
  }
  if (spec.mix != 0) local.MixInto(fragment, spec.mix);
  return absl::OkStatus();
}

absl::Status StreamingLevel::HandParameters(const Decision& decision, Communicator* comm,
                                            absl::Span<const TensorView> params) {
  const bool me_joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                             client_->rank());
  OuterBuffer buffer;
  buffer.Shape(params);
  std::vector<TensorView> views = buffer.Views();
  if (!me_joining) {
    for (size_t i = 0; i < views.size(); ++i) {
      for (int64_t j = 0; j < views[i].numel; ++j) {
        SetElementAt(views[i], j, ElementAt(params[i], j));
      }
    }
  }
  RoundOptions options;
  options.step = decision.step;
  options.round = decision.round;
  options.contribute = !me_joining;
  options.contributors =
      static_cast<int>(decision.Members().size() - decision.joining.size());
  // A round of its own between the hand-over and the step's round: agreed afresh, like them
  // (client/comm/round_agreement.h).
  options.layout_signature = 0x626c6f636b;  // "block"
  // Checked like any round: a contributing member's NaN is never handed on (the replacement
  // writes nothing, and the admission round fails as a round with that member's NaN would).
  options.check_finite = client_->options().check_finite;
  MODELAVG_RETURN_IF_ERROR(Annotate(comm->AllReduceAverage(views, options, nullptr),
                                    "handing the replacement its block's parameters"));
  if (me_joining) {
    for (size_t i = 0; i < views.size(); ++i) {
      for (int64_t j = 0; j < views[i].numel; ++j) {
        SetElementAt(params[i], j, ElementAt(views[i], j));
      }
    }
    spdlog::info("step {}: received the mean of the parameters of {} members", decision.step,
                 options.contributors);
  }
  return absl::OkStatus();
}

void StreamingLevel::Replace(FragmentStates states,
                             std::vector<std::unique_ptr<PendingSync>> pending) {
  Abandon();
  states_ = std::move(states);
  pending_ = std::move(pending);
}

void StreamingLevel::Abandon() {
  for (auto& p : pending_) {
    if (!p->done.HasBeenNotified()) {
      p->comm->Abort(absl::CancelledError(
          "the averager was destroyed while a fragment's all-reduce was in flight"));
    }
  }
  pending_.clear();  // joins the threads
}

}  // namespace modelavg::client
