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
#include <vector>

#include <sys/socket.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/payload/payload_codec.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"
#include "client/comm/round_agreement.h"
#include "client/comm/gloo/gloo_exchange.h"
#include "client/comm/gloo/gloo_mesh.h"  // CreateGlooDevice, IgnoreDefaultSigpipe; gloo's declarations

namespace modelavg::client {

// Which algorithm averages a round, by the round's bytes and the members' number (the same on
// every member: both are agreed). The defaults are what measured fastest on loopback and on
// the LAN (docs/benchmarks.md, "Where the time goes").
struct GlooAlgorithms {
  // Two members: the direct exchange (gloo_exchange.h) at every size — the ring's bytes in one
  // hop instead of two, and no unpacking copy. False: Gloo's ring.
  bool direct_pairs = true;
  // More members: the direct exchange up to this many bytes (it sends n - 1 times the buffer in
  // one hop; the ring 2 (n - 1) / n times, in 2 (n - 1) hops), then the scatter-gather exchange
  // (ScatterGatherAverage: the ring's bytes in 2 hops, but not the ring's locality across
  // sites: ClientOptions::gloo_scatter_max_bytes) up to scatter_max_bytes, Gloo's ring above.
  int64_t direct_max_bytes = 256 * 1024;
  int64_t scatter_max_bytes = 0;
};

class GlooCommunicator : public Communicator {
 public:
  // Creates the full mesh of `size` members through `store` (every member must call this with
  // its own `rank`) on `device` (see CreateGlooDevice). `timeout` bounds the rendezvous and
  // every later collective. `store_error`, when set, gives the cause of a store failure (its
  // status code is kept: ABORTED, FAILED_PRECONDITION, ...). `in_place`: see
  // ClientOptions::gloo_in_place. `cancel` (may be null) cancels the set-up from another
  // thread: every wait of it (the rendezvous, each pair's connection, the first collective)
  // ends at once with the cancel's reason. The mesh is connected by modelavg (not Gloo's
  // connectFullMesh, whose connect waits cannot be interrupted), and each pair proves
  // membership before any collective (ConnectMesh, gloo_mesh.h); the set-up ends at `timeout`,
  // and a pair set up again after a stray connection has `timeout` more per attempt.
  // Errors: INVALID_ARGUMENT (rank/size), DEADLINE_EXCEEDED (a member did not arrive in time;
  // ErrorKind::kTimeout), UNAVAILABLE (a member could not be reached: kStrayConnection when
  // its pair failed to connect or to prove membership four times, kPeerFailure otherwise), the
  // store's error, the cancel's reason, INTERNAL (other Gloo failures).
  // `algorithms`: see GlooAlgorithms (every member must pass the same).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
      int size, absl::Duration timeout, std::function<absl::Status()> store_error = nullptr,
      bool in_place = false, std::shared_ptr<SetupCanceller> cancel = nullptr,
      GlooAlgorithms algorithms = {});

  ~GlooCommunicator() override;

  // CommunicatorSetup::request_new_generation: called with the error when this member fails a
  // round that was not agreed (its layout changed, or its preparation failed), where its peers
  // cannot learn it in band (round_agreement.h). May be empty.
  void SetNewGenerationRequest(std::function<void(const absl::Status&)> request);

  // One collective per round (GlooAlgorithms says which), the division fused into its last
  // reduction of each element, so the average costs no pass of its own (PyTorch divides first;
  // the results agree to rounding, exactly for power-of-two groups):
  //  * the direct exchange (two members; small buffers): every member sends its contribution
  //    to every other, piece by piece, and sums the members' pieces in member order, writing
  //    each piece's mean straight into the tensors. One float32/float64 buffer (one tensor, or
  //    back to back) is sent from where it is, each piece saved to a backup just before its
  //    mean is written (no backup with in_place in a plain round); other tensors are packed
  //    (converted) piece by piece into a staging buffer, which keeps them for a restore.
  //  * Gloo's ring (larger buffers of more members), whose last reduction of each segment
  //    divides: one buffer is reduced in place, each segment saved to a backup as the ring
  //    first touches it (while in cache; none with in_place); other tensors are packed into one
  //    staging buffer, reduced, and copied back on success.
  // A failed collective restores the tensors (except in place without a backup).
  // The round protocol is round_agreement.h's: the members agree on the layout (total element
  // count, staging dtype, divisor, step, fragment split; a local failure is carried in it) at
  // the first call, at every fragment round and when the divisor changes, and compare it
  // locally otherwise. With options.commit the result is confirmed by the commit vote before
  // it is kept (see RoundOptions); a member that does not contribute (a replacement at its
  // admission) reduces zeros, and the division is by options.contributors.
  // Errors as Communicator::AllReduceAverage; UNAVAILABLE when a peer's connection broke;
  // ABORTED when another member failed before the collective (this communicator stays usable).
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
  // Whether a round of `bytes` is averaged by one of modelavg's exchanges (else Gloo's ring),
  // and whether by the scatter-gather one (more than two members, above direct_max_bytes).
  bool Direct(size_t bytes) const {
    return size_ == 2 ? algorithms_.direct_pairs
                      : static_cast<int64_t>(bytes) <= algorithms_.direct_max_bytes ||
                            static_cast<int64_t>(bytes) <= algorithms_.scatter_max_bytes;
  }
  bool ScatterGather(size_t bytes) const {
    return size_ > 2 && static_cast<int64_t>(bytes) > algorithms_.direct_max_bytes &&
           static_cast<int64_t>(bytes) <= algorithms_.scatter_max_bytes;
  }

 private:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::shared_ptr<MeshWaits> waits,
                   int rank, int size, absl::Duration timeout, bool in_place,
                   GlooAlgorithms algorithms);
  // Averages `data` (numel elements) in place: Gloo's ring SUM all-reduce with the division
  // by `divisor` fused into each segment's last reduction. With `backup` (numel elements),
  // `data` is restored on failure. With `commit`, the members then vote (Commit); when that
  // fails, the result is kept aside in pending_ and `data` restored (*holding set).
  absl::Status RunAverage(void* data, int64_t numel, DType dtype, void* backup,
                          size_t max_segment, int divisor, bool commit = false,
                          bool* holding = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The commit vote of a committed round on Gloo's ring: one word from every member to every
  // other (gloo_exchange.h).
  absl::Status Commit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks, with a small all-reduce, that the fused division lands where expected on this Gloo
  // build; otherwise averaging uses the staging path with a separate division. Errors: the
  // transport's.
  absl::Status ProbeFusedAverage();
  // Step 1 of a round (round_agreement.h): `tensors` and `options` as this member's RoundLayout;
  // non-OK when this member cannot take part (carried into the agreement).
  absl::Status PrepareRound(absl::Span<const TensorView> tensors, const RoundOptions& options,
                            RoundLayout* layout) const;
  // Step 2: the agreement when it is due, the local comparison otherwise. Non-OK: the round
  // ends here with that status (the communicator broken where the protocol says so).
  absl::Status AgreeOnRound(absl::Span<const TensorView> tensors, const RoundOptions& options,
                            const RoundLayout& layout, const absl::Status& local)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The protocol's small all-reduces, in place: the agreement's max of the words, the commit
  // vote's sum (`max` false). `what` names it in errors.
  absl::Status AllReduceWords(int64_t* words, size_t n, bool max, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ways of AllReduceAverage, for a round of `total` elements of staging `dtype` that
  // passed the layout check: a compressed payload (packed, RunCompressed); the direct exchange
  // (AverageDirect; with the finite check, every member's code travels as one word after its
  // pieces and is known before any piece is written); on Gloo's ring, one contributing buffer with the division fused
  // (RunAverage in place, with a backup unless in_place_ in a plain round), anything else
  // through the staging buffer (packed, reduced, unpacked on success). Each sets *outcome and
  // breaks the communicator on a transport failure.
  absl::Status AverageDirect(absl::Span<const TensorView> tensors, const RoundOptions& options,
                             int64_t total, DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AverageCompressed(absl::Span<const TensorView> tensors, const RoundOptions& options,
                                 int64_t total, DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AverageInPlace(void* single, const RoundOptions& options, int64_t total,
                              DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AverageStaged(absl::Span<const TensorView> tensors, const RoundOptions& options,
                             int64_t total, DType dtype, int divisor, RoundOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The compressed average of the float32 buffer `data` (numel elements): every member's chunk
  // j of the encoded buffer goes to member j (all-to-all), which sums the decoded chunks in
  // float32, divides by `divisor` and encodes the result; an all-gather of the encoded results
  // gives every member the same decoded average in `out` (`data` is only read). With `codes`,
  // every member's finite-check `code` (finite_check.h) rides in its all-to-all parts and
  // `codes` receives all of them; when one is set, every member stops after the all-to-all
  // (`out` is then not written).
  absl::Status RunCompressed(const float* data, int64_t numel, WireFormat format, int divisor,
                             float* out, std::vector<int64_t>* codes = nullptr,
                             int64_t code = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  const GlooAlgorithms algorithms_;
  // Guards only aborted_: taken by Abort while mu_ is held by the collective it breaks.
  mutable absl::Mutex abort_mu_;
  absl::Status aborted_ ABSL_GUARDED_BY(abort_mu_);
  mutable absl::Mutex mu_;
  // Whether the division can be fused into Gloo's ring (ProbeFusedAverage).
  bool fused_ ABSL_GUARDED_BY(mu_) = false;
  // Non-OK once a collective failed: the mesh is then in an unknown state.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // The layout the members agreed on, and when they agree again.
  RoundAgreement agreement_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  // The compressed path's buffers (RunCompressed).
  std::vector<uint8_t> wire_send_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t> wire_recv_ ABSL_GUARDED_BY(mu_);
  std::vector<float> chunk_ ABSL_GUARDED_BY(mu_);
  // Persistent staging (doubles keep it aligned for either staging dtype); the direct
  // exchange's backup of one buffer.
  std::vector<double> staging_ ABSL_GUARDED_BY(mu_);
  // The direct exchange's pieces in flight.
  DirectScratch direct_ ABSL_GUARDED_BY(mu_);
  // A result kept aside by a failed commit vote (kept_ says of what): the raw bytes of one
  // buffer, or the packed staging.
  std::vector<double> pending_ ABSL_GUARDED_BY(mu_);
  KeptResult kept_ ABSL_GUARDED_BY(mu_);
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_GLOO_COMMUNICATOR_H_
