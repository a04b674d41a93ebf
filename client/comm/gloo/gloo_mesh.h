// The Gloo TCP mesh below GlooCommunicator's collectives: the device, the full mesh connected by
// modelavg so that a cancel can interrupt it (ConnectMesh), failing a pair at the transport
// (FailPair), and Gloo's exceptions as statuses with their kind (FromGlooException). Every Gloo
// exception of set-up and teardown stops here.
#ifndef MODELAVG_CLIENT_COMM_GLOO_GLOO_MESH_H_
#define MODELAVG_CLIENT_COMM_GLOO_GLOO_MESH_H_

#include <sys/socket.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/comm/communicator.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
class Pair;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace modelavg::client {

// Gloo's TCP transport writes without MSG_NOSIGNAL: with SIGPIPE at its default, a peer that
// dies mid-collective would kill this process instead of failing the all-reduce. Ignores
// SIGPIPE when its disposition is the default; a handler the application installed is left
// alone. Called by GlooCommunicator::Create and Client::Connect.
void IgnoreDefaultSigpipe();

// A Gloo TCP device bound to `hostname` (shared by every Gloo communicator of a process).
// INVALID_ARGUMENT / UNAVAILABLE when the address cannot be resolved or bound.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> CreateGlooDevice(
    const std::string& hostname);

// A Gloo exception as a status a person can act on, with its kind (error_kind.h). Gloo reports
// every transport failure as a gloo::IoException, a timeout included; which one it was is told
// by the clock, not by the text: a wait that lasted its whole `timeout` (since `started`) timed
// out (DEADLINE_EXCEEDED, kTimeout); another IoException is UNAVAILABLE (kPeerFailure); the
// rest INTERNAL. `what` names the operation.
absl::Status FromGlooException(const std::exception& e, absl::string_view what,
                               absl::Time started, absl::Duration timeout);

// Fails one TCP pair at the transport: its pending operations, a connect in progress included,
// wake with an error and its socket closes, so that the peer's collectives on the mesh fail as
// well. Where the platform cannot (not x86-64 with libstdc++, or not a TCP pair) it logs that
// the collective ends at its timeout. `member` is the pair's peer, for the logs.
void FailPair(gloo::transport::Pair* pair, int member, const std::string& msg);

// The waits of a mesh's collectives, so that an abort ends every one of them. Failing the pairs
// (FailPair) wakes the operations a pair has pending or registered, but not a send that the
// socket did not take whole and that waits in the pair's transmit queue — a peer that stopped
// reading, or that died while the send was written (the write failed with EPIPE before the
// pair read the close): Gloo's Pair::signalException passes such a send by, and its waitSend
// lasted the whole collective timeout (a strict job's survivor still running 18 s after a
// kill -9, instead of failing in ~3.5 s). Every unbound buffer of the mesh, which all of
// Gloo's collectives use, is made through ConnectMesh's context and registered here, so that
// AbortAll ends its waits itself. Thread-safe.
class MeshWaits {
 public:
  // Ends every waitSend and waitRecv of the mesh's buffers now, and the first wait of each
  // buffer made later: those waits return false, and the collective then fails on its failed
  // pairs (the caller fails them first). Idempotent.
  void AbortAll();
  // Whether AbortAll was called: a collective that returned after it may have ended a wait
  // early, so its result is not to be trusted.
  bool aborted() const;

  // For the mesh's buffers (gloo_mesh.cc): each registers while it lives.
  void Add(gloo::transport::UnboundBuffer* buffer);
  void Remove(gloo::transport::UnboundBuffer* buffer);

 private:
  mutable absl::Mutex mu_;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<gloo::transport::UnboundBuffer*> live_ ABSL_GUARDED_BY(mu_);
};

// Connects the full mesh of `size` members through `store`, as Gloo's connectFullMesh does
// (each member publishes the addresses of its pairs under "<rank>", then connects each pair to
// the address its peer published for it), with every wait watched by `cancel`: a cancel fails
// the pairs, which wakes a connect in progress. connectFullMesh is not used: it waits for each
// peer up to five times the timeout and cannot be interrupted. The store's waits end at
// `deadline`; `timeout` is the transport's and the context's. `peers` receives each member's
// data address (unset where the transport is not TCP). Throws what Gloo and the store throw.
//
// Only members join the mesh. Gloo's TCP transport takes the first connection that reaches a
// pair's port, whoever made it; so with each pair address a member publishes a random key, and
// before any byte of a collective the two ends of every pair prove that they hold the pair's
// secret (pair_proof.h: fresh nonces each way, an HMAC-SHA256 over both). The store is the
// coordinator's, which hands these records only to the credentialed members of the subgroup.
// A pair whose connect fails (the port was taken) or whose proof fails or stays silent (within a
// quarter of `timeout`, 2-10 s) is logged naming where it came from, closed, and set up again by
// both ends under the keys "<rank>/<peer>/<attempt>", each attempt given `timeout` to meet; after
// four attempts the set-up fails UNAVAILABLE with kStrayConnection and the peer's rank. Nothing
// of a collective is sent on a pair that has not proven itself. Every unbound buffer the
// context makes is registered with `waits` (not null).
absl::StatusOr<std::shared_ptr<gloo::Context>> ConnectMesh(
    gloo::rendezvous::Store& store, std::shared_ptr<gloo::transport::Device> device, int rank,
    int size, absl::Duration timeout, absl::Time deadline,
    const std::shared_ptr<SetupCanceller>& cancel, std::vector<sockaddr_storage>* peers,
    std::shared_ptr<MeshWaits> waits);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_COMM_GLOO_GLOO_MESH_H_
