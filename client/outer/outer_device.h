// The device the outer states of CUDA parameters live on (OuterDevice): the device operations
// and the outer optimizer's kernels their states run on, which whoever builds the averager
// supplies (LocalDeviceFactory: cuda/cuda_outer_device.h in a CUDA build, a simulated device in
// tests), made at the first use, on that device; the pseudo-gradient on the device (shared by
// the levels: one step runs at a time), a streaming level's copy of the parameters on the
// device (x_local of a mix), and a paced round's weighted copy of its tensors (WeightedInput,
// client/averaging/round_weights.h; one round runs at a time). Freed after the states that were
// allocated with them.
//
// Not thread-safe: ModelAverager calls it under its mutex.
#ifndef MODELAVG_CLIENT_OUTER_OUTER_DEVICE_H_
#define MODELAVG_CLIENT_OUTER_OUTER_DEVICE_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/outer/device_outer_state.h"
#include "client/outer/outer_kernels.h"
#include "client/outer/outer_state.h"
#include "modelavg/client/tensor.h"

namespace modelavg::client {

// What the outer states of one device run on.
struct LocalDevice {
  std::unique_ptr<DeviceOps> ops;
  std::unique_ptr<OuterKernels> kernels;
};
// Opens CUDA device `index`; a device wait gives up after `timeout`.
using LocalDeviceFactory =
    std::function<absl::StatusOr<LocalDevice>(int index, absl::Duration timeout)>;

class OuterDevice {
 public:
  // `timeout`: of a device wait; `pinned_host`: AveragerOptions::backup_device is kHost;
  // `open`: null in a build without CUDA.
  OuterDevice(absl::Duration timeout, bool pinned_host, LocalDeviceFactory open)
      : timeout_(timeout), pinned_host_(pinned_host), open_(std::move(open)) {}
  ~OuterDevice();
  OuterDevice(const OuterDevice&) = delete;
  OuterDevice& operator=(const OuterDevice&) = delete;

  // Opens `device` at the first call. INVALID_ARGUMENT for another device than the first one's,
  // UNIMPLEMENTED in a build without CUDA.
  absl::Status Open(const Device& device);
  // `state`'s device state on `device` (attached at its first CUDA step).
  absl::StatusOr<DeviceOuterState*> StateOf(OuterLevelState* state, const Device& device);
  // A fragment's background sync (device_outer_state.h) of `state`, on this device (opened).
  std::unique_ptr<DevicePendingSync> NewPendingSync(DeviceOuterState* state, bool first);
  // Runs `round` on a device copy of the host buffer that `views` cover (one allocation of
  // `bytes` from views[0]), placed like `like` (device, stream), and copies the result back.
  absl::Status RoundThroughDevice(
      const TensorView& like, const std::vector<TensorView>& views, size_t bytes,
      const std::function<absl::Status(absl::Span<const TensorView>)>& round);
  // Once Open has succeeded: the pseudo-gradient, x_local.
  GrowableBuffer* gradient() const { return gradient_.get(); }
  GrowableBuffer* local();
  // Once Open has succeeded: the device memory of a paced round's weighted copy, grown to
  // `bytes` (its earlier contents lost: one round's copy at a time).
  absl::StatusOr<void*> WeightedCopy(size_t bytes);
  // Once Open has succeeded, on the tensors' streams: to[i] := fl(scale * from[i]) (the host's
  // ScaleInto, OuterKernels::ScaleCopy), and to[i] := from[i] then a wait for the copies.
  // `from` and `to` have the same counts and dtypes, in device memory.
  absl::Status ScaleInto(absl::Span<const TensorView> from, double scale,
                         absl::Span<const TensorView> to);
  absl::Status CopyInto(absl::Span<const TensorView> from, absl::Span<const TensorView> to);

 private:
  const absl::Duration timeout_;
  const bool pinned_host_;
  const LocalDeviceFactory open_;
  int index_ = -1;
  LocalDevice local_device_;
  std::unique_ptr<GrowableBuffer> gradient_;
  std::unique_ptr<OwnedDeviceBuffer> local_;
  std::unique_ptr<OwnedDeviceBuffer> weighted_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_OUTER_OUTER_DEVICE_H_
