// The round of one averaging decision on its subgroup's communicator: the part of ModelAverager
// that every level goes through (plain, outer, streaming).
//
// A strict job's round is one attempt; when it fails for want of a peer, the error names the
// cause once the coordinator has declared it (a death, a new generation). An elastic job's round
// (docs/elastic.md) is committed, retried with the live members of the next generation when it
// fails, and a lost confirmation is settled from the round notes: a live peer that completed the
// round means this rank keeps the result it holds.
//
// Not thread-safe: ModelAverager calls it under its mutex.
#ifndef MODELAVG_CLIENT_AVERAGING_ROUND_RUNNER_H_
#define MODELAVG_CLIENT_AVERAGING_ROUND_RUNNER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/averaging/round_weights.h"
#include "client/comm/communicator.h"
#include "client/comm/communicator_cache.h"
#include "client/outer/outer_device.h"
#include "modelavg/client/averager.h"
#include "modelavg/client/client.h"
#include "modelavg/client/tensor.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

// How a round's tensors travel (RoundOptions::payload) and what they mix into the members'
// layout agreement (RoundOptions::layout_signature): FP32 and 0 for the parameters of a plain
// level; a streaming level's payload for its pseudo-gradients, a fragment split's signature.
struct RoundWire {
  Payload payload = Payload::kFp32;
  int64_t layout_signature = 0;
  // TOPK: entries kept per block (RoundOptions::topk).
  int32_t topk = 0;
  // What the round carries, as a non-finite report names it: "parameters", "pseudo-gradient",
  // "fragment 1 of 4".
  std::string contents = "parameters";
  // A paced round (Decision::weights, round_weights.h): fills the weighted contribution for
  // this member's scale into the round's copy, in each attempt (a level with error feedback:
  // U = beta * E + s * D, keeping the residual it leaves). Empty: the round's tensors times the
  // scale. Unused by a decision without weights.
  WeightedInput::FillFn weigh;
};

// Per level: the bytes this member sent in its rounds, and how long averaging calls waited for
// background all-reduces (ModelAverager::traffic()).
class Traffic {
 public:
  void AddBytes(int level, int64_t bytes);
  void AddWaited(int level, absl::Duration waited);
  // One entry per level of a job of `levels` levels.
  std::vector<ModelAverager::LevelTraffic> PerLevel(size_t levels) const;

 private:
  ModelAverager::LevelTraffic& At(int level);
  std::vector<ModelAverager::LevelTraffic> levels_;
};

class RoundRunner {
 public:
  // What the averager's other parts do inside a round.
  struct Hooks {
    // An admission round (decision.joining not empty): hands the replacements what they need
    // through `comm` before the round's own all-reduce (the outer state, a streaming level's
    // parameters). `layout`: the round's tensors.
    std::function<absl::Status(const Decision& decision, Communicator* comm,
                               absl::Span<const TensorView> layout)>
        hand_over;
    // Called once this client has moved to a newer `generation` and before it publishes its
    // round note there (ends the background all-reduces of older generations).
    std::function<void(int64_t generation)> before_note;
  };

  // `client`, `traffic` and `device` outlive it. `device`: where a paced round's weighted copy
  // of CUDA tensors lives (round_weights.h); null: paced rounds on host tensors only.
  RoundRunner(Client* client, Traffic* traffic, OuterDevice* device, Hooks hooks);

  // One round of `decision` on `tensors` (the parameters, or an outer step's pseudo-gradient):
  // strict or elastic, with the error handling of ModelAverager::AverageParameters.
  absl::StatusOr<Decision> Run(const Decision& decision, const Device& device,
                               absl::Span<const TensorView> tensors, RoundWire wire);
  // An elastic job's round: retried with the live members of the next generation when it fails
  // (see Run). `hand_over`: an admission round runs Hooks::hand_over first.
  absl::StatusOr<Decision> RunElastic(Decision decision, const Device& device,
                                      absl::Span<const TensorView> tensors, RoundWire wire,
                                      bool hand_over = true);

  // This rank's options for `decision`'s committed elastic round (contributing unless it is
  // joining). FAILED_PRECONDITION when nobody contributes, INTERNAL when this rank is no member.
  absl::StatusOr<RoundOptions> ElasticOptions(const Decision& decision, RoundWire wire) const;
  // How the communicator of `decision`'s round is bootstrapped.
  CommunicatorSetup Setup(const Decision& decision) const;

  // Client::AdvanceGeneration, calling Hooks::before_note in between.
  absl::Status EnterNewerGeneration();
  // After the round of `failed` failed with `why`: waits for the job to move past its generation,
  // enters the newer one and decides the step there. The error names both.
  absl::StatusOr<Decision> MoveOnAfterFailure(const Decision& failed, const absl::Status& why);
  // Whether a live peer completed the failed round (the round notes of next->generation); while
  // the job moves on during the read, moves on again, updating *next and counting *attempt.
  absl::StatusOr<bool> PeerCompletedAttempt(const Decision& failed, Decision* next, int* attempt);
  // After a failed round: probes its peers and reports those that do not answer (a gray
  // failure) to the coordinator.
  void ReportUnreachablePeersOf(const Decision& decision, Communicator* comm,
                                const absl::Status& failure) const;
  // After a round failed with `failure` of kind kNonFinite (finite_check.h): the detail
  // completed with the contributing rank and the level; when that rank is this one, reports it
  // to the coordinator (ReportNonFinite: the job's record, and an elastic job retires it).
  absl::Status OnNonFinite(const Decision& decision, const RoundWire& wire,
                           absl::Status failure) const;
  // How long a failed round waits for the coordinator to declare its cause: a heartbeat
  // timeout and some.
  absl::Duration CauseWait() const;

 private:
  // What one attempt of an elastic round left: its failure (OK once committed), how far it got
  // on this rank, and its communicator (null when none could be set up).
  struct Attempt {
    absl::Status status;
    RoundOutcome outcome = RoundOutcome::kFailedWithoutResult;
    Communicator* comm = nullptr;
    // The failure came from the hand-over to the replacements (Hooks::hand_over).
    bool in_hand_over = false;
  };
  // One attempt in decision.generation: the communicator, the hand-over, the committed
  // all-reduce (of a paced decision: on the weighted copy, round_weights.h, written into
  // `tensors` once committed), its outcome in the round notes. A non-OK result is final (this rank is no
  // member, nobody can give a replacement the parameters).
  absl::StatusOr<Attempt> RunAttempt(const Decision& decision, const Device& device,
                                     absl::Span<const TensorView> tensors, RoundWire wire,
                                     bool hand_over);
  // The round succeeded: logs a retried or admission round, drops older communicators.
  Decision Commit(const Decision& decision, int attempt);
  // Waits for the job to move past `generation` (at most RetryWait()), enters the newer one and
  // decides `step` there.
  absl::StatusOr<Decision> MoveOn(int64_t generation, int64_t step);
  // A peer completed the round whose confirmation this rank lost: keep the result it holds.
  absl::Status AdoptLostCommit(const Decision& decision, const Attempt& tried,
                               absl::Span<const TensorView> tensors);
  // Longest wait for the job to move on after a failed round of an elastic job.
  absl::Duration RetryWait() const;

  Client* const client_;
  Traffic* const traffic_;
  OuterDevice* const device_;
  const Hooks hooks_;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_AVERAGING_ROUND_RUNNER_H_
