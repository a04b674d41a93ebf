// The heartbeat of one rank: a thread that reports the rank's step every interval, over one
// HeartbeatStream (falling back to one unary Heartbeat call per beat for a coordinator without
// it), re-opens a broken or silent stream with backoff, and hands every reply, generation change
// and failure to its owner (the Client), which decides what they mean. With Options::share, the
// rank's beats go instead with those of the process's other ranks in one HostHeartbeatStream
// (client/heartbeat/heartbeat_hub.h), and its own thread starts only for a coordinator without it.
#ifndef MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_H_
#define MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::client {

class CoordinatorClient;
class HeartbeatHub;

class Heartbeat {
 public:
  // What a beat reports, and the latest generation the owner has seen.
  struct Beat {
    int64_t step = 0;
    int64_t generation = 0;
    int64_t seen = 0;
    // The plans the rank holds and how far it may use them (HeartbeatRequest's fields).
    int32_t plans_known = 1;
    int64_t used_through = -1;
    int32_t proposal_answered = 0;
    // The rank's steps per second outside its averaging calls (PaceTracker); 0: not measured.
    double compute_steps_per_second = 0;
  };
  struct Options {
    std::string coordinator;  // the address, for the logs
    std::string job_id;
    int32_t rank = 0;
    std::string credential;
    absl::Duration interval;
    // The job's heartbeat timeout: a stream silent for longer is re-opened.
    absl::Duration timeout;
    bool stream = true;
    // Carry the beats in the process's shared HostHeartbeatStream to this coordinator.
    bool share = false;
    // With share: the host's relay directory (ClientOptions::heartbeat_relay_dir); empty: none.
    std::string relay_dir;
  };
  // The owner's side. `current` and `on_reply` may run on gRPC threads and must not block;
  // `on_change` and `on_failure` run on the heartbeat thread (a shared stream's: every hook).
  struct Hooks {
    std::function<Beat()> current;
    // Any reply (the coordinator is reachable).
    std::function<void(const v1::HeartbeatResponse&)> on_reply;
    // A reply whose generation may be new to the owner (`seen`: the latest it had then).
    std::function<void(const v1::HeartbeatResponse&, int64_t seen)> on_change;
    // A failed beat or a stream that ended.
    std::function<void(const absl::Status&)> on_failure;
  };

  // `coordinator` outlives this. Starts the thread (or joins the shared stream).
  Heartbeat(CoordinatorClient& coordinator, Options options, Hooks hooks);
  // Stops.
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Ends the thread (an open stream is closed saying so) and waits for it. Idempotent; never
  // called from a hook.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The rank's own thread (its stream, or unary calls).
  void StartOwnThread() ABSL_LOCKS_EXCLUDED(thread_mu_);
  void Loop();
  // One unary beat after the interval. False once stopping.
  bool Unary() ABSL_LOCKS_EXCLUDED(mu_);
  // Beats over one HeartbeatStream until it ends, stays silent past the timeout, or stopping.
  // Returns why it ended (OK when stopping); *answered: a reply came.
  absl::Status Stream(bool* answered) ABSL_LOCKS_EXCLUDED(mu_);
  void OnStreamReply(const v1::HeartbeatResponse& reply) ABSL_LOCKS_EXCLUDED(mu_);
  bool WakeUp() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || stream_ended_ || stream_change_.has_value();
  }

  CoordinatorClient& coordinator_;
  const Options options_;
  const Hooks hooks_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // When the last reply came.
  absl::Time last_reply_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // The current stream has ended; a reply with a generation change to act on.
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<v1::HeartbeatResponse> stream_change_ ABSL_GUARDED_BY(mu_);
  // Set when shared: the hub and this rank's id there.
  std::shared_ptr<HeartbeatHub> hub_;
  uint64_t hub_id_ = 0;
  absl::Mutex thread_mu_;  // the hub's thread may start thread_ (no HostHeartbeatStream)
  std::thread thread_ ABSL_GUARDED_BY(thread_mu_);
};

// When a beat stream was opened, and whether it has been silent for too long: a connection that
// answers nothing for longer than the heartbeat timeout (counted from the opening at the
// earliest) is likely dead without gRPC having noticed, and the stream is re-opened. Shared by a
// rank's own stream and the process's shared one.
struct StreamSilence {
  absl::Time opened = absl::Now();
  // UNAVAILABLE naming `rpc` when nothing came since max(last_reply, opened) for over `timeout`.
  absl::Status Check(absl::Time now, absl::Time last_reply, absl::Duration timeout,
                     const char* rpc) const;
};

// Between failed beat streams the wait starts at one beat interval and doubles, to at most a
// quarter of the heartbeat timeout (so that a coordinator back from a blip hears the rank in
// time) or 1 s, and never below the interval: that ceiling.
absl::Duration MaxStreamBackoff(absl::Duration interval, absl::Duration timeout);

// The beat a rank with these options sends.
v1::HeartbeatRequest BeatRequest(const Heartbeat::Options& options, const Heartbeat::Beat& beat);

}  // namespace modelavg::client

#endif  // MODELAVG_CLIENT_HEARTBEAT_HEARTBEAT_H_
