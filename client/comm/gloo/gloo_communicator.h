// Averaging of host tensors over Gloo's TCP transport: the collectives (the mesh below them,
// its set-up and teardown, is gloo_mesh.h). Every Gloo exception stops here and becomes an
// absl::Status; every wait is bounded by the communicator's timeout, so a dead peer ends in an
// error, never a hang.
#ifndef MODELAVG_CLIENT_COMM_GLOO_GLOO_COMMUNICATOR_H_
#define MODELAVG_CLIENT_COMM_GLOO_GLOO_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <sys/socket.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/gloo/gloo_mesh.h"  // CreateGlooDevice, IgnoreDefaultSigpipe; gloo's declarations

namespace modelavg::client {

class GlooCommunicator : public Communicator {
 public:
  // Creates the full mesh of `size` members through `store` (every member must call this with
  // its own `rank`) on `device` (see CreateGlooDevice). `timeout` bounds the rendezvous and
  // every later collective. `store_error`, when set, gives the cause of a store failure (its
  // status code is kept: ABORTED, FAILED_PRECONDITION, ...). `in_place`: see
  // ClientOptions::gloo_in_place. `cancel` (may be null) cancels the set-up from another
  // thread: every wait of it (the rendezvous, each pair's connection, the first collective)
  // ends at once with the cancel's reason. The mesh is connected by modelavg (not Gloo's
  // connectFullMesh, whose connect waits cannot be interrupted), and the whole set-up ends at
  // `timeout` in any case.
  // Errors: INVALID_ARGUMENT (rank/size), DEADLINE_EXCEEDED (a member did not arrive in time;
  // ErrorKind::kTimeout), UNAVAILABLE (a member could not be reached: kStrayConnection when
  // its port refused or dropped this member's connection, kPeerFailure otherwise), the store's
  // error, the cancel's reason, INTERNAL (other Gloo failures).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
      int size, absl::Duration timeout, std::function<absl::Status()> store_error = nullptr,
      bool in_place = false, std::shared_ptr<SetupCanceller> cancel = nullptr,
      std::shared_ptr<FaultInjection> faults = nullptr);

  ~GlooCommunicator() override;

  // One SUM all-reduce whose last reduction of each segment also divides by size(), so the
  // average costs no pass of its own (PyTorch divides first; the results agree to rounding,
  // exactly for power-of-two groups). When the tensors form one float32/float64 buffer (one
  // tensor, or back to back) it is reduced in place; each segment is saved to a backup as the
  // ring first touches it (while in cache) and restored if the collective fails (no backup with
  // in_place). Otherwise every tensor is packed
  // (converted) into one flat staging buffer, reduced, and copied back on success.
  // The first call, and any call whose layout (total element count, staging dtype) differs
  // from the last verified one, first checks that every member passes the same layout.
  // With options.commit the result is confirmed by a one-element all-reduce before it is kept
  // (see RoundOptions); a member that does not contribute (a replacement at its admission)
  // reduces zeros, and the division is by options.contributors. options.step is checked with
  // the layout on the communicator's first call.
  // Errors as Communicator::AllReduceAverage; UNAVAILABLE when a peer's connection broke.
  using Communicator::AllReduceAverage;
  absl::Status AllReduceAverage(absl::Span<const TensorView> tensors, const RoundOptions& options,
                                RoundOutcome* outcome) override;
  absl::Status AdoptPendingResult(absl::Span<const TensorView> tensors) override;

  // A plain in-place SUM all-reduce of one float32 or float64 buffer, for baselines.
  absl::Status AllReduceSum(void* data, int64_t numel, DType dtype);

  // Breaks a collective blocked in another thread: every pair of the mesh is failed at the
  // transport (its pending sends and receives are woken with an error and its socket closed, so
  // the peers' collectives on this mesh fail as well). The blocked call restores its tensors
  // from the backup (the in-place mode leaves them undefined, as on any failure) and returns
  // `why`, as does every later call.
  void Abort(const absl::Status& why) override;

  // A TCP connect to each member's data address, all at once: a connection or a refusal (the
  // pair's listening port closes once the mesh is up) is an answer; no answer within `timeout`
  // or an unreachable network is none.
  absl::StatusOr<std::vector<PeerReach>> ProbePeers(absl::Duration timeout) override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int64_t bytes_sent() const override {
    absl::MutexLock l(&mu_);
    return bytes_sent_;
  }
  // Whether averaging fuses the division into Gloo's ring (false: a separate pass).
  bool fused() const {
    absl::MutexLock l(&mu_);
    return fused_;
  }

 private:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::shared_ptr<MeshWaits> waits,
                   int rank, int size, absl::Duration timeout, bool in_place);
  // Averages `data` (numel elements) in place: Gloo's ring SUM all-reduce with the division
  // by `divisor` fused into each segment's last reduction. With `backup` (numel elements),
  // `data` is restored on failure. With `commit`, the members then confirm (Commit); when that
  // fails, the result is moved to pending_ and `data` restored (*holding set).
  absl::Status RunAverage(void* data, int64_t numel, DType dtype, void* backup,
                          size_t max_segment, int divisor, bool commit = false,
                          bool* holding = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The second phase of a committed round: a one-element all-reduce that succeeds only if
  // every member's data all-reduce did.
  absl::Status Commit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks, with a small all-reduce, that the fused division lands where expected on this Gloo
  // build; otherwise averaging uses the staging path with a separate division. Errors: the
  // transport's.
  absl::Status ProbeFusedAverage();
  // Every member's (total numel, staging dtype, signature) must be equal, and so must `step`
  // (-1: any).
  absl::Status CheckLayout(int64_t numel, DType dtype, int64_t step = -1, int64_t signature = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether CheckLayout passed for this layout before.
  bool LayoutVerified(int64_t numel, DType dtype, int64_t signature) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The three ways of AllReduceAverage, for a round of `total` elements of staging `dtype` that
  // passed the layout check: a compressed payload (packed, RunCompressed); one contributing
  // buffer with the division fused (RunAverage in place, with a backup unless in_place_ in a
  // plain round); anything else through the staging buffer (packed, reduced, unpacked on
  // success). Each sets *outcome and breaks the communicator on a transport failure.
  absl::Status AverageCompressed(absl::Span<const TensorView> tensors, const RoundOptions& options,
                                 int64_t total, DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AverageInPlace(void* single, const RoundOptions& options, int64_t total,
                              DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AverageStaged(absl::Span<const TensorView> tensors, const RoundOptions& options,
                             int64_t total, DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records that pending_ now holds a result kept aside by a failed commit: `packed` (the
  // staging layout) or one buffer's raw bytes, of numel elements of dtype.
  void KeepPending(bool packed, int64_t numel, DType dtype) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The compressed average of the float32 buffer `data` (numel elements): every member's chunk
  // j of the encoded buffer goes to member j (all-to-all), which sums the decoded chunks in
  // float32, divides by `divisor` and encodes the result; an all-gather of the encoded results
  // gives every member the same decoded average in `out` (`data` is only read).
  absl::Status RunCompressed(const float* data, int64_t numel, Payload payload, int divisor,
                             float* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RunSum(void* data, int64_t numel, DType dtype) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Throws (a gloo::IoException, as a broken pair does) once Abort ended the mesh's waits: a
  // collective that returned after that is incomplete. Called after every collective.
  void ThrowIfAborted() const;
  // The abort reason when Abort was called, `failure` otherwise.
  absl::Status AbortedOr(absl::Status failure) const;
  // Fails every pair of the mesh with `msg` (their pending operations wake with an error and
  // the sockets close, so the peers' collectives fail too). Thread-safe.
  void CloseMesh(const std::string& msg);
  // Marks the communicator broken after a transport failure (the abort reason wins) and closes
  // the mesh. Returns the status to report.
  absl::Status Break(const absl::Status& failure) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<gloo::Context> context_;
  // The waits of the mesh's collectives, which Abort ends (the pairs' failure misses some).
  const std::shared_ptr<MeshWaits> waits_;
  // Each member's data address (its pair's, for this member), for ProbePeers; empty where the
  // transport is not TCP. Set once by Create.
  std::vector<sockaddr_storage> peer_addresses_;
  const int rank_;
  const int size_;
  const absl::Duration timeout_;
  const bool in_place_;
  // Guards only aborted_: taken by Abort while mu_ is held by the collective it breaks.
  mutable absl::Mutex abort_mu_;
  absl::Status aborted_ ABSL_GUARDED_BY(abort_mu_);
  mutable absl::Mutex mu_;
  // Whether the division can be fused into Gloo's ring (ProbeFusedAverage).
  bool fused_ ABSL_GUARDED_BY(mu_) = false;
  // The step of the round in progress (RoundOptions::step), for the fault seam's lost commit.
  int64_t round_step_ ABSL_GUARDED_BY(mu_) = -1;
  // Non-OK once a collective failed: the mesh is then in an unknown state.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool layout_checked_ ABSL_GUARDED_BY(mu_) = false;
  int64_t checked_numel_ ABSL_GUARDED_BY(mu_) = 0;
  DType checked_dtype_ ABSL_GUARDED_BY(mu_) = DType::kFloat32;
  // Every (numel, dtype, signature) that passed CheckLayout (a fragmented level alternates
  // between a few layouts; each is agreed once).
  std::vector<std::tuple<int64_t, DType, int64_t>> verified_layouts_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  // The compressed path's buffers (RunCompressed).
  std::vector<uint8_t> wire_send_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> wire_recv_ ABSL_GUARDED_BY(mu_);
  std::vector<float> chunk_ ABSL_GUARDED_BY(mu_);
  // Persistent staging (doubles keep it aligned for either staging dtype).
  std::vector<double> staging_ ABSL_GUARDED_BY(mu_);
  // Whether the step of a round has been checked (the first call with a step).
  bool step_checked_ ABSL_GUARDED_BY(mu_) = false;
  // A result kept aside by a failed commit: the raw bytes of one buffer, or the packed staging
  // (pending_packed_), for numel elements of dtype.
  std::vector<double> pending_ ABSL_GUARDED_BY(mu_);
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool pending_packed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pending_numel_ ABSL_GUARDED_BY(mu_) = 0;
  DType pending_dtype_ ABSL_GUARDED_BY(mu_) = DType::kFloat32;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_GLOO_COMMUNICATOR_H_
