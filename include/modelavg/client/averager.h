// Model averagers with PyTorch's names and step semantics
// (torch.distributed.algorithms.model_averaging).
//
//   auto client = modelavg::client::Client::Connect(opts);            // client.h
//   auto averager = modelavg::client::HierarchicalModelAverager::Create(client->get());
//   std::vector<modelavg::client::TensorView> params = ...;          // the model's parameters
//   for (...) {
//     optimizer_step();
//     absl::StatusOr<modelavg::Decision> d = (*averager)->AverageParameters(params);
//     if (!d.ok()) { /* stop: the message says what went wrong and what to do */ }
//   }
//   checkpoint["averager_step"] = (*averager)->step();   // restore with set_step()
//
// Every AverageParameters call first decides (from the job's schedule, which the coordinator
// owns and the client prefetches) and then increments the step counter — in warm-up, on skipped
// steps and on averaging steps alike. On an averaging step every member of the chosen subgroup
// ends with the element-wise mean of the members' values; on a failure the caller's parameters
// are left either fully averaged or untouched, never half-written.
//
// A level with an outer optimizer (JobSpec Level.outer, DiLoCo; docs/diloco.md) keeps an anchor
// and a momentum per member: its first averaging step is a plain average that sets the anchor;
// each later one all-reduces the pseudo-gradient (anchor - parameters), steps the anchor with
// PyTorch's SGD on it and writes the anchor into the parameters. Checkpoint the averager with
// state_dict() (step, anchors, momenta) and restore it with load_state_dict().
#ifndef MODELAVG_CLIENT_AVERAGER_H_
#define MODELAVG_CLIENT_AVERAGER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// How an averager keeps its outer levels' state (Level.outer, docs/diloco.md); the job's spec
// holds the rule, these are this process's choices.
struct AveragerOptions {
  // Where the anchors and momenta of CUDA parameters live (torchft's `backup_device`):
  // kParameters, on the parameters' device (the default: the outer step reads and writes device
  // memory only); kHost, in pinned host memory, which the step's kernels read and write over the
  // bus (two parameter-sized buffers per outer level move off the device; the pseudo-gradient
  // stays there). Host parameters (Gloo) keep their state in host memory either way.
  enum class BackupDevice { kParameters, kHost };
  BackupDevice backup_device = BackupDevice::kParameters;
};

// One tensor of an averager's saved state: host bytes of `numel` elements of `dtype`.
struct StateTensor {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  std::vector<uint8_t> bytes;
};

// What ModelAverager::state_dict() saves and load_state_dict() restores (PyTorch's convention:
// a plain value a checkpoint can hold). For each level with an outer optimizer (Level.outer)
// whose first averaging step has happened: its anchor, one tensor per parameter tensor, and,
// once an outer step has set it (momentum > 0), its momentum buffer. Float32 for
// float16/bfloat16 parameters, else the parameters' dtype.
//
// A streaming outer level (fragments, sync_delay, mix or a compressed payload;
// docs/streaming.md) keeps its state per fragment instead: `fragments` holds one entry per
// fragment whose first sync has been applied (its anchor over the fragment's tensors and, once
// set, its momentum), and `pending` the fragments' background all-reduces started but not yet
// applied (sync_delay > 0), with their results: state_dict() waits for them to end.
struct FragmentState {
  int level = 0;
  int fragment = 0;
  std::vector<StateTensor> anchor;    // the fragment's tensors, in order
  std::vector<StateTensor> momentum;  // empty until an outer step has set it
  // Error feedback (Level.error_feedback): the member's residual E, float32, the fragment's
  // tensors in order; empty until an outer step has kept one.
  std::vector<StateTensor> residual;
};
struct PendingState {
  int level = 0;
  int fragment = 0;
  int64_t start_step = 0;  // the sync step that started it
  int64_t apply_step = 0;  // start_step + sync_delay
  // The fragment's first sync: `result` is the group's mean of the parameters (the anchor's
  // first value); otherwise the group's mean pseudo-gradient (in the payload's precision).
  bool first = false;
  std::vector<StateTensor> result;
  // Not empty when the all-reduce failed: load_state_dict() refuses such a state.
  std::string error;
};
struct AveragerState {
  int64_t step = 0;
  std::map<int, std::vector<StateTensor>> anchors;  // level index -> tensors
  std::map<int, std::vector<StateTensor>> momenta;  // level index -> tensors
  std::vector<FragmentState> fragments;             // streaming outer levels
  std::vector<PendingState> pending;                // streaming outer levels, sync_delay > 0
};

class ModelAverager {
 public:
  virtual ~ModelAverager();

  ModelAverager(const ModelAverager&) = delete;
  ModelAverager& operator=(const ModelAverager&) = delete;

  // Decides what this rank does at step(), averages `params` in place with its subgroup if the
  // schedule says so, then increments step() — also when the call fails, like PyTorch (a failed
  // call is not retried at the same step; restore a checkpoint with set_step() instead).
  // Returns the decision taken at this call's step.
  // `params` may be empty (nothing to average, the decision is still taken). All tensors must be
  // on one device kind: all host (Gloo over TCP) or all CUDA on one device (NCCL).
  // Errors: INVALID_ARGUMENT (null data with numel > 0, negative numel, mixed devices; the
  // members of the subgroup passed a different total element count or dtype layout),
  // FAILED_PRECONDITION (the job moved to a new generation — a peer died, left or re-joined —
  // or this client left; re-join with a new Client), DEADLINE_EXCEEDED (a peer did not take part
  // within collective_timeout), UNAVAILABLE (a peer's connection broke and the coordinator has
  // not yet declared it dead, or the coordinator is unreachable), UNIMPLEMENTED (CUDA tensors in
  // a build without CUDA), INTERNAL (other transport/CUDA failures; the message has the cause).
  absl::StatusOr<Decision> AverageParameters(absl::Span<const TensorView> params);

  // Whether the call at `step` needs the parameters even when the schedule skips that step: a
  // fragment's background all-reduce is due then (streaming sync with sync_delay), and the call
  // applies it to the parameters it is passed. Callers that pass no parameters on skip steps
  // must pass them when this is true.
  bool NeedsParametersAt(int64_t step) const;

  // The step of the next AverageParameters call.
  int64_t step() const;
  // Sets the step of the next call (checkpoint restore; warm-up is not replayed). A negative
  // step is logged as a warning and taken as 0.
  void set_step(int64_t step);

  // The step and every outer level's anchor and momentum (host copies), to checkpoint beside
  // the model: restoring them with load_state_dict() in a new process (same job spec, same
  // parameter list) continues exactly as an uninterrupted run. Streaming levels: per fragment,
  // and the background all-reduces not applied yet, which this call waits for (at most the
  // collective timeout; one that has not ended by then is aborted and saved as failed).
  AveragerState state_dict() const;
  // Restores a state_dict(): the step (as set_step) and the outer state. Levels absent from
  // `state.anchors` start without an anchor (their next averaging step must be their first).
  // Errors: INVALID_ARGUMENT (a level that is not an outer level of this job; tensors that do
  // not fit each other: counts, dtypes, byte sizes; momenta for a level without momentum or
  // without an anchor; whole-level anchors for a streaming level or fragments for another;
  // a fragment or a pending sync that the level's spec does not have), FAILED_PRECONDITION (a
  // pending sync that had failed). Nothing changes on an error. A background all-reduce of
  // this averager still in flight is abandoned.
  absl::Status load_state_dict(const AveragerState& state);

  Client* client() const { return client_; }
  const AveragerOptions& options() const { return options_; }

  // A paced job counted in rounds (docs/paced.md: the plan's last level paced, with
  // ScheduleLevel::rounds R > 0): true once this member's call completed round R - 1 of that
  // level (its decision's `round`), the last round the job averages; the trainer stops there.
  // False before, and always false for a job without such a level. A restore (set_step,
  // load_state_dict) makes it false again until the round is completed anew.
  bool budget_spent() const;

  // Per level (index into the job's levels): the bytes this member has sent in the level's
  // averaging rounds (the communicators' count, see Communicator::bytes_sent), and how long
  // averaging calls waited for a fragment's background all-reduce (streaming sync,
  // docs/streaming.md; zero without sync_delay).
  struct LevelTraffic {
    int64_t bytes_sent = 0;
    absl::Duration waited = absl::ZeroDuration();
  };
  std::vector<LevelTraffic> traffic() const;

 protected:
  ModelAverager(Client* client, AveragerOptions options);

 private:
  // What an averaging call goes through (client/averaging/): the round of a decision (strict or
  // elastic: RoundRunner), the outer levels (OuterLevel), the streaming levels
  // (StreamingLevel), the checkpoint (Checkpoint), each with its own state, all used under mu_.
  class Parts;

  // AverageParameters under mu_ (the call's compute pace is marked around it).
  absl::StatusOr<Decision> Average(absl::Span<const TensorView> params);

  Client* const client_;
  const AveragerOptions options_;
  mutable absl::Mutex mu_;
  std::unique_ptr<Parts> parts_ ABSL_PT_GUARDED_BY(mu_);
  // See budget_spent().
  bool budget_spent_ ABSL_GUARDED_BY(mu_) = false;
};

// PyTorch's PeriodicModelAverager: the job must be PERIODIC (one level over the whole world,
// average at s >= warmup_steps with (s - warmup_steps) % period == 0).
class PeriodicModelAverager : public ModelAverager {
 public:
  // Errors: INVALID_ARGUMENT (null client), FAILED_PRECONDITION (the job is HIERARCHICAL: use
  // HierarchicalModelAverager).
  static absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> Create(
      Client* client, AveragerOptions options = AveragerOptions());

 private:
  using ModelAverager::ModelAverager;
};

// PyTorch's HierarchicalModelAverager: the job must be HIERARCHICAL (at s >= warmup_steps the
// last level, in the spec's order, whose period divides s averages within its subgroup).
class HierarchicalModelAverager : public ModelAverager {
 public:
  // Errors: INVALID_ARGUMENT (null client), FAILED_PRECONDITION (the job is PERIODIC: use
  // PeriodicModelAverager).
  static absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> Create(
      Client* client, AveragerOptions options = AveragerOptions());

 private:
  using ModelAverager::ModelAverager;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGER_H_
