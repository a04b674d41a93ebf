// Who is a live member of one generation of an elastic job, and from which step, as one rank
// reads it from the coordinator's Job; and, for a strict job, which ranks left in an orderly way.
#ifndef MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_
#define MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_

#include <cstdint>
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

  // The view of a world of `world_size` at `generation` where everybody is live.
  static MembershipView Initial(int64_t generation, int32_t world_size);
};

// Whom a rank is, for reading a view.
struct ViewReader {
  int32_t rank = 0;
  std::string worker_id;
  int32_t world_size = 0;
  absl::Duration heartbeat_timeout;  // for the message of a rank declared dead
};

// The view of `job` (its current generation), or nullopt when `reader` is not a live member of
// it (or the job is not RUNNING, or its member list was omitted); *why then says what happened.
std::optional<MembershipView> ViewOf(const v1::Job& job, const ViewReader& reader,
                                     std::string* why);

// A strict job that moved past `generation`: the ranks that left in an orderly way, and whether
// the change breaks every communicator (a death, a re-join, a rank replaced or removed).
struct Departures {
  std::vector<int32_t> left;
  bool hard = false;
};
Departures DeparturesOf(const v1::Job& job, int64_t generation, int32_t world_size);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_MEMBERSHIP_VIEW_H_
