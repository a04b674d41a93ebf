// The beats of every rank of this process that talks to one coordinator, carried in one
// HostHeartbeatStream (ClientOptions::share_heartbeat_stream): one message per beat interval
// holds all their beats, so that the coordinator pays its per-message cost once per process
// rather than once per rank. One thread per hub beats at the shortest interval of its members,
// re-opens a broken or silent stream with backoff, and hands each member its replies, its
// generation changes and its failures through the member's Heartbeat hooks, on that thread. A
// coordinator without the RPC (an older version): every member is told, and falls back to a
// stream of its own. With a relay directory (ClientOptions::heartbeat_relay_dir) the hubs of the
// host's processes share one stream too: one of them serves the others (client/heartbeat/heartbeat_relay.h)
// and the others' streams go to it, each taking over when the one that serves is gone.
#ifndef MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_HUB_H_
#define MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_HUB_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/heartbeat/heartbeat.h"
#include "client/heartbeat/heartbeat_relay.h"
#include "client/rpc/coordinator_client.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

class HeartbeatHub {
 public:
  // The hub of this process for the coordinator `options` reach (the same addresses,
  // credentials and TLS files): made on first use, gone with the last Heartbeat that holds it.
  // The CoordinatorClient's errors (unreadable TLS files, ...).
  // With `relay_dir`, the hub shares the host's relay there (RelayPathsFor's errors).
  static absl::StatusOr<std::shared_ptr<HeartbeatHub>> For(
      const ConnectionOptions& options, const std::string& relay_dir = "");

  ~HeartbeatHub();
  HeartbeatHub(const HeartbeatHub&) = delete;
  HeartbeatHub& operator=(const HeartbeatHub&) = delete;

  // Adds a member: its beats go out from the next message on. `unsupported` runs (on the hub's
  // thread) when the coordinator has no HostHeartbeatStream; the member is then off the hub.
  // Returns the member's id for Remove.
  uint64_t Add(const Heartbeat::Options& options, Heartbeat::Hooks hooks,
               std::function<void()> unsupported) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes a member off: its last beat says it ends on purpose (closing), written within about
  // 200 ms, and none of its hooks runs after this returns. Never called from a hook.
  void Remove(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Member {
    Heartbeat::Options options;
    Heartbeat::Hooks hooks;
    std::function<void()> unsupported;
    // The member's last answer, re-delivered for a keep-alive (its recovery_grace_ms cleared:
    // only a fresh answer extends a recovery window).
    std::optional<v1::HeartbeatResponse> last;
    bool removing = false;  // Remove waits for its closing beat
  };

  HeartbeatHub(std::unique_ptr<CoordinatorClient> coordinator,
               std::optional<RelayPaths> relay_paths);
  void Loop();
  // With a relay directory, before each stream: serves the host's relay if its lock is free
  // (kLeader), else goes to the relay that serves (kFollower). Hub thread only.
  void PickRoute();
  // The relay has a new member (its first beat goes out now).
  void Wake() ABSL_LOCKS_EXCLUDED(mu_);
  // Beats over one stream until it ends, stays silent past the members' shortest heartbeat
  // timeout, or the hub has no member left. Returns why it ended (OK: no member left);
  // *answered: a reply came.
  absl::Status Stream(bool* answered) ABSL_LOCKS_EXCLUDED(mu_);
  // Hands the replies that came to their members (on the hub's thread, outside mu_).
  void Deliver(const std::vector<v1::HostHeartbeatResponse>& replies)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every member's failure hook (the stream ended).
  void FailAll(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_);
  // The next message: a beat for each member (closing for those being removed, which are then
  // dropped), and the keep-alive the members need.
  // The relay's followers' beats are added (all closing with `closing_all`); *taken says which,
  // for HeartbeatRelay::Sent.
  v1::HostHeartbeatRequest NextRequest(bool* dropped, bool closing_all,
                                       std::vector<HeartbeatRelay::Taken>* taken)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool WakeUp() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || stream_ended_ || !inbox_.empty() || changed_;
  }
  absl::Duration Interval() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the members being removed (their closing beat is out, or no stream carries them);
  // only the hub's thread drops members.
  void DropRemoved() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Duration Timeout() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<CoordinatorClient> coordinator_;
  // The host's relay, when there is a relay directory (the hub's thread's, as is what follows).
  std::optional<RelayPaths> relay_paths_;
  enum class Route { kDirect, kLeader, kFollower };
  Route route_ = Route::kDirect;
  std::unique_ptr<HeartbeatRelay> relay_;   // kLeader: serving the host's other processes
  std::unique_ptr<CoordinatorClient> local_;  // kFollower: to the relay's socket
  // kFollower: the last stream to the relay went silent; streams to it in a row unanswered.
  bool relay_silent_ = false;
  int relay_failures_ = 0;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;  // a member was added or is being removed
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Member> members_ ABSL_GUARDED_BY(mu_);
  // The current stream: replies not yet delivered, when the last one came, and its end.
  std::vector<v1::HostHeartbeatResponse> inbox_ ABSL_GUARDED_BY(mu_);
  absl::Time last_reply_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;
  // The coordinator has no HostHeartbeatStream: members are sent to streams of their own.
  bool unsupported_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_HUB_H_
