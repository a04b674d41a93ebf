// Who is a live member of one generation of an elastic job, and from which step, as one rank
// reads it from the coordinator's Job; and, for a strict job, which ranks left in an orderly way.
#ifndef MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_
#define MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

struct MembershipView {
  int64_t generation = 0;
  std::vector<bool> live;
  // Per rank: the admission step of a replacement, -1 for the initial world.
  std::vector<int64_t> admitted;
  // Per rank: the first step at which a live rank is no longer a member (INT64_MAX: none).
  // Sharded replicas: the replica mates of a rank that left in order finish the steps it
  // started (Member.retired_at_step).
  std::vector<int64_t> until;
  // The reader's own replica was retired, from `until[reader]` on: why (for its error), and the
  // rank whose loss retired it.
  std::string retired_why;
  int32_t retired_by = -1;

  // The view of a world of `world_size` at `generation` where everybody is live.
  static MembershipView Initial(int64_t generation, int32_t world_size);
};

// Whom a rank is, for reading a view.
struct ViewReader {
  int32_t rank = 0;
  std::string worker_id;
  int32_t world_size = 0;
  absl::Duration heartbeat_timeout;  // for the message of a rank declared dead
  int32_t replica_size = 1;          // JobSpec.replica_size (1: none)
};

// The view of `job` (its current generation), or nullopt when `reader` is not a live member of
// it (or the job is not RUNNING, or its member list was omitted); *why then says what happened,
// and *retired_by (when given) names the rank whose loss retired the reader's replica (-1:
// not retired).
std::optional<MembershipView> ViewOf(const v1::Job& job, const ViewReader& reader,
                                     std::string* why, int32_t* retired_by = nullptr);

// Why `reader`'s replica was retired, for its error: names the replica, its ranks and the lost
// rank `lost` and what became of it in `job`.
std::string ReplicaRetiredMessage(const v1::Job& job, const ViewReader& reader, int32_t lost);

// A strict job that moved past `generation`: the ranks that left in an orderly way, and whether
// the change breaks every communicator (a death, a re-join, a rank replaced or removed).
struct Departures {
  std::vector<int32_t> left;
  bool hard = false;
};
Departures DeparturesOf(const v1::Job& job, int64_t generation, int32_t world_size);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_
