// Whether the hosts of a communicator's peers answer on its data network: a TCP connect to each
// peer's address, all at once (Communicator::ProbePeers over a TCP transport).
#ifndef MODELAVG_CLIENT_COMM_PEER_PROBE_H_
#define MODELAVG_CLIENT_COMM_PEER_PROBE_H_

#include <sys/socket.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"

namespace modelavg::client {

// Connects to `peers[i]` (member i's data address) for every i but `self`, all at once, and
// waits up to `timeout`: a connection or a refusal (the pair's listening port closes once the
// mesh is up; a refusal is the host's own answer, so its network works) is an answer; no answer
// within `timeout` or an unreachable network is none. Addresses that are neither IPv4 nor IPv6
// (unset) are skipped. One PeerReach per probed member, in member order.
// Errors: INTERNAL when socket() or poll() fails.
absl::StatusOr<std::vector<PeerReach>> ProbeTcpPeers(const std::vector<sockaddr_storage>& peers,
                                                     int self, absl::Duration timeout);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_PEER_PROBE_H_
