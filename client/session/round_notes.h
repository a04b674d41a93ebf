// Round notes of one rank in an elastic job: where its last two rounds at each level stand
// (step, generation, outcome; two because a level with sync_delay may start its next round
// before a peer has settled the one before, docs/streaming.md). The rank publishes its note when
// it enters a generation, through the coordinator's id exchange under its subgroup of the last
// level (the world's, or with sharded replicas its shard's: the subgroup of every rank it ever
// averages with); after a failed round a member reads its peers' notes to learn whether one of
// them completed the round (then it keeps that result).
#ifndef MODELAVG_CLIENT_SESSION_ROUND_NOTES_H_
#define MODELAVG_CLIENT_SESSION_ROUND_NOTES_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "modelavg/common/schedule.h"

namespace modelavg::client {

class CoordinatorClient;
enum class RoundOutcome;

class RoundNotes {
 public:
  // `coordinator` and `clock` outlive this; `credential` is the membership's (sent with every
  // call); `world_subgroup` is the rank's subgroup at the last level (num_levels - 1).
  RoundNotes(CoordinatorClient& coordinator, const Clock& clock, std::string job_id,
             int32_t rank, std::string credential, int32_t num_levels,
             int32_t world_subgroup = 0);

  // Records where this rank's round at `level` and `step` stands (the latest, or the one before
  // it). Thread-safe.
  void Record(int32_t level, int64_t step, int64_t generation, RoundOutcome outcome)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Publishes this rank's note for `generation`. A failure is logged: the members waiting for
  // the note then see their wait end in an error.
  void Publish(int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether a live member of `decision`'s subgroup (other than this rank and those joining)
  // completed the round at decision.level/step in `attempt_generation`, reading each member's
  // note of decision.generation until `deadline` (on the clock). Errors: those of the read (ABORTED when the
  // job moved on, DEADLINE_EXCEEDED), INTERNAL when the notes contradict each other.
  absl::StatusOr<bool> PeerCompleted(const Decision& decision, int64_t attempt_generation,
                                     absl::Time deadline) const;

 private:
  struct Entry {
    int64_t step = -1;
    int64_t generation = 0;
    int outcome = 0;  // RoundOutcome
  };

  CoordinatorClient& coordinator_;
  const Clock& clock_;
  const std::string job_id_;
  const int32_t rank_;
  const std::string credential_;
  const int32_t num_levels_;
  const int32_t world_subgroup_;

  absl::Mutex mu_;
  // Per level: the latest round, then the one before it.
  std::vector<std::array<Entry, 2>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_SESSION_ROUND_NOTES_H_
