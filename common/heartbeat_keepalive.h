// How often a worker's HeartbeatStream asks to be answered when nothing changes
// (HeartbeatRequest.reply_interval_ms): the keep-alive by which the worker tells a live
// coordinator from a silent one, and most of what a streamed beat costs the coordinator (a
// reply costs it more than the beat itself).
//
// The worker re-opens a stream that has been silent for longer than the job's heartbeat timeout
// T. The coordinator answers the first beat after the interval K has passed since its last reply,
// so with beats every P a silence lasts at most K + P (and the network's delay). K = (T - P) / 3
// keeps that at (T + 2P) / 3: two thirds of the slack T - P are left for the network and
// scheduling. K is never shorter than min(1 s, T / 3), what earlier clients asked for (no stream
// is answered more often than before), and at most kMaxReplyIntervalMs.
#ifndef MODELAVG_COMMON_HEARTBEAT_KEEPALIVE_H_
#define MODELAVG_COMMON_HEARTBEAT_KEEPALIVE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/time/time.h"

namespace modelavg {

// The longest reply_interval_ms a HeartbeatStream may ask for.
inline constexpr int64_t kMaxReplyIntervalMs = 60000;

// A HostHeartbeatStream's bounds (coordinator.proto): beats in one request, and members one
// stream tracks. The coordinator enforces them; a host's relay, which forwards its followers'
// beats in one such stream, holds to them too.
inline constexpr size_t kMaxHostBeatsPerRequest = 4096;
inline constexpr size_t kMaxHostStreamMembers = 4096;

// reply_interval_ms for a stream that beats every `beat_interval` in a job whose heartbeat
// timeout is `heartbeat_timeout`: in 1..kMaxReplyIntervalMs.
inline int64_t StreamReplyIntervalMs(absl::Duration heartbeat_timeout,
                                     absl::Duration beat_interval) {
  const int64_t t = absl::ToInt64Milliseconds(heartbeat_timeout);
  const int64_t p = absl::ToInt64Milliseconds(beat_interval);
  const int64_t earlier = std::min<int64_t>(1000, t / 3);
  const int64_t slack = std::max<int64_t>(0, t - p) / 3;
  return std::clamp<int64_t>(std::max(earlier, slack), 1, kMaxReplyIntervalMs);
}

}  // namespace modelavg

#endif  // MODELAVG_COMMON_HEARTBEAT_KEEPALIVE_H_
