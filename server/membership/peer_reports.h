// Gray failures: reports of members whose averaging round failed, naming the peers they could
// not reach over the data network, and the rule that confirms them (docs/cluster.md, "Gray
// failures"). A peer that lost its data path but not its control path still beats to the
// coordinator, so only its peers can tell; yet a peer's word alone must not evict a healthy
// member (the reporter may be the one cut off). A plain value class: no lock, no clock.
#ifndef MODELAVG_SERVER_MEMBERSHIP_PEER_REPORTS_H_
#define MODELAVG_SERVER_MEMBERSHIP_PEER_REPORTS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace modelavg::server {

// One member's latest report in a generation.
struct PeerReport {
  int32_t reporter = -1;
  // Global ranks the reporter could not reach, and those it reached (ascending or not).
  std::vector<int32_t> unreachable;
  std::vector<int32_t> reachable;
  absl::Time at;
};

// A peer the reports confirm, and why (for the generation change's reason and the log).
struct ConfirmedPeer {
  int32_t rank = -1;
  std::vector<int32_t> reporters;
  std::string why;
};

// The confirmation rule, over the unexpired reports of the current generation whose reporters
// are still in its round. A suspect S is confirmed when
//   * S's own report is in and says it reached none of the peers it probed (S is cut off from
//     its peers: a gray failure of S's data path, not of theirs),
//   * some other member R names S unreachable while R itself reached some peer, and
//   * no report names S reachable.
// So a report alone confirms nothing, whatever it says, however many members send one: the
// accused must agree by its own silence. Members of a partition each reach their own side
// (every one is named reachable by someone) and are never confirmed, whatever order their
// reports come in; two members that only reach each other and accuse each other neither.
class PeerReports {
 public:
  // Reports older than `ttl` no longer count.
  explicit PeerReports(absl::Duration ttl) : ttl_(ttl) {}

  // Records `report` for `generation`, replacing the reporter's earlier one; reports of any
  // other generation are forgotten.
  void Add(int64_t generation, PeerReport report);

  // The suspects confirmed as of `now`, ascending, among the ranks for which `in_round` holds
  // (reports whose reporter is no longer in the round are ignored). Empty for any generation but
  // the one of the latest Add.
  std::vector<ConfirmedPeer> Confirmed(int64_t generation, absl::Time now,
                                       const std::function<bool(int32_t)>& in_round) const;

  // How many reports are held (for tests).
  size_t size() const { return reports_.size(); }

 private:
  const absl::Duration ttl_;
  int64_t generation_ = -1;
  std::map<int32_t, PeerReport> reports_;  // by reporter
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_MEMBERSHIP_PEER_REPORTS_H_
