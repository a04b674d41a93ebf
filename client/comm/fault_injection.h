// The client library's one test seam: faults a test asks for, taken where they happen (a
// communicator's all-reduce and its commit). Nothing in the library asks for a fault; tests
// and the trace worker do, through Client::faults() or Communicator::set_faults(), so that a
// fault reaches any communicator, whatever its backend, without a hook in each class.
#ifndef MODELAVG_CLIENT_COMM_FAULT_INJECTION_H_
#define MODELAVG_CLIENT_COMM_FAULT_INJECTION_H_

#include <sys/socket.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace modelavg::client {

class FaultInjection {
 public:
  // LoseCommitAt: the next committed round, whatever its step.
  static constexpr int64_t kAnyStep = -2;

  // The next committed round at `step` (RoundOptions::step; kAnyStep: the next one) loses this
  // member's confirmation after it succeeded everywhere, as when this member's last receive
  // breaks while its peers complete: the member holds the result (kFailedHoldingResult).
  void LoseCommitAt(int64_t step) {
    absl::MutexLock l(&mu_);
    lose_commit_step_ = step;
  }
  // The next averaging all-reduce (Gloo) fails after `n` reductions on this member.
  void FailAfterReductions(int n) {
    absl::MutexLock l(&mu_);
    fail_after_reductions_ = n;
  }
  // At the next Gloo mesh set-up, before this member connects a pair to its peer's port,
  // something else connects to that port first and stays (a port scanner, a misdirected
  // client): the peer's transport takes the stray for this member.
  void StrayConnectionFirst() {
    absl::MutexLock l(&mu_);
    stray_first_ = true;
  }

  // Shorthands: a seam that loses the next committed round's confirmation, or fails the next
  // all-reduce after `n` reductions.
  static std::shared_ptr<FaultInjection> LosingNextCommit() {
    auto f = std::make_shared<FaultInjection>();
    f->LoseCommitAt(kAnyStep);
    return f;
  }
  static std::shared_ptr<FaultInjection> FailingAfterReductions(int n) {
    auto f = std::make_shared<FaultInjection>();
    f->FailAfterReductions(n);
    return f;
  }

  // Taken by the communicators: true once, for the round the test named.
  bool TakeLostCommit(int64_t step) {
    absl::MutexLock l(&mu_);
    if (lose_commit_step_ == kNone) return false;
    if (lose_commit_step_ != kAnyStep && lose_commit_step_ != step) return false;
    lose_commit_step_ = kNone;
    return true;
  }
  // -1: none asked for.
  int TakeFailAfterReductions() {
    absl::MutexLock l(&mu_);
    const int n = fail_after_reductions_;
    fail_after_reductions_ = -1;
    return n;
  }
  // Called by the Gloo mesh set-up before it connects to `peer`: when StrayConnectionFirst was
  // asked for, connects a socket of the seam's to `peer`, holds it open (until the seam goes)
  // and gives the peer's transport 200 ms to take it. Once.
  void MaybeStrayConnectTo(const sockaddr_storage& peer);

  ~FaultInjection();

 private:
  static constexpr int64_t kNone = -1;
  absl::Mutex mu_;
  int64_t lose_commit_step_ ABSL_GUARDED_BY(mu_) = kNone;
  int fail_after_reductions_ ABSL_GUARDED_BY(mu_) = -1;
  bool stray_first_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> strays_ ABSL_GUARDED_BY(mu_);  // descriptors held open
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_FAULT_INJECTION_H_
