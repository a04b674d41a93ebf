// The connection of one trainer process (one rank) to the modelavg coordinator.
//
//   modelavg::client::ClientOptions opts;
//   opts.coordinator = "coord.example:50051";
//   opts.job_id = "resnet-42";
//   opts.rank = my_rank;                               // optional: absent, the coordinator picks
//   auto client = modelavg::client::Client::Connect(opts);   // blocks until the world is complete
//   if (!client.ok()) { /* print client.status() and exit */ }
//   ... build an averager on (*client).get() (averager.h) and train ...
//   (*client)->Leave("finished");
//
// Connect joins the job (the JoinResponse carries the job's spec: the single source of truth for
// the schedule), starts a heartbeat thread that reports the current step every
// `heartbeat_interval` and notices a generation change, and prefetches decisions in windows of
// `schedule_window` steps so that an ordinary step costs no RPC.
#ifndef MODELAVG_CLIENT_CLIENT_H_
#define MODELAVG_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "modelavg/client/cancel_token.h"
#include "modelavg/client/connection.h"
#include "modelavg/client/membership_view.h"
#include "modelavg/common/plan_history.h"
#include "modelavg/common/schedule.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg {
class Clock;  // common/clock.h
}  // namespace modelavg

namespace modelavg::client {

class CoordinatorClient;
class CoordinatorOutage;
class CommunicatorCache;
class CommunicatorFactory;
class DecisionWindow;
class GenerationTracker;
class Heartbeat;
class PaceTracker;
class RoundNotes;
struct Joined;
enum class RoundOutcome;

// The connection (ConnectionOptions: coordinator, auth_token or auth_token_file, tls, tls_*_file,
// rpc_timeout, the deadline of every RPC but the Join) and what this rank joins with.
struct ClientOptions : ConnectionOptions {
  std::string job_id;
  // The rank to take; absent: the coordinator picks the lowest free one.
  std::optional<int32_t> rank;
  // The world size this worker was started for; 0: any. A job of another size refuses the
  // Join at once (INVALID_ARGUMENT naming both sizes).
  int32_t expected_world_size = 0;
  // The credential of this worker's earlier membership (Client::credential()), for a worker
  // that restarts and re-takes its own rank while the coordinator still counts it alive. Empty:
  // none. Connect replaces it with the new membership's; the library sends it on every call
  // that acts as the rank. Never logged.
  std::string credential;
  // This worker's identity; empty: "<hostname>:<pid>".
  std::string worker_id;
  // How long Connect waits for the whole world to join.
  absl::Duration join_timeout = absl::Minutes(5);
  absl::Duration heartbeat_interval = absl::Milliseconds(100);
  // Heartbeat over one HeartbeatStream per client: beats are written without waiting, and the
  // coordinator answers only when the job changed, and otherwise about once a second (at least
  // three times per heartbeat timeout), which costs it far less than a call per beat. A broken
  // stream is re-opened with backoff. false: one unary Heartbeat call per beat. A coordinator
  // without HeartbeatStream (an older version) gets unary calls either way.
  bool heartbeat_stream = true;
  // With heartbeat_stream: the beats of every Client of this process that talks to the same
  // coordinator (same addresses, token and TLS files) go in one HostHeartbeatStream, one message
  // per beat interval (the shortest of theirs), so that the coordinator pays its per-message
  // cost once per process instead of once per rank (for trainers that drive several ranks from
  // one process). A coordinator without HostHeartbeatStream gets a stream per client.
  bool share_heartbeat_stream = false;
  // The beats of every process of this host that reaches the same coordinator in one stream
  // (for launchers that start a process per rank, such as torchrun): an absolute path to a
  // directory of this user's, closed to others (created with mode 0700 if missing; at most 82
  // bytes, for the socket's path in it), local to the host best ($XDG_RUNTIME_DIR/modelavg). The first process to take the lock there serves the
  // others' beats over a Unix socket beside it and forwards them with its own, at most one beat
  // interval later; when it is gone, the next process to try the lock takes its place within
  // milliseconds. A process that dies is still counted lost by the coordinator at once (an elastic
  // job declares its ranks dead at half the heartbeat timeout). Implies share_heartbeat_stream.
  // Empty: no relay. Connect fails with INVALID_ARGUMENT for a directory that cannot serve.
  std::string heartbeat_relay_dir;
  // While the coordinator is unreachable, training goes on (local schedule through the last step
  // the coordinator handed this rank, existing communicators, heartbeats retried with backoff);
  // work that needs the coordinator (a subgroup's first communicator in the generation, a step
  // past the decisions handed) waits for it up to this long, counted from
  // the start of the outage. Past it, that work and every later averaging call fail with
  // UNAVAILABLE naming the coordinator and how long it has been gone.
  absl::Duration coordinator_outage_timeout = absl::Minutes(5);
  // Longest wait for one collective (communicator set-up or one all-reduce); past it the
  // averaging call fails with DEADLINE_EXCEEDED instead of hanging on a dead peer.
  absl::Duration collective_timeout = absl::Seconds(60);
  // Longest time Leave (and so the destructor) retries while the coordinator is unreachable
  // (a restart at the end of a job), and never past coordinator_outage_timeout; past it Leave
  // fails with UNAVAILABLE and the coordinator counts the rank dead at its heartbeat timeout.
  absl::Duration leave_timeout = absl::Seconds(20);
  // Decisions prefetched per GetSchedule call (1..100000).
  int64_t schedule_window = 4096;
  // Address Gloo's TCP transport binds to (and that peers connect to).
  std::string gloo_hostname = "127.0.0.1";
  // Host (Gloo) parameters that form one float32/float64 buffer are averaged in place, without
  // the staging copy that keeps them untouched when a collective fails: faster for large
  // models, but a failure mid-collective leaves them undefined (restore from a checkpoint).
  bool gloo_in_place = false;
  // Host (Gloo) rounds of more than two members from 256 KiB up to this many bytes go through
  // the scatter-gather exchange (each member sums one n-th of the buffer and sends its mean to
  // every member: the ring's bytes in 2 hops instead of 2 (n - 1); docs/benchmarks.md) instead
  // of Gloo's ring. 0 (the default): the ring. For members on one flat network (a rack, a
  // data centre): about 1.3-1.4x faster rounds at 1-4 MiB, and an elastic round costs what a
  // strict one does. Not across a slow link between sites: with ranks in site order the ring
  // crosses it twice, while each member's ranges cross it to every owner on the other side
  // (with two sites of n / 2 members each, n / 2 buffers each way against the ring's
  // 2 (n - 1) / n: 1.33x at 4 members, 2.3x at 8). Every member of a job sets it alike.
  int64_t gloo_scatter_max_bytes = 0;
  // The finite check (docs/elastic.md, "Non-finite values"): before its values enter a round,
  // each member knows whether they are all finite; a member with a NaN or an Inf is kept out of
  // the round and reported (every call of a strict job fails naming it; an elastic job retires
  // it and the survivors average without it). Every member of a job must set it alike (a
  // member that differs fails the round's layout agreement). Off: no pass over the values
  // (docs/operations.md gives its measured cost).
  bool check_finite = true;
  // Paced levels (docs/paced.md): the tokens (samples, sequences: any unit, the same for every
  // member of a job) one local step of this worker processes, sent with the Join. A paced round
  // weighs each member by its inner steps since its previous round times this. Finite, in
  // (0, 1e12]; default 1 (environment: MODELAVG_TOKENS_PER_STEP, TokensPerStepFromEnvironment).
  double tokens_per_step = 1;
  // Cancels Connect from another thread: once cancel->Cancel() is called, Connect's Join (in
  // flight or in its retry backoff) ends at once and Connect fails with CANCELLED. Null: none.
  // Only Connect watches it.
  std::shared_ptr<CancelToken> cancel;
  // The clock the session reads and waits on for its timeouts (join, leave, outage, the wait
  // for a new generation, the round notes); not owned, outlives the Client. Null: the real
  // clock. Tests pass a FakeClock (common/clock.h) to advance time instead of sleeping.
  const Clock* clock = nullptr;
};

// The largest ClientOptions::tokens_per_step.
inline constexpr double kMaxTokensPerStep = 1e12;

// MODELAVG_TOKENS_PER_STEP when it is set and not empty, else `fallback`. INVALID_ARGUMENT naming
// the variable when its value is not a number in (0, 1e12].
absl::StatusOr<double> TokensPerStepFromEnvironment(double fallback = 1);

// One rank's membership in one job. Thread-safe.
class Client {
 public:
  // Validates `options`, joins the job and blocks until every rank has joined (at most
  // options.join_timeout), then starts the heartbeat thread. While the coordinator is
  // unreachable (not started yet, restarting, a connection that failed under load) the Join is
  // retried with backoff until join_timeout, so workers may start before the coordinator.
  // Ignores SIGPIPE when its disposition is the default (which would kill the process): a peer
  // that dies mid-collective must surface as an averaging error, not end the survivor.
  // Errors: INVALID_ARGUMENT (bad options; the spec the coordinator sent is not valid),
  // NOT_FOUND (no such job: create it first), ALREADY_EXISTS (the requested rank is taken),
  // FAILED_PRECONDITION (the job is full and running), DEADLINE_EXCEEDED (the world did not
  // complete in time; the message names the missing ranks), UNAVAILABLE (coordinator
  // unreachable), UNAUTHENTICATED / PERMISSION_DENIED (token or TLS), CANCELLED
  // (options.cancel was cancelled while joining).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  // The same, with this client's communicators made by `communicators` (the library's internal
  // interface, client/comm/communicator_factory.h; null: this build's backends) instead of the
  // backends themselves: for tests and tools that wrap the real communicators in fakes.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      ClientOptions options, std::unique_ptr<CommunicatorFactory> communicators);

  // Leaves the job (reason "client destroyed") unless Leave was called, and stops the heartbeat.
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  int32_t rank() const { return rank_; }
  int32_t world_size() const { return schedule_.world_size(); }
  // Sharded replicas (JobSpec.replica_size; 1: none): the ranks of one replica, this rank's
  // replica (rank / replica_size) and the shard it holds (rank % replica_size).
  int32_t replica_size() const { return schedule_.replica_size(); }
  int32_t replica() const { return schedule_.ReplicaOf(rank_); }
  int32_t shard() const { return schedule_.ShardOf(rank_); }
  // The generation this client averages in: the one it joined, or in an elastic job a later
  // one it followed (a shrink around a dead member, an admission) as a live member.
  int64_t generation() const;
  int64_t joined_generation() const { return joined_generation_; }
  // Whether the job is elastic (JobSpec.min_world_size below world_size).
  bool elastic() const { return elastic_; }
  // The job's first plan (world size, replica size and mode never change).
  const Schedule& schedule() const { return schedule_; }
  // The job's plans as this rank holds them (UpdateJob adds to them, docs/plan-updates.md): a
  // decision's levels are those of its plan, plans().Plan(decision.plan). The reference stays
  // valid for the client's life (a later call may return a longer history).
  const PlanHistory& plans() const;
  const std::string& job_id() const { return options_.job_id; }
  // This membership's credential (secret; see ClientOptions::credential).
  const std::string& credential() const { return options_.credential; }
  const ClientOptions& options() const { return options_; }
  // The job's heartbeat timeout in force (after the coordinator's defaults).
  absl::Duration heartbeat_timeout() const { return heartbeat_timeout_; }
  // A replacement that joined a RUNNING elastic job: the step it is admitted at (> 0). Its
  // averagers start at that step, and their first AverageParameters call overwrites the
  // parameters with the live members' average (Decision::joining names this rank). -1 for a
  // member of the world that started the job. Optimizer state is the trainer's: a
  // replacement's starts fresh.
  int64_t admission_step() const { return admission_step_; }

  // Tells the coordinator this worker is done. Idempotent: later calls return OK. While the
  // coordinator is unreachable the call is retried for up to options().leave_timeout. After a
  // failed averaging call (RecordFailure) the departure is a failure, not an orderly one: the
  // coordinator counts the rank as dead (LeaveRequest.failed); it is tried once.
  // Errors: UNAVAILABLE / DEADLINE_EXCEEDED (coordinator unreachable past leave_timeout),
  // NOT_FOUND (job deleted). With `cancel` (not owned; outlives the call), its Cancel() ends the
  // call at once with CANCELLED (the RPC in flight is cancelled, no retry follows): the worker
  // has left all the same, and the coordinator counts the rank dead at its heartbeat timeout
  // unless the Leave reached it.
  absl::Status Leave(absl::string_view reason, CancelToken* cancel = nullptr);

  // Records that this worker's averaging failed with `failure` (the first one is kept): its
  // Leave then tells the coordinator it failed. Called by the averagers.
  void RecordFailure(const absl::Status& failure);

  // This worker can no longer take part in a collective its peers have entered or are about to
  // (its NCCL parameter layout changed after its communicator agreed on one): records
  // `failure`, breaks this client with it, and tells the coordinator at once that this rank
  // failed (LeaveRequest.failed, one attempt), so that the job moves to a new generation and the
  // peers' heartbeats abort their collective within about a heartbeat rather than at the
  // collective timeout. Later Leave calls return OK. Does not wait for the heartbeat thread
  // (it may be called from inside a communicator). Thread-safe; idempotent.
  void FailOut(const absl::Status& failure);

  // --- Used by the averagers (and available to advanced callers). ---

  // This rank's decision at `step` (>= 0), from the prefetched window; fetches the window
  // starting at `step` with GetSchedule when `step` leaves it, and checks every fetched decision
  // against the local schedule.
  // Errors: INVALID_ARGUMENT (step < 0), INTERNAL (the coordinator's decisions disagree with the
  // schedule of the spec it sent at Join), and the RPC errors (UNAVAILABLE, ...).
  absl::StatusOr<Decision> DecisionAt(int64_t step);

  // The step the heartbeat reports (the next AverageParameters call's step).
  void ReportStep(int64_t step);

  // OK when this rank may average with `group` now: the job is still at generation(), or it
  // moved on only because ranks outside `group` left in an orderly way (the end of a run, where
  // subgroups finish at different times). Otherwise FAILED_PRECONDITION saying what changed
  // and why (a peer died, re-joined or left; this client left), or UNAVAILABLE when the
  // coordinator has not answered a heartbeat for longer than the heartbeat timeout.
  absl::Status CheckCanAverage(const SubgroupRange& group) const;

  // OK while the job is at generation() and the coordinator answers; the error of
  // CheckCanAverage otherwise.
  absl::Status CheckUsable() const;

  // The latest generation the heartbeat has seen (>= generation()).
  int64_t latest_generation() const;

  // --- Elastic jobs (used by the averagers). ---

  // Moves this client to the newest generation it was carried into (a shrink or an admission
  // seen by the heartbeat), if any, and tells the coordinator where its last rounds stand
  // there (its round note, see PeerCompletedRound). Then the error that stops averaging, if
  // any (a death of this rank, a job below min_world_size, ...), else OK.
  absl::Status AdvanceGeneration();
  // The same, calling `before_note(generation)` once this client has moved to a newer
  // generation and before its round note is published there (an averager ends its background
  // all-reduces of older generations then: their outcomes belong in the note).
  absl::Status AdvanceGeneration(absl::FunctionRef<void(int64_t)> before_note);
  // Waits until this client can move past `generation` (AdvanceGeneration) or is broken, at most
  // `wait` (on the session's clock), which is pushed back while the coordinator is unreachable
  // (up to coordinator_outage_timeout, past which the client is broken). OK, the error that
  // stops averaging, or DEADLINE_EXCEEDED.
  absl::Status AwaitNewerGeneration(int64_t generation, absl::Duration wait);
  // After a failed round with `group`: waits at most `wait` (on the session's clock) for
  // CheckCanAverage(group) to fail (the coordinator declaring a peer's death, a new generation)
  // and returns its result then: the cause of the failure, or OK when none came in time.
  absl::Status AwaitCannotAverage(const SubgroupRange& group, absl::Duration wait) const;
  // Records where this rank's last round at `level` stands (round notes).
  void RecordRound(int32_t level, int64_t step, int64_t generation, RoundOutcome outcome);
  // After a failed round: whether a live member of `decision`'s subgroup (the same step in the
  // current generation) completed the round that this rank last attempted at that level in
  // `attempt_generation`. Waits (at most collective_timeout) for each member's round note,
  // which every member publishes when it enters the generation. Errors: ABORTED (the job moved
  // on again), DEADLINE_EXCEEDED, INTERNAL (the notes contradict each other).
  absl::StatusOr<bool> PeerCompletedRound(const Decision& decision, int64_t attempt_generation);

  // The RPC wrapper (communicator bootstrap). Owned by this client.
  CoordinatorClient* coordinator() const { return coordinator_.get(); }
  // The communicators of this membership, shared by every averager on this client.
  CommunicatorCache* communicators() const { return communicators_.get(); }
  // This member's compute pace, which the averagers mark (their calls) and every heartbeat
  // reports (HeartbeatRequest.compute_steps_per_second; docs/paced.md).
  PaceTracker* pace() const { return pace_.get(); }

 private:
  Client(ClientOptions options, std::unique_ptr<CoordinatorClient> coordinator,
         std::unique_ptr<CoordinatorOutage> outage, Joined joined,
         std::unique_ptr<CommunicatorFactory> communicators);
  // A LeaveRequest for this rank at its current generation (reason and failed left unset).
  v1::LeaveRequest LeaveRequestNow() const;
  // What the heartbeat brings (Heartbeat::Hooks): any reply; a reply whose generation may be
  // new (`seen`: the latest the heartbeat had reported); a failed beat.
  void OnHeartbeatReply(const v1::HeartbeatResponse& reply) ABSL_LOCKS_EXCLUDED(mu_);
  void OnGenerationSeen(const v1::HeartbeatResponse& reply, int64_t seen)
      ABSL_LOCKS_EXCLUDED(mu_);
  void OnHeartbeatFailure(const absl::Status& error) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks this client broken with `why` unless it already is (the first reason stands).
  void Break(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);

  const ClientOptions options_;
  const Clock& clock_;
  // Declared before the coordinator connection, which points to it: destroyed after it.
  const std::unique_ptr<CoordinatorOutage> outage_;
  const std::unique_ptr<CoordinatorClient> coordinator_;
  const int32_t rank_;
  const int64_t joined_generation_;
  const Schedule schedule_;
  const bool elastic_;
  const absl::Duration heartbeat_timeout_;
  const int64_t admission_step_;
  std::unique_ptr<CommunicatorCache> communicators_;
  // The parts, each with its own lock, built on the coordinator connection above.
  const std::unique_ptr<DecisionWindow> decisions_;
  const std::unique_ptr<RoundNotes> round_notes_;
  const std::unique_ptr<PaceTracker> pace_;

  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  // The generations, the membership view and what stops averaging (no lock of its own).
  const std::unique_ptr<GenerationTracker> tracker_ ABSL_PT_GUARDED_BY(mu_);
  // Last: its thread calls into the fields above, so it is started once they are set and
  // stopped before they go.
  std::unique_ptr<Heartbeat> heartbeat_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_CLIENT_H_
