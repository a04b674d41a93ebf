// When a beat of a HeartbeatStream gets a reply (see HeartbeatStream in coordinator.proto): with
// reply_interval_ms = 0 every beat; otherwise the stream's first beat, a beat whose answer says
// something the last reply did not (the job's state, generation or last change), and, when
// nothing changes, one beat per reply_interval_ms, so that the worker can tell a live coordinator
// from a silent one. One per stream, used by its read path only: no lock, no gRPC; time comes
// from the core's clock.
#ifndef MODELAVG_SERVER_CORE_HEARTBEAT_REPLIES_H_
#define MODELAVG_SERVER_CORE_HEARTBEAT_REPLIES_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/heartbeat_keepalive.h"
#include "modelavg/v1/coordinator.pb.h"

namespace modelavg::server {

// Whether two heartbeat replies say the same (state, generation, last change, the plans the
// member lacks and the proposal under way): the second need
// not be sent. (coordinator_incarnation is the same for a stream's whole life;
// recovery_grace_ms only shrinks.)
bool SameHeartbeatNews(const v1::HeartbeatResponse& a, const v1::HeartbeatResponse& b);

class HeartbeatReplies {
 public:
  // Longest reply_interval_ms a stream may ask for.
  static constexpr int64_t kMaxReplyIntervalMs = modelavg::kMaxReplyIntervalMs;

  // From the stream's first beat. INVALID_ARGUMENT when reply_interval_ms is outside
  // 0..kMaxReplyIntervalMs. `clock` outlives this.
  static absl::StatusOr<HeartbeatReplies> Create(int64_t reply_interval_ms, const Clock* clock);

  // Every beat is answered, each before the next is read.
  bool per_beat() const { return interval_ == absl::ZeroDuration(); }

  // Whether `reply`, the job's answer to the beat just recorded, is sent; a reply that is sent
  // becomes the last one.
  bool Due(const v1::HeartbeatResponse& reply);

 private:
  HeartbeatReplies(absl::Duration interval, const Clock* clock)
      : interval_(interval), clock_(clock) {}

  absl::Duration interval_;
  const Clock* clock_;
  bool replied_ = false;
  v1::HeartbeatResponse last_;
  absl::Time last_time_;
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_CORE_HEARTBEAT_REPLIES_H_
