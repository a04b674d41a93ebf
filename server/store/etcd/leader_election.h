// One leader at a time among the coordinators on the same etcd endpoints and prefix.
//
// Each coordinator holds an etcd lease of `ttl`, kept alive every ttl/3. It campaigns with a
// transaction that creates the key PREFIX"leader" (value: its advertised address, attached to its
// lease) only if the key does not exist (create_revision == 0). The winner's fence is that key's
// create_revision: every write of the state store (server/store/etcd/etcd_state_store.h) is a transaction
// conditioned on the key still having it, so once the lease has expired and another
// coordinator has created the key anew, etcd refuses the old leader's writes.
//
// Serving is bounded by a local deadline as well: the leader serves only until send time of its
// last acknowledged keep-alive + the lease's TTL (less a margin), a point etcd's own expiry
// cannot precede. A leader that was paused (SIGSTOP, a long GC-like stall) or cut off from etcd
// thus stops answering the moment it runs again, before anything else: it steps down (`deposed`),
// and campaigns again. A standby polls the key, so it takes over within about the TTL.
#ifndef MODELAVG_SERVER_STORE_ETCD_LEADER_ELECTION_H_
#define MODELAVG_SERVER_STORE_ETCD_LEADER_ELECTION_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/store/etcd/etcd_client.h"
#include "server/store/etcd/etcd_fence.h"

namespace modelavg::server {

struct LeaderElectionOptions {
  // The key campaigned for (PREFIX"leader").
  std::string key;
  // The lease's TTL (etcd counts whole seconds: rounded up, at least 2 s).
  absl::Duration ttl = absl::Seconds(5);
};

class LeaderElection final : public EtcdFence {
 public:
  // Called on the election's thread. `elected(fence)` makes this coordinator the leader: it
  // loads the state and returns OK to start serving, an error to step down again.
  // `deposed(why)` tells it to stop serving: the lease ran out, etcd refused a write, or the
  // election stops.
  // `fatal(status)`: before this coordinator has ever had an answer to a campaign, etcd refused
  // its options for good (authentication, TLS; or every connection closed unanswered for
  // kFatalAfter): the election has stopped and `status` (FAILED_PRECONDITION) says what to fix.
  // Unset: only logged.
  struct Callbacks {
    std::function<absl::Status(int64_t fence)> elected;
    std::function<void(const std::string& why)> deposed;
    std::function<void(const absl::Status& status)> fatal;
  };
  // How long connections closed unanswered (EtcdProblem::kClosesConnections) are retried before
  // they are a fatal misconfiguration.
  static constexpr absl::Duration kFatalAfter = absl::Seconds(10);

  // `etcd` is not owned and outlives this object.
  LeaderElection(EtcdClient* etcd, LeaderElectionOptions options, Callbacks callbacks);
  ~LeaderElection() override;  // Stop()

  // Starts campaigning on a thread of its own; `advertise` is what standbys tell clients: this
  // coordinator's address, as they dial it.
  void Start(const std::string& advertise);
  // Steps down (deposed), hands the key over (deletes it if it is still this coordinator's) and
  // revokes the lease, so a standby takes over at once. Idempotent.
  void Stop();

  // OK while this coordinator leads and its lease is certainly alive; otherwise UNAVAILABLE
  // saying so and naming the leader if known (`leader` gets its address, empty if none).
  // Cheap: every RPC asks.
  absl::Status CheckServing(std::string* leader = nullptr) const;

  // The fence of the current term (the leader key's create_revision), 0 when not leading.
  int64_t fence() const override;
  const std::string& key() const override { return options_.key; }

  // The state store saw etcd refuse a write fenced with `fence` (another leader), or a write
  // whose fate is unknown: the term ends (deposed, on the election's thread) and the
  // coordinator campaigns again (and reloads). Any thread.
  void LostLeadership(int64_t fence, const std::string& why) override;

 private:
  using SteadyTime = std::chrono::steady_clock::time_point;
  void Run();
  // Keeps the lease alive (granting a new one when it is gone). False when etcd is unreachable.
  bool KeepAlive();
  // One campaign: true when this coordinator won (fence_ set).
  bool Campaign();
  void StepDown(const std::string& why);
  // Logs the last etcd error (at most every few seconds while it stays the same) and says
  // whether it is fatal (see Callbacks::fatal); OK when there is none or it may pass.
  absl::Status ReviewEtcdError();
  std::string Describe() const;

  EtcdClient* const etcd_;
  const LeaderElectionOptions options_;
  const Callbacks callbacks_;
  const int64_t ttl_seconds_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::string advertise_ ABSL_GUARDED_BY(mu_);
  // This coordinator's lease (0: none) and until when it is certainly alive.
  int64_t lease_id_ ABSL_GUARDED_BY(mu_) = 0;
  SteadyTime lease_alive_until_ ABSL_GUARDED_BY(mu_);
  SteadyTime next_keepalive_ ABSL_GUARDED_BY(mu_);
  // Leading: the term's fence (0: not leading) and whether serving has started.
  int64_t fence_ ABSL_GUARDED_BY(mu_) = 0;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  // Set by LostLeadership for the Run loop.
  std::string lost_ ABSL_GUARDED_BY(mu_);
  // The leader's address as last read from etcd (maybe this coordinator's).
  std::string leader_ ABSL_GUARDED_BY(mu_);
  // Why this coordinator is not serving, for CheckServing.
  std::string not_serving_why_ ABSL_GUARDED_BY(mu_);
  // The last etcd call's error (OK after a success), and whether a campaign has ever been
  // answered (after which no error is fatal: the options worked).
  absl::Status etcd_error_ ABSL_GUARDED_BY(mu_);
  bool campaign_answered_ ABSL_GUARDED_BY(mu_) = false;
  // Since when every call failed with connections closed unanswered (kClosesConnections).
  SteadyTime closing_since_{};
  // What was logged last, and when (the election's thread only).
  std::string logged_;
  SteadyTime logged_at_{};
  std::thread thread_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_STORE_ETCD_LEADER_ELECTION_H_
