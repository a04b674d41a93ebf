// Streaming sync on CUDA parameters (docs/streaming.md): StreamingLevel's side of
// RunDeviceStreamingStep and DevicePendingSync (device_outer_state.h), on the NCCL communicators.
// The same rule as the host path (streaming_level.cc): each fragment its own device outer state,
// the pseudo-gradient in the level's payload, the background all-reduce on a thread and a stream
// of its own between the call at s and the call at s + sync_delay, and the parameters written
// only inside averaging calls.
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/averaging/streaming_level.h"
#include "client/comm/communicator_cache.h"
#include "client/outer/device_outer_state.h"
#include "client/payload/payload_codec.h"
#include "common/status_util.h"

namespace modelavg::client {

absl::StatusOr<Decision> StreamingLevel::DeviceRound(const Decision& decision,
                                                     const Device& device,
                                                     absl::Span<const TensorView> fragment,
                                                     OuterLevelState* state, bool joining,
                                                     int64_t first_sync,
                                                     int64_t split_signature) {
  const int level = decision.level;
  const ScheduleLevel& spec = client_->plans().Plan(decision.plan).spec().levels[level];
  const std::string where = Where(decision, &device);
  absl::StatusOr<DeviceOuterState*> attached = device_->StateOf(state, device);
  if (!attached.ok()) return Annotate(attached.status(), where);
  DeviceOuterState* on_device = *attached;
  if (!joining && !on_device->has_anchor() && first_sync >= 0 && decision.step != first_sync) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": this rank has no outer state for this fragment (its first sync was step ",
        first_sync, "): restore the averager with load_state_dict() from a checkpoint's "
                    "state_dict() rather than set_step() alone"));
  }
  if (spec.sync_delay != 0) {
    return Start(decision, device, fragment, state, !on_device->has_anchor(), split_signature);
  }
  if (!decision.weights.empty() && spec.error_feedback != 0) {
    // The device's error feedback adds beta E to the unscaled D before the round; a paced round
    // must send beta E + s D (round_weights.h), which only the host path computes so far.
    return absl::UnimplementedError(absl::StrCat(
        where, ": a paced (weighted) round with levels[", level, "].error_feedback ",
        spec.error_feedback, " runs on host parameters only in this version (the parameters "
        "are on ", device.ToString(), "); set error_feedback to 0 for CUDA parameters"));
  }
  const bool first_step = joining ? first_sync == decision.step : !on_device->has_anchor();
  Decision done = decision;
  DeviceFeedback feedback;
  if (spec.error_feedback != 0) {
    feedback.beta = spec.error_feedback;
    feedback.format = WireFormat(spec.payload, TopkPerBlock(spec.topk_density));
  }
  absl::Status s = RunDeviceStreamingStep(
      on_device, device_->gradient(), device_->local(), fragment, first_step, joining, spec.mix,
      [&](absl::Span<const TensorView> tensors, int64_t layout_signature) {
        // The pseudo-gradient's rounds agree on their own layout and travel in the payload.
        const bool outer = layout_signature == kOuterRoundSignature;
        const RoundWire wire{outer ? spec.payload : Payload::kFp32,
                             split_signature ^ layout_signature,
                             outer ? TopkPerBlock(spec.topk_density) : 0};
        absl::StatusOr<Decision> r = rounds_->Run(decision, device, tensors, wire);
        if (r.ok()) done = *r;
        return r.status();
      },
      feedback);
  if (!s.ok()) return Annotate(s, where);
  return done;
}

absl::StatusOr<Decision> StreamingLevel::StartDevice(const Decision& decision,
                                                     const Device& device,
                                                     absl::Span<const TensorView> fragment,
                                                     OuterLevelState* state, bool first,
                                                     int64_t split_signature,
                                                     const std::string& where) {
  const ScheduleLevel& spec = client_->plans().Plan(decision.plan).spec().levels[decision.level];
  MODELAVG_RETURN_IF_ERROR(Annotate(client_->CheckCanAverage(decision.subgroup), where));
  absl::StatusOr<Communicator*> comm =
      client_->communicators()->Get(rounds_->Setup(decision), device);
  if (!comm.ok()) return Annotate(comm.status(), where);
  for (const std::unique_ptr<PendingSync>& other : pending_) {
    // The schedule never lets this happen (a level's next sync comes H/F > sync_delay steps
    // later, after the last one was applied); a second collective must not queue behind one.
    if (other->comm == *comm) {
      return absl::InternalError(absl::StrCat(
          where, ": the sync of fragment ", other->decision.fragment, " started at step ",
          other->decision.step, " is still in flight on this communicator"));
    }
  }
  std::unique_ptr<PendingSync> p = NewPendingSync(decision, state, first);
  p->comm = *comm;
  p->device = device_->NewPendingSync(state->device(), first);
  // Error feedback, as on the host (StreamingLevel::Start): U = beta * E + D is sent, and the
  // state takes E := U - decode(encode(U)) once the round starts, the one before kept to be
  // restored if the sync is not applied. A replacement contributes nothing and keeps none.
  const bool joining = std::binary_search(decision.joining.begin(), decision.joining.end(),
                                          client_->rank());
  DeviceFeedback feedback;
  if (!first && !joining && spec.error_feedback != 0) {
    feedback.beta = spec.error_feedback;
    feedback.format = WireFormat(spec.payload, TopkPerBlock(spec.topk_density));
  }
  std::unique_ptr<OwnedDeviceBuffer> next_residual;
  // The buffer is filled (and waited for) before the call returns: the caller may train on.
  absl::StatusOr<std::vector<TensorView>> views =
      p->device->Fill(fragment, feedback, &next_residual);
  if (!views.ok()) return Annotate(views.status(), where);
  RoundOptions options;
  options.payload = first ? Payload::kFp32 : spec.payload;
  options.topk = first ? 0 : TopkPerBlock(spec.topk_density);
  options.layout_signature = split_signature ^ (first ? 0 : kOuterRoundSignature);
  // Checked like a blocking round (finite_check.h); the call at the apply step reports a
  // member's NaN (ApplyOneInner).
  options.step = decision.step;
  options.round = decision.round;
  options.check_finite = client_->options().check_finite;
  p->options = options;
  p->bytes_before = p->comm->bytes_sent();
  if (feedback.beta != 0) {
    p->device_residual_before = state->device()->SwapResidual(std::move(next_residual));
    p->device_residual_swapped = true;
  }
  PendingSync* raw = p.get();
  // The thread owns nothing but the buffer's round (on the sync's own stream): it never
  // touches the parameters. A level's next sync on this communicator starts only after this
  // one is applied (sync_delay < period / fragments), so no two collectives overlap on it.
  p->thread = std::thread([raw, v = *std::move(views), options] {
    raw->result = raw->comm->AllReduceAverage(v, options, nullptr);
    raw->done.Notify();
  });
  pending_.push_back(std::move(p));
  return decision;
}

absl::Status StreamingLevel::ApplyDevice(PendingSync* p, absl::Span<const TensorView> fragment,
                                         double mix) {
  if (p->device == nullptr) {
    // Restored by load_state_dict: its result is on the host (ApplyOne routes a restored sync
    // here only for a fragment of CUDA tensors).
    MODELAVG_ASSIGN_OR_RETURN(DeviceOuterState * on_device,
                              device_->StateOf(p->state, fragment[0].device));
    p->device = device_->NewPendingSync(on_device, p->first);
    MODELAVG_RETURN_IF_ERROR(p->device->LoadResult(fragment, p->buffer->Views()));
  } else if (!fragment.empty() && fragment[0].device.is_host()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sync started on CUDA parameters but the parameters are on ",
        fragment[0].device.ToString(), " now: keep the model on one device"));
  }
  return p->device->Apply(fragment, mix, device_->local());
}

}  // namespace modelavg::client
