// A host's heartbeat relay (ClientOptions::heartbeat_relay_dir): the processes of one host that
// reach the same coordinator carry all their beats in one HostHeartbeatStream. The first process
// to take the relay's lock (a file in the relay directory) serves HostHeartbeatStream on a Unix
// socket beside it; the others' shared streams (client/heartbeat/heartbeat_hub.h) go to that socket instead
// of the coordinator, and the relay's hub forwards their beats in its own messages to the
// coordinator and routes each answer back to the process whose member it is. When the relay's
// process dies (or has no rank left), its lock is free and its socket refuses connections: the
// next process to try the lock serves in its place, and the others connect to it.
//
// What the relay forwards is what its followers sent: a member's beat goes out once, in the next
// message (at most one beat interval later), so that a follower that stops beating is timed out
// by the coordinator as if it beat directly. A follower whose connection breaks without closing
// (its process died) has each of its members forwarded as `lost`: the coordinator counts that as
// the member's own stream breaking (an elastic job declares it dead at half its heartbeat
// timeout, as without the relay).
//
// Bounds: at most kMaxMembers members through one relay (a follower stream asking for more ends
// with RESOURCE_EXHAUSTED), at most 4096 beats per follower message. The relay directory must be
// the caller's own and closed to others (mode 0700 or stricter): whoever can connect to the
// socket sees the members' credentials.
#ifndef MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_RELAY_H_
#define MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_RELAY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/heartbeat_keepalive.h"
#include "grpcpp/grpcpp.h"
#include "modelavg/v1/coordinator.grpc.pb.h"

namespace modelavg::client {

// Where the relay of one coordinator lives in a relay directory.
struct RelayPaths {
  std::string lock;    // held (flock) by the serving process, which writes its pid there
  std::string socket;  // the Unix socket it serves on
};

// The paths for the coordinator `key` names (addresses, token, TLS files) in `dir`, creating
// `dir` (mode 0700) if it is missing; the names hold a hash of `key` and of the host's name. A
// directory on a shared file system gets a relay per host. INVALID_ARGUMENT when `dir` is not
// absolute, not a directory, not the caller's, open to group or others, or longer than 82 bytes
// (a Unix socket's path in it would not fit).
absl::StatusOr<RelayPaths> RelayPathsFor(const std::string& dir, const std::string& key);

// The relay's lock, taken without waiting: an open descriptor holding it, -1 when another
// process holds it. Errors: the lock file cannot be opened.
absl::StatusOr<int> TryRelayLock(const RelayPaths& paths);

class HeartbeatRelay {
 public:
  // Members through one relay: as many as its one stream to the coordinator may carry.
  static constexpr size_t kMaxMembers = kMaxHostStreamMembers;

  // Serves on paths.socket; `lock_fd` (from TryRelayLock) is released with the relay. `wake`
  // runs (on a gRPC thread, no lock held) when a member is new to the relay, so that its first
  // beat goes out soon. Errors: the socket cannot be bound.
  static absl::StatusOr<std::unique_ptr<HeartbeatRelay>> Start(const RelayPaths& paths,
                                                               int lock_fd,
                                                               std::function<void()> wake);
  // Ends every follower stream (UNAVAILABLE, so that they go to the relay that takes over), stops
  // serving, removes the socket and releases the lock.
  ~HeartbeatRelay();
  HeartbeatRelay(const HeartbeatRelay&) = delete;
  HeartbeatRelay& operator=(const HeartbeatRelay&) = delete;

  // The hub's side, on its thread. A beat taken for the next message to the coordinator.
  struct Taken {
    std::pair<std::string, int32_t> key;
    uint64_t seq;
  };
  // Adds to *request the beats the followers sent since they were last sent (at most `room`),
  // with `lost` for the members of a follower gone, and `closing` for every member when
  // `closing_all` (the relay stops). Returns what was taken, for Sent.
  std::vector<Taken> Collect(size_t room, bool closing_all, v1::HostHeartbeatRequest* request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The message with those beats was written: they are not sent again (a beat newer since, is).
  void Sent(const std::vector<Taken>& taken) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether any follower member is on the relay.
  bool has_members() const ABSL_LOCKS_EXCLUDED(mu_);
  // The shortest beat interval of the followers (InfiniteDuration when none says).
  absl::Duration Interval() const ABSL_LOCKS_EXCLUDED(mu_);
  // How often the coordinator must write for the followers' keep-alives: half the shortest
  // reply_interval_ms they ask for (kMaxReplyIntervalMs when none).
  int64_t ReplyIntervalMs() const ABSL_LOCKS_EXCLUDED(mu_);
  // A reply from the coordinator: each member's answer goes to the follower that carries it,
  // and a follower that nothing was written to for half its keep-alive gets an empty reply.
  void Deliver(const v1::HostHeartbeatResponse& reply) ABSL_LOCKS_EXCLUDED(mu_);
  // The hub's stream to the coordinator ended: every follower stream ends with `status` (they
  // re-open, or fall back to streams of their own for UNIMPLEMENTED), and their members are off
  // the relay. With `unsupported`, later follower streams end at once with the same status.
  void EndAll(const absl::Status& status, bool unsupported = false) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Follower;
  using Key = std::pair<std::string, int32_t>;  // (job_id, rank)
  struct Remote {
    Follower* owner = nullptr;  // nullptr: its follower is gone (a lost beat is pending)
    v1::HeartbeatRequest beat;  // the latest (lost or closing once it ends)
    uint64_t seq = 0;           // bumped by every beat
    bool pending = false;       // not yet sent
  };

  HeartbeatRelay(RelayPaths paths, int lock_fd, std::function<void()> wake);
  class Service;

  // From a follower's read: records its beats. Not OK: the follower's stream ends with it.
  absl::Status Take(Follower* from, const v1::HostHeartbeatRequest& request, bool* woke)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The follower's stream ended without closing its members: each becomes a lost beat.
  void Lose(Follower* from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The follower's reactor is done (its OnDone).
  void Forget(Follower* from) ABSL_LOCKS_EXCLUDED(mu_);

  const RelayPaths paths_;
  const int lock_fd_;
  const std::function<void()> wake_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;

  mutable absl::Mutex mu_;
  std::map<Key, Remote> remotes_ ABSL_GUARDED_BY(mu_);
  std::set<Follower*> followers_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status unsupported_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_RELAY_H_
