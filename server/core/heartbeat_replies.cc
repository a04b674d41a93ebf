#include "server/core/heartbeat_replies.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace modelavg::server {

bool SameHeartbeatNews(const v1::HeartbeatResponse& a, const v1::HeartbeatResponse& b) {
  if (a.state() != b.state() || a.generation() != b.generation() ||
      a.has_last_change() != b.has_last_change()) {
    return false;
  }
  // A plan the member lacks, or a proposal to answer (docs/plan-updates.md), is news at once.
  if (a.proposed_plan() != b.proposed_plan() ||
      a.plan_changes_size() != b.plan_changes_size()) {
    return false;
  }
  const v1::GenerationChange& x = a.last_change();
  const v1::GenerationChange& y = b.last_change();
  return x.generation() == y.generation() && x.rank() == y.rank() && x.reason() == y.reason() &&
         x.unix_ms() == y.unix_ms();
}

absl::StatusOr<HeartbeatReplies> HeartbeatReplies::Create(int64_t reply_interval_ms,
                                                          const Clock* clock) {
  if (reply_interval_ms < 0 || reply_interval_ms > kMaxReplyIntervalMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reply_interval_ms is ", reply_interval_ms, ": it must be in 0..", kMaxReplyIntervalMs,
        " (0: one reply per beat; otherwise replies on change and at least that often)"));
  }
  return HeartbeatReplies(absl::Milliseconds(reply_interval_ms), clock);
}

bool HeartbeatReplies::Due(const v1::HeartbeatResponse& reply) {
  const absl::Time now = clock_->Now();
  if (!per_beat() && replied_ && SameHeartbeatNews(reply, last_) && now - last_time_ < interval_) {
    return false;
  }
  last_ = reply;
  last_time_ = now;
  replied_ = true;
  return true;
}

}  // namespace modelavg::server
