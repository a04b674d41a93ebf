// One job's pending waits: Join calls waiting for their round to complete and GetCommId calls
// waiting for a publish. A plain container with no lock and no clock: Job (server/core/job.h) owns
// one under its mutex, takes waits out when their condition is met, their deadline passes or
// the generation changes, and runs their callbacks after releasing its lock.
#ifndef MODELAVG_SERVER_CORE_PENDING_WAITS_H_
#define MODELAVG_SERVER_CORE_PENDING_WAITS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/core/comm_id_store.h"

namespace modelavg::server {

// Identifies one pending wait (Join, GetCommId) so that its caller can cancel it.
using WaitId = uint64_t;

// Completion of a Join wait. Called exactly once, never under a Job lock.
using JoinCallback = absl::AnyInvocable<void(absl::StatusOr<v1::JoinResponse>)>;
// Completion of a GetCommId wait. Called exactly once, never under a Job lock.
using CommIdCallback = absl::AnyInvocable<void(absl::StatusOr<std::string>)>;

struct JoinWait {
  WaitId id = 0;
  int32_t rank = -1;
  // The credential this Join is given (in its response). Never logged.
  std::string credential;
  absl::Time deadline;
  JoinCallback done;
  // A sharded replacement waiting for the rest of its replica (Membership::Waiting), not for a
  // round: a generation change of the running job does not end it.
  bool for_replica = false;
  // The Join asked for JoinRequest.subgroup_ranks_from_spec: its reply lists no subgroup ranks.
  bool ranks_from_spec = false;
};

struct CommIdWait {
  WaitId id = 0;
  CommKey key;
  absl::Time deadline;
  CommIdCallback done;
};

class PendingWaits {
 public:
  void AddJoin(JoinWait wait) { joins_.push_back(std::move(wait)); }
  void AddCommId(CommIdWait wait) { comm_ids_.push_back(std::move(wait)); }

  // The pending Join of `rank`, taken out; nullopt if none.
  std::optional<JoinWait> TakeJoinOfRank(int32_t rank);
  // Every pending Join, taken out.
  std::vector<JoinWait> TakeAllJoins();
  // Every pending Join but those waiting for their replica, taken out.
  std::vector<JoinWait> TakeRoundJoins();
  // The GetCommId waits for `key`, taken out.
  std::vector<CommIdWait> TakeCommIds(const CommKey& key);
  // Every GetCommId wait, taken out.
  std::vector<CommIdWait> TakeAllCommIds();
  // The wait with `id`, taken out (at most one of the two is set).
  std::optional<JoinWait> TakeJoin(WaitId id);
  std::optional<CommIdWait> TakeCommId(WaitId id);
  // The waits whose deadline is at or before `now`, taken out.
  std::vector<JoinWait> TakeExpiredJoins(absl::Time now);
  std::vector<CommIdWait> TakeExpiredCommIds(absl::Time now);

  size_t size() const { return joins_.size() + comm_ids_.size(); }

 private:
  std::vector<JoinWait> joins_;
  std::vector<CommIdWait> comm_ids_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_CORE_PENDING_WAITS_H_
