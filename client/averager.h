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
#ifndef MODELAVG_CLIENT_AVERAGER_H_
#define MODELAVG_CLIENT_AVERAGER_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

struct CommunicatorSetup;

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

  // The step of the next AverageParameters call.
  int64_t step() const;
  // Sets the step of the next call (checkpoint restore; warm-up is not replayed). A negative
  // step is logged as a warning and taken as 0.
  void set_step(int64_t step);

  Client* client() const { return client_; }

 protected:
  explicit ModelAverager(Client* client);

 private:
  // AverageParameters under mu_ (the caller records a failure on the client).
  absl::StatusOr<Decision> AverageStep(absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Longest wait for the job to move on after a failed round of an elastic job.
  absl::Duration RetryWait() const;
  // How the communicator of `decision`'s round is bootstrapped.
  CommunicatorSetup Setup(const Decision& decision) const;
  // An averaging step of an elastic job: the round, retried with the live members of the next
  // generation when it fails (see AverageParameters).
  absl::StatusOr<Decision> AverageElastic(Decision decision, const Device& device,
                                          absl::Span<const TensorView> params)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Client* const client_;
  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
};

// PyTorch's PeriodicModelAverager: the job must be PERIODIC (one level over the whole world,
// average at s >= warmup_steps with (s - warmup_steps) % period == 0).
class PeriodicModelAverager : public ModelAverager {
 public:
  // Errors: INVALID_ARGUMENT (null client), FAILED_PRECONDITION (the job is HIERARCHICAL: use
  // HierarchicalModelAverager).
  static absl::StatusOr<std::unique_ptr<PeriodicModelAverager>> Create(Client* client);

 private:
  using ModelAverager::ModelAverager;
};

// PyTorch's HierarchicalModelAverager: the job must be HIERARCHICAL (at s >= warmup_steps the
// last level, in the spec's order, whose period divides s averages within its subgroup).
class HierarchicalModelAverager : public ModelAverager {
 public:
  // Errors: INVALID_ARGUMENT (null client), FAILED_PRECONDITION (the job is PERIODIC: use
  // PeriodicModelAverager).
  static absl::StatusOr<std::unique_ptr<HierarchicalModelAverager>> Create(Client* client);

 private:
  using ModelAverager::ModelAverager;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGER_H_
