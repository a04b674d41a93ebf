// A communicator averages tensors across the members of one subgroup. One exists per
// (generation, level, subgroup, device kind), created lazily at the first averaging step that
// needs it and cached by CommunicatorCache (communicator_cache.h).
#ifndef MODELAVG_CLIENT_COMM_COMMUNICATOR_H_
#define MODELAVG_CLIENT_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

class CoordinatorClient;

// Cancels a communicator's set-up from another thread: every wait of the set-up (the
// rendezvous through the coordinator, the connection of each pair of the mesh, the first
// collectives) ends promptly with the cancel reason. The communicator cache cancels the set-up
// of a generation that is over (CommunicatorCache::AbortBefore); a set-up also cancels itself
// at its deadline. Thread-safe.
class SetupCanceller {
 public:
  // The first reason stands; later calls do nothing. Runs the registered hooks (outside the
  // lock) with `why` (OK becomes ABORTED).
  void Cancel(absl::Status why);
  // OK until cancelled; then the reason.
  absl::Status status() const;
  // Runs `hook` on Cancel, or at once (on this thread) if already cancelled. A hook must not
  // block and must stay valid for the canceller's life (capture what it needs by value).
  void OnCancel(std::function<void(const absl::Status&)> hook);

 private:
  mutable absl::Mutex mu_;
  absl::Status why_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(const absl::Status&)>> hooks_ ABSL_GUARDED_BY(mu_);
};

// Everything a communicator needs to bootstrap one subgroup through the coordinator.
struct CommunicatorSetup {
  CoordinatorClient* coordinator = nullptr;
  std::string job_id;
  int64_t generation = 0;
  // The plan whose `level` this is (Decision::plan; 0 in a job never updated).
  int32_t plan = 0;
  int32_t level = 0;
  SubgroupRange subgroup;
  // This process's global rank (a member of `subgroup`).
  int32_t rank = 0;
  // That rank's credential (Client::credential()), sent with every comm-id request.
  std::string credential;
  // Bounds the bootstrap and every collective.
  absl::Duration timeout = absl::Seconds(60);
  // Polled while waiting (NCCL): non-OK aborts the wait with that status.
  std::function<absl::Status()> check_alive;
  // NCCL: called (on the averaging thread) with the error when this member fails a call after
  // its communicator agreed on the layout — its layout changed — where its peers cannot learn
  // it in band: moves the job to a new generation so that their collective is aborted within
  // about a heartbeat (Client::FailOut). May be empty.
  std::function<void(const absl::Status&)> request_new_generation;
  // Cancels the set-up from another thread (set by CommunicatorCache::Get; may be null).
  std::shared_ptr<SetupCanceller> cancel;
  // Gloo: average one-buffer parameters in place (ClientOptions::gloo_in_place).
  bool gloo_in_place = false;
  // Gloo: GlooAlgorithms::scatter_max_bytes (ClientOptions::gloo_scatter_max_bytes).
  int64_t gloo_scatter_max_bytes = 0;
  // NCCL: which bootstrap of this subgroup in this generation (0, then 1, 2, ... after failed
  // ones): each attempt exchanges a fresh unique id under its own key (NcclUniqueIdKey).
  int32_t bootstrap_attempt = 0;
  // The global ranks that form the communicator, ascending: the subgroup's live (and admitted)
  // members in an elastic job. Empty: the whole subgroup.
  std::vector<int32_t> members;

  // This rank's index among the members, and their number.
  int MemberIndex() const;
  int MemberCount() const;
  // A key prefix that tells this member set from the whole subgroup's (and from other sets of
  // the same subgroup and generation): "" for the whole subgroup, else "m<hash>/".
  std::string MemberScope() const;

  // Scopes a v1::PublishCommIdRequest or v1::GetCommIdRequest to this job, generation, level,
  // subgroup and rank, under `key` (empty: the communicator's unique id).
  template <typename Request>
  void ScopeCommIdRequest(const std::string& key, Request* req) const {
    req->set_job_id(job_id);
    req->set_generation(generation);
    req->set_plan(plan);
    req->set_level(level);
    req->set_subgroup(subgroup.index);
    req->set_rank(rank);
    req->set_key(key);
    req->set_credential(credential);
  }
};


// How one averaging round runs. The defaults are a plain average of every member.
struct RoundOptions {
  // The round's step. The first call on a communicator checks that every member passes the
  // same one (a member at another step is an error, never a mixed average); -1: not checked.
  int64_t step = -1;
  // A paced level's round (Decision::round; -1 otherwise): its members sync at their own steps,
  // so they agree on the round's index instead of the step.
  int64_t round = -1;
  // What the members agree on: the round of a paced round, else the step.
  int64_t AgreedStep() const { return round >= 0 ? round : step; }
  // False for a member admitted at this step (an elastic replacement): it contributes nothing
  // and receives the average of the others.
  bool contribute = true;
  // How many members contribute: the divisor. 0: size().
  int contributors = 0;
  // Two phases: after the data all-reduce every member confirms that its own succeeded, and
  // only then does any member keep the result. A member whose data all-reduce succeeded but
  // whose confirmation failed leaves its tensors untouched and keeps the result aside
  // (AdoptPendingResult): if any member completed the round, every member holds its result.
  bool commit = false;
  // How the tensors travel (streaming sync, docs/streaming.md): FP32 is a plain all-reduce;
  // BF16 and INT8 encode each member's contribution (client/payload/payload_codec.h), sum the decoded
  // values in float32 and send the sum encoded again, so every member ends with the same
  // decoded result. For pseudo-gradients, not parameters: the level must be an outer one.
  Payload payload = Payload::kFp32;
  // TOPK: the entries kept per block of 1024 (client/payload/payload_codec.h).
  int32_t topk = 0;
  // Mixed into the layout agreement with the element count and dtype (0: none): the fragment
  // split's signature (client/averaging/fragments.h), so that members whose splits differ fail with
  // INVALID_ARGUMENT rather than average different tensors together.
  int64_t layout_signature = 0;
  // Whether each member's contribution is checked for NaN and Inf before anyone keeps the
  // round's result (finite_check.h): the check travels in the round's own data collective.
  // The averagers ask for it in every round unless the job was created with
  // JobSpec.skip_finite_check. When a member's values are
  // not all finite, no member writes the result and every member's call fails with
  // INVALID_ARGUMENT of kind kNonFinite naming that member (ErrorPeerOf), its first non-finite
  // tensor and the value (NonFiniteDetailOf); the communicator remains usable. Every member
  // passes the same (INVALID_ARGUMENT, kLayoutMismatch otherwise).
  bool check_finite = false;
};

// Where a round left this member.
enum class RoundOutcome {
  // The tensors hold the average.
  kCompleted,
  // Failed before this member had the result: the tensors are untouched.
  kFailedWithoutResult,
  // The data all-reduce succeeded but the confirmation failed (RoundOptions::commit): the
  // tensors are untouched and the result is kept aside.
  kFailedHoldingResult,
};

// Whether a member of the communicator answered a reachability probe (Communicator::ProbePeers).
struct PeerReach {
  // The member's index in the communicator (0 .. size() - 1, not this member's own).
  int member = -1;
  bool reachable = false;
  // What the probe saw ("refused: the host answered", "no answer in 1s", ...), for logs.
  std::string detail;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // A plain round (RoundOptions defaults).
  absl::Status AllReduceAverage(absl::Span<const TensorView> tensors) {
    return AllReduceAverage(tensors, RoundOptions{}, nullptr);
  }

  // Replaces every tensor, in place, with the element-wise mean of the members' tensors (the
  // same list layout on every member). On an error the tensors are left untouched; the
  // communicator is then broken and every later call fails with the same error.
  // Errors: INVALID_ARGUMENT (tensors on the wrong device for this communicator; the members'
  // layouts differ: total element count or dtype), DEADLINE_EXCEEDED (a member did not take
  // part in time), ABORTED / FAILED_PRECONDITION (the generation changed), INTERNAL (transport
  // failure, with the cause).
  // `outcome` (may be null) says where the round left this member.
  virtual absl::Status AllReduceAverage(absl::Span<const TensorView> tensors,
                                        const RoundOptions& options, RoundOutcome* outcome) = 0;

  // Writes the result that the last round kept aside (RoundOutcome::kFailedHoldingResult) into
  // `tensors` (the same list as that round's) and forgets it. Works on a broken communicator.
  // FAILED_PRECONDITION when nothing is kept; INVALID_ARGUMENT for another layout.
  virtual absl::Status AdoptPendingResult(absl::Span<const TensorView> tensors) = 0;

  // Makes the call in flight on another thread (if any) and every later call fail with `why`
  // promptly, leaving their tensors as AllReduceAverage promises on an error. Thread-safe and
  // non-blocking: called by the client's heartbeat thread when the job moves to a new
  // generation, so that no collective outlives its generation (a stopped or hung peer must not
  // hold the survivors for the collective timeout). Idempotent; the first `why` is kept.
  virtual void Abort(const absl::Status& why) = 0;

  // Bytes this member has handed to the transport for averaging rounds so far (the algorithm's
  // count: a ring all-reduce sends 2 (n - 1) / n of the buffer; set-up and agreement messages
  // are not counted). 0 where not counted.
  virtual int64_t bytes_sent() const { return 0; }

  // After a failed round: whether each other member's host still answers on the data network
  // the communicator uses (a gray failure cuts that path while the member's heartbeats still
  // reach the coordinator; docs/cluster.md). Bounded by `timeout`; works on a broken
  // communicator. UNIMPLEMENTED where the transport cannot tell (NCCL).
  virtual absl::StatusOr<std::vector<PeerReach>> ProbePeers(absl::Duration timeout) {
    (void)timeout;
    return absl::UnimplementedError("this communicator cannot probe its peers");
  }
  // This member's index in the subgroup and the subgroup's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_COMMUNICATOR_H_
