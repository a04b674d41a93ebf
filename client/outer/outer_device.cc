#include "client/outer/outer_device.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/payload/staging_layout.h"
#include "common/status_util.h"

namespace modelavg::client {

OuterDevice::~OuterDevice() {
  weighted_.reset();
  local_.reset();
  if (gradient_ != nullptr && local_device_.ops != nullptr) {
    gradient_->Release(*local_device_.ops);
  }
}

absl::Status OuterDevice::Open(const Device& device) {
  if (open_ == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "the parameters are on ", device.ToString(),
        " but this build of modelavg has no CUDA support (configure with -DMODELAVG_WITH_CUDA=ON)"));
  }
  if (local_device_.ops == nullptr) {
    MODELAVG_ASSIGN_OR_RETURN(LocalDevice opened, open_(device.index, timeout_));
    local_device_ = std::move(opened);
    index_ = device.index;
    gradient_ = std::make_unique<GrowableBuffer>();
  }
  if (index_ != device.index) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the parameters are on ", device.ToString(), " but this averager's outer state is on cuda:",
        index_, ": keep the model on one device (or make a new averager)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeviceOuterState*> OuterDevice::StateOf(OuterLevelState* state,
                                                       const Device& device) {
  MODELAVG_RETURN_IF_ERROR(Open(device));
  if (state->device() == nullptr) {
    MODELAVG_RETURN_IF_ERROR(state->AttachDevice(std::make_unique<DeviceOuterState>(
        local_device_.ops.get(), local_device_.kernels.get(), state->level(), state->rule(),
        pinned_host_)));
  }
  return state->device();
}

std::unique_ptr<DevicePendingSync> OuterDevice::NewPendingSync(DeviceOuterState* state,
                                                               bool first) {
  return std::make_unique<DevicePendingSync>(local_device_.ops.get(), state, first);
}

GrowableBuffer* OuterDevice::local() {
  if (local_ == nullptr) local_ = std::make_unique<OwnedDeviceBuffer>(local_device_.ops.get());
  return local_->get();
}

absl::StatusOr<void*> OuterDevice::WeightedCopy(size_t bytes) {
  if (weighted_ == nullptr) {
    weighted_ = std::make_unique<OwnedDeviceBuffer>(local_device_.ops.get());
  }
  MODELAVG_RETURN_IF_ERROR(Annotate(weighted_->get()->Reserve(*local_device_.ops, bytes),
                                    absl::StrCat("allocating a paced round's weighted copy (",
                                                 bytes, " bytes) on cuda:", index_)));
  return weighted_->get()->data();
}

absl::Status OuterDevice::ScaleInto(absl::Span<const TensorView> from, double scale,
                                    absl::Span<const TensorView> to) {
  // One launch per tensor: a paced round weighs a model once per averaging step.
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    const int64_t n = std::min(from[i].numel, to[i].numel);
    if (n <= 0) continue;
    MODELAVG_RETURN_IF_ERROR(Annotate(
        local_device_.kernels->ScaleCopy(from[i].data, to[i].data, n, StagingCodeOf(from[i].dtype),
                                         scale, to[i].cuda_stream),
        absl::StrCat("weighing tensor ", i, " of the round on ", to[i].device.ToString())));
  }
  return absl::OkStatus();
}

absl::Status OuterDevice::CopyInto(absl::Span<const TensorView> from,
                                   absl::Span<const TensorView> to) {
  DeviceOps* ops = local_device_.ops.get();
  for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
    const size_t bytes = std::min(from[i].nbytes(), to[i].nbytes());
    if (bytes == 0) continue;
    MODELAVG_RETURN_IF_ERROR(ops->Copy(to[i].data, from[i].data, bytes, to[i].cuda_stream));
  }
  // The caller's tensors hold the result once the call returns, as after any round.
  for (size_t i = 0; i < to.size(); ++i) {
    if (i > 0 && to[i].cuda_stream == to[i - 1].cuda_stream) continue;
    MODELAVG_RETURN_IF_ERROR(
        ops->WaitLocal(to[i].cuda_stream, "copying the weighted round's result"));
  }
  return absl::OkStatus();
}

absl::Status OuterDevice::RoundThroughDevice(
    const TensorView& like, const std::vector<TensorView>& views, size_t bytes,
    const std::function<absl::Status(absl::Span<const TensorView>)>& round) {
  MODELAVG_RETURN_IF_ERROR(Open(like.device));
  DeviceOps* ops = local_device_.ops.get();
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

}  // namespace modelavg::client
