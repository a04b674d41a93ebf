// Where the coordinator keeps the hard state of its jobs: what a restarted coordinator needs to
// continue every job where it was (the spec, the generation counter, the current membership and
// the communicator bootstrap ids of the current generation). Soft state (heartbeat times,
// reported steps, pending waits, watchers) is never written: an ordinary step or heartbeat writes
// nothing.
//
// The core (server/job/job.h, server/core/job_registry.h) calls the store at each hard-state transition,
// under the job's lock, and answers the RPC that made the change only once the store has
// returned OK. Implementations: InMemoryStateStore (below; the default, nothing survives the
// process) and SqliteStateStore (server/store/sqlite/sqlite_state_store.h, --state_dir).
#ifndef MODELAVG_SERVER_STORE_STATE_STORE_H_
#define MODELAVG_SERVER_STORE_STATE_STORE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/membership/member.h"

namespace modelavg::server {

// One communicator bootstrap id of the current generation.
struct StoredCommId {
  int32_t level = 0;
  int32_t subgroup = 0;
  std::string key;
  std::string blob;
};

// Everything stored about one job.
struct StoredJob {
  v1::JobSpec spec;
  int64_t created_unix_ms = 0;
  MembershipHeader header;
  // Only ranks that ever joined (present members), in rank order.
  std::vector<Member> members;
  std::vector<StoredCommId> comm_ids;
  // The plans UpdateJob accepted (versions 1, 2, ...; version 0 is `spec`), in version order.
  std::vector<v1::PlanChange> plan_changes;
  // A paced job's planned rounds still kept (docs/paced.md), in round order.
  std::vector<v1::PacedRound> paced_rounds;
};

// One transition of a job, written atomically: all of it or nothing.
struct JobDelta {
  // The header after the transition, when it changed.
  std::optional<MembershipHeader> header;
  // Members whose hard state changed. A member with an empty worker_id is removed.
  std::vector<Member> members;
  // The generation changed or the job finished: the ids of the old generation are dropped
  // (before comm_id below is added).
  bool clear_comm_ids = false;
  std::optional<StoredCommId> comm_id;
  // A plan UpdateJob accepted (kept for the job's life: plans are never dropped).
  std::optional<v1::PlanChange> plan_change;
  // Paced jobs: rounds just planned (written before any member is handed them), in round order,
  // and the rounds dropped from the front: every kept round below this index is deleted (0:
  // none). A round written again replaces the stored one; after the delta no round below
  // drop_paced_rounds_before is kept, not even one written by the same delta.
  std::vector<v1::PacedRound> paced_rounds;
  int64_t drop_paced_rounds_before = 0;

  bool empty() const {
    return !header.has_value() && members.empty() && !clear_comm_ids && !comm_id.has_value() &&
           !plan_change.has_value() && paced_rounds.empty() && drop_paced_rounds_before == 0;
  }
};

class StateStore {
 public:
  virtual ~StateStore() = default;

  // Every stored job, in job_id order. Called once, before serving. An unreadable or corrupt
  // store is an error naming its file (DATA_LOSS, FAILED_PRECONDITION), never an empty result.
  virtual absl::StatusOr<std::vector<StoredJob>> LoadAll() = 0;

  // Records a new job (PENDING, generation 1, no members). ALREADY_EXISTS if stored already;
  // UNAVAILABLE/INTERNAL when the write fails.
  virtual absl::Status CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) = 0;

  // Forgets a job and everything stored under it. OK for an unknown job.
  virtual absl::Status DeleteJob(absl::string_view job_id) = 0;

  // Applies one transition of a job atomically. NOT_FOUND for an unknown job; UNAVAILABLE or
  // INTERNAL when the write fails (nothing of the delta is then stored).
  virtual absl::Status Apply(absl::string_view job_id, const JobDelta& delta) = 0;

  // For the start-up log: "in memory (...)" or the file it writes.
  virtual std::string Describe() const = 0;
};

// Keeps the state in this process only: the coordinator's behaviour without --state_dir, and a
// fake for tests. Thread-safe.
class InMemoryStateStore final : public StateStore {
 public:
  absl::StatusOr<std::vector<StoredJob>> LoadAll() override;
  absl::Status CreateJob(const v1::JobSpec& spec, int64_t created_unix_ms) override;
  absl::Status DeleteJob(absl::string_view job_id) override;
  absl::Status Apply(absl::string_view job_id, const JobDelta& delta) override;
  std::string Describe() const override;

  // Makes every later write fail with `status` (OK: writes succeed again). For tests.
  void FailWrites(absl::Status status);
  // How many transitions Apply wrote. For tests.
  int64_t applied() const;

 private:
  using CommKey = std::tuple<int32_t, int32_t, std::string>;
  struct Entry {
    v1::JobSpec spec;
    int64_t created_unix_ms = 0;
    MembershipHeader header;
    std::map<int32_t, Member> members;
    std::map<CommKey, std::string> comm_ids;
    std::vector<v1::PlanChange> plan_changes;
    // By round: kept in round order.
    std::map<int64_t, v1::PacedRound> paced_rounds;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
  absl::Status fail_writes_ ABSL_GUARDED_BY(mu_);
  int64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_STATE_STORE_H_
