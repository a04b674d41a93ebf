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

struct CommunicatorSetup;
struct RoundOptions;
class Communicator;
class OuterLevelState;
class OuterBuffer;
class NcclDeviceOps;
class GrowableBuffer;
class DeviceOuterState;
class OwnedDeviceBuffer;

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

struct PendingSync;

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
  // AverageParameters under mu_ (the caller records a failure on the client).
  absl::StatusOr<Decision> AverageStep(absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Longest wait for the job to move on after a failed round of an elastic job.
  absl::Duration RetryWait() const;
  // How the communicator of `decision`'s round is bootstrapped.
  CommunicatorSetup Setup(const Decision& decision) const;
  // An averaging step of an elastic job (averager_elastic.cc): the round, retried with the live
  // members of the next generation when it fails (see AverageParameters). `transfer`: an admission round hands the
  // replacements the outer state first (TransferOuterState).
  absl::StatusOr<Decision> AverageElastic(Decision decision, const Device& device,
                                          absl::Span<const TensorView> params,
                                          bool transfer = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The steps of AverageElastic (averager_elastic.cc). One attempt of the round in decision.generation:
  // the communicator, the transfer, the committed all-reduce, its outcome in the round notes.
  // A non-OK result is final (this rank is no member, nobody can give a replacement the
  // parameters); a failure of the round itself is the attempt's status.
  struct ElasticAttempt;
  absl::StatusOr<ElasticAttempt> RunElasticAttempt(const Decision& decision,
                                                   const Device& device,
                                                   absl::Span<const TensorView> params,
                                                   bool transfer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // This rank's options for `decision`'s committed round (contributing unless it is joining).
  absl::StatusOr<RoundOptions> ElasticRoundOptions(const Decision& decision) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The round succeeded: logs a retried or admission round, drops older communicators.
  Decision CommitElasticRound(const Decision& decision, int attempt);
  // Waits for the job to move past `generation`, enters the newer generation and decides `step`
  // there. DEADLINE_EXCEEDED when the job does not move on within RetryWait().
  absl::StatusOr<Decision> MoveOn(int64_t generation, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // MoveOn after the round of `failed` failed with `why`: the error names both.
  absl::StatusOr<Decision> MoveOnAfterFailure(const Decision& failed, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a live peer completed the failed round (the round notes of next->generation); while
  // the job moves on during the read, moves on again, updating *next and counting *attempt.
  absl::StatusOr<bool> PeerCompletedAttempt(const Decision& failed, Decision* next, int* attempt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A peer completed the round whose confirmation this rank lost: keep the result it holds.
  absl::Status AdoptLostCommit(const Decision& decision, const ElasticAttempt& tried,
                               absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a failed round: probes its peers and reports those that do not answer (a gray
  // failure) to the coordinator.
  void ReportUnreachablePeersOf(const Decision& decision, Communicator* comm,
                                const absl::Status& failure) const;
  // Client::AdvanceGeneration, once no background all-reduce of an older generation is in
  // flight (its outcome must be in the round note published there).
  absl::Status EnterNewerGeneration() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts the background all-reduces of generations before `generation` and waits for them to
  // end (averager_streaming.cc); their outcomes are in the round notes then.
  void EndBackgroundRoundsBefore(int64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Elastic jobs: the call at a background all-reduce's apply step found it failed. Settles it
  // as AverageElastic settles a failed round, in this call: keeps the result it holds if a live
  // peer completed it, else runs it again with the sync step's live members and the same
  // inputs (averager_streaming.cc).
  absl::Status SettleBackgroundRound(PendingSync& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // One round of `decision` on `tensors` (the parameters, or an outer step's pseudo-gradient):
  // strict or elastic, with the error handling of AverageParameters.
  absl::StatusOr<Decision> Round(const Decision& decision, const Device& device,
                                 absl::Span<const TensorView> tensors)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An admission round of an elastic job (decision.joining not empty; averager_outer.cc):
  // every replacement receives, for each outer level, the anchor and momentum of the lowest
  // contributing member of its block at that level, through `comm` before the step's own
  // round. `layout`: the round's tensors (their state layout is the outer state's).
  absl::Status TransferOuterState(const Decision& decision, Communicator* comm,
                                  absl::Span<const TensorView> layout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An admission at a streaming outer level's step: the replacements receive the mean of the
  // contributing members' parameters (round_params_), which stay as they are
  // (averager_streaming.cc).
  absl::Status TransferParameters(const Decision& decision, Communicator* comm)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The record of a sync of `decision`'s fragment that starts now and is applied at its step
  // plus the level's sync_delay (host and device syncs alike).
  std::unique_ptr<PendingSync> NewPendingSync(const Decision& decision, OuterLevelState* state,
                                              bool first) const;
  // Streaming sync with a delay (averager_streaming.cc): starts the fragment's all-reduce on a
  // background thread and returns; ApplyPending, at the call of the apply step (before that
  // step's own decision), waits for it and applies it to the parameters passed then. CUDA
  // parameters go on to StartDevicePending.
  absl::StatusOr<Decision> StartPending(const Decision& decision, const Device& device,
                                        absl::Span<const TensorView> fragment,
                                        OuterLevelState* state, bool first)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyPending(int64_t step, absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ApplyOne(std::unique_ptr<PendingSync> p, int64_t step,
                        absl::Span<const TensorView> params) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Aborts and joins a background all-reduce (destruction).
  void AbandonPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // state_dict / load_state_dict of the streaming levels (averager_streaming.cc). The loader
  // builds into `states` and `pending` (swapped in by the caller once everything fits).
  void StreamingStateInto(AveragerState* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status LoadStreamingState(
      const AveragerState& state,
      std::vector<std::vector<std::unique_ptr<OuterLevelState>>>* states,
      std::vector<std::unique_ptr<PendingSync>>* pending) const;
  void CountBytes(int level, int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (level < 0) return;
    if (traffic_.size() <= static_cast<size_t>(level)) traffic_.resize(level + 1);
    traffic_[level].bytes_sent += bytes;
  }
  // An averaging step of an outer level with streaming fields (fragments > 1, mix, a
  // compressed payload; docs/streaming.md): the outer step on the tensors of the decision's
  // fragment, each fragment with its own outer state. averager_streaming.cc.
  absl::StatusOr<Decision> StreamingOuterRound(const Decision& decision, const Device& device,
                                               absl::Span<const TensorView> fragment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StreamingOuterRound on CUDA parameters (averager_streaming_device.cc): `state` is the
  // fragment's, `first_sync` the step of the fragment's first sync (-1: unknown).
  absl::StatusOr<Decision> DeviceStreamingRound(const Decision& decision, const Device& device,
                                                absl::Span<const TensorView> fragment,
                                                OuterLevelState* state, bool joining,
                                                int64_t first_sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // StartPending on CUDA parameters (averager_streaming_device.cc): `spec` is the level's,
  // `where` the context of its errors.
  absl::StatusOr<Decision> StartDevicePending(const Decision& decision, const Device& device,
                                              absl::Span<const TensorView> fragment,
                                              OuterLevelState* state, bool first,
                                              const ScheduleLevel& spec, const std::string& where)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ApplyOne's last part on CUDA parameters: the pending sync's result into the fragment.
  absl::Status ApplyDevicePending(PendingSync* p, absl::Span<const TensorView> fragment,
                                  double mix) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An averaging step of a level with an outer optimizer (docs/diloco.md; averager_outer.cc).
  absl::StatusOr<Decision> OuterRound(const Decision& decision, const Device& device,
                                      absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CUDA parameters: the device operations of the outer state (created at the first use, on
  // `device`), and `state`'s device state (attached at its first CUDA step).
  absl::StatusOr<NcclDeviceOps*> DeviceOps(const Device& device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<DeviceOuterState*> DeviceState(OuterLevelState* state, const Device& device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Client* const client_;
  const AveragerOptions options_;
  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  // CUDA parameters with outer levels: the device operations the outer state runs on (declared
  // before outer_, so that the states are freed first) and the pseudo-gradient on the device.
  std::unique_ptr<NcclDeviceOps> device_ops_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<GrowableBuffer> device_gradient_ ABSL_GUARDED_BY(mu_);
  // A streaming level's copy of the parameters on the device (x_local of a mix).
  std::unique_ptr<OwnedDeviceBuffer> device_local_ ABSL_GUARDED_BY(mu_);
  // Per level: its outer state, or null for a plain level.
  std::vector<std::unique_ptr<OuterLevelState>> outer_ ABSL_GUARDED_BY(mu_);
  // The pseudo-gradient of an outer step (shared by the levels: one step runs at a time).
  std::unique_ptr<OuterBuffer> pseudo_gradient_ ABSL_GUARDED_BY(mu_);
  // Streaming sync: per level, per fragment, the outer state of a streaming outer level (empty
  // for other levels).
  std::vector<std::vector<std::unique_ptr<OuterLevelState>>> fragment_outer_ ABSL_GUARDED_BY(mu_);
  // The current round's payload and fragment-split signature (RoundOptions), set around a
  // round by the streaming code.
  Payload round_payload_ ABSL_GUARDED_BY(mu_) = Payload::kFp32;
  int64_t round_signature_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<LevelTraffic> traffic_ ABSL_GUARDED_BY(mu_);
  // The parameters of the AverageParameters call in progress (valid during the call only).
  absl::Span<const TensorView> round_params_ ABSL_GUARDED_BY(mu_);
  // Background all-reduces not applied yet (at most one per streaming level), in start order.
  std::vector<std::unique_ptr<PendingSync>> pending_ ABSL_GUARDED_BY(mu_);
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
