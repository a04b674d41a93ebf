// Faults a test asks of a client's communicators, made from outside the library: a
// FaultyCommunicator wraps a real communicator (Gloo or NCCL) and a FaultyCommunicatorFactory
// wraps the factory a Client makes them with (Client::Connect takes it), so that a fault
// reaches whatever backend a round runs on without a switch inside the product.
//
//   auto faults = std::make_shared<CommunicatorFaults>();
//   faults->LoseCommitAt(10);
//   auto client = Client::Connect(options, std::make_unique<FaultyCommunicatorFactory>(
//       std::make_unique<BackendFactory>(options.gloo_hostname), faults));
#ifndef MODELAVG_TESTS_TESTING_FAULTY_COMMUNICATOR_H_
#define MODELAVG_TESTS_TESTING_FAULTY_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/comm/communicator.h"
#include "client/comm/communicator_factory.h"
#include "modelavg/client/tensor.h"
#include "tests/testing/stray_connection_store.h"

namespace modelavg::testing {

// The faults a test asks for; each is taken once, where it happens. Thread-safe.
class CommunicatorFaults {
 public:
  // LoseCommitAt: the next committed round, whatever its step.
  static constexpr int64_t kAnyStep = -2;

  // The next committed round at `step` (RoundOptions::step; kAnyStep: the next one) loses this
  // member's confirmation after it succeeded everywhere, as when this member's last receive
  // breaks while its peers complete: the member's tensors stay as they were, it holds the
  // result (RoundOutcome::kFailedHoldingResult, UNAVAILABLE) and its communicator is broken.
  void LoseCommitAt(int64_t step);
  // At the next set-up of a Gloo mesh (host memory), something that is not a member (a port
  // scanner, a misdirected client) connects to the port of a peer this member connects to,
  // ahead of it, and stays: the peer's transport takes the stray for this member.
  void StrayConnectionFirst();

  // Whether the committed round at `step` is to lose its confirmation (not taken yet).
  bool LostCommitDue(int64_t step) const;
  // The same, taken: true once.
  bool TakeLostCommit(int64_t step);
  // Whether this set-up is to meet a stray connection: true once.
  bool TakeStrayConnection();

 private:
  static constexpr int64_t kNone = -1;
  mutable absl::Mutex mu_;
  int64_t lose_commit_step_ ABSL_GUARDED_BY(mu_) = kNone;
  bool stray_first_ ABSL_GUARDED_BY(mu_) = false;
};

// A communicator that runs every round on `inner` and takes the faults of `faults` there.
// Tensors on a CUDA device need a build with CUDA (the undoing of a round copies them).
class FaultyCommunicator : public client::Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<client::Communicator> inner,
                     std::shared_ptr<CommunicatorFaults> faults);

  using client::Communicator::AllReduceAverage;
  // inner's round; a lost commit (CommunicatorFaults::LoseCommitAt) is made by undoing, on this
  // member only, a round that completed: the result is kept aside, the tensors written back as
  // they were, and inner aborted (its peers' next collective fails, as after a real failure).
  absl::Status AllReduceAverage(absl::Span<const client::TensorView> tensors,
                                const client::RoundOptions& options,
                                client::RoundOutcome* outcome) override;
  // The result a lost commit kept aside, or else inner's.
  absl::Status AdoptPendingResult(absl::Span<const client::TensorView> tensors) override;
  void Abort(const absl::Status& why) override { inner_->Abort(why); }
  int64_t bytes_sent() const override { return inner_->bytes_sent(); }
  absl::StatusOr<std::vector<client::PeerReach>> ProbePeers(absl::Duration timeout) override {
    return inner_->ProbePeers(timeout);
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  client::Communicator* inner() const { return inner_.get(); }

 private:
  const std::unique_ptr<client::Communicator> inner_;
  const std::shared_ptr<CommunicatorFaults> faults_;
  absl::Mutex mu_;
  // Non-OK after a lost commit: every later round fails with it.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // The result a lost commit kept aside, one string of bytes per tensor; empty: none.
  std::vector<std::string> kept_ ABSL_GUARDED_BY(mu_);
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
};

// Makes each communicator with `inner` and wraps it in a FaultyCommunicator over `faults`. A
// Gloo set-up that is to meet a stray connection (CommunicatorFaults::StrayConnectionFirst) is
// made here instead, as the library's own backends make it (a GlooCommunicator on a TCP device
// bound to `gloo_hostname`, over the coordinator's rendezvous store), with the store seen
// through a StrayConnectionStore; its strays stay open as long as this factory.
class FaultyCommunicatorFactory : public client::CommunicatorFactory {
 public:
  FaultyCommunicatorFactory(std::unique_ptr<client::CommunicatorFactory> inner,
                            std::shared_ptr<CommunicatorFaults> faults,
                            std::string gloo_hostname = "127.0.0.1",
                            StrayKind stray_kind = StrayKind::kSilent);

  absl::StatusOr<std::unique_ptr<client::Communicator>> Create(
      const client::CommunicatorSetup& setup, const client::Device& device) override;

 private:
  absl::StatusOr<std::unique_ptr<client::Communicator>> CreateGlooWithStray(
      const client::CommunicatorSetup& setup);

  const std::unique_ptr<client::CommunicatorFactory> inner_;
  const std::shared_ptr<CommunicatorFaults> faults_;
  const std::string gloo_hostname_;
  const StrayKind stray_kind_;
  StrayConnections strays_;
};

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_TESTING_FAULTY_COMMUNICATOR_H_
