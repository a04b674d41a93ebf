#include "client/heartbeat/heartbeat.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/heartbeat/heartbeat_hub.h"
#include "client/rpc/coordinator_client.h"
#include "common/heartbeat_keepalive.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

Heartbeat::Heartbeat(CoordinatorClient& coordinator, Options options, Hooks hooks)
    : coordinator_(coordinator), options_(std::move(options)), hooks_(std::move(hooks)) {
  if (options_.share && options_.stream) {
    absl::StatusOr<std::shared_ptr<HeartbeatHub>> hub = HeartbeatHub::For(coordinator_.options(), options_.relay_dir);
    if (hub.ok()) {
      hub_ = *std::move(hub);
      hub_id_ = hub_->Add(options_, hooks_, [this] { StartOwnThread(); });
      return;
    }
    spdlog::warn("rank {} heartbeats on a stream of its own: no shared stream to {} ({})",
                 options_.rank, options_.coordinator, hub.status().ToString());
  }
  StartOwnThread();
}

Heartbeat::~Heartbeat() { Stop(); }

void Heartbeat::StartOwnThread() {
  absl::MutexLock l(&thread_mu_);
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Heartbeat::Stop() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (hub_ != nullptr) {
    // After Remove no hook runs from the hub (nor can it start this rank's own thread).
    hub_->Remove(hub_id_);
    hub_.reset();
  }
  std::thread thread;
  {
    absl::MutexLock l(&thread_mu_);
    thread.swap(thread_);
  }
  if (thread.joinable()) thread.join();
}

absl::Duration MaxStreamBackoff(absl::Duration interval, absl::Duration timeout) {
  return std::max(interval, std::min(absl::Seconds(1), timeout / 4));
}

absl::Status StreamSilence::Check(absl::Time now, absl::Time last_reply, absl::Duration timeout,
                                  const char* rpc) const {
  const absl::Duration silent = now - std::max(last_reply, opened);
  if (silent <= timeout) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("no reply on the ", rpc, " for ", absl::FormatDuration(silent)));
}

v1::HeartbeatRequest BeatRequest(const Heartbeat::Options& options, const Heartbeat::Beat& beat) {
  v1::HeartbeatRequest req;
  req.set_job_id(options.job_id);
  req.set_rank(options.rank);
  req.set_generation(beat.generation);
  req.set_step(beat.step);
  req.set_credential(options.credential);
  req.set_plans_known(beat.plans_known);
  req.set_used_through(beat.used_through);
  req.set_proposal_answered(beat.proposal_answered);
  req.set_compute_steps_per_second(beat.compute_steps_per_second);
  return req;
}

void Heartbeat::Loop() {
  bool stream = options_.stream;
  // Between failed streams: from one beat interval, doubling (MaxStreamBackoff).
  const absl::Duration min_backoff = options_.interval;
  const absl::Duration max_backoff = MaxStreamBackoff(min_backoff, options_.timeout);
  absl::Duration backoff = min_backoff;
  while (true) {
    if (!stream) {
      if (!Unary()) return;
      continue;
    }
    bool answered = false;
    const absl::Status s = Stream(&answered);
    {
      absl::MutexLock l(&mu_);
      if (stopping_) return;
    }
    if (absl::IsUnimplemented(s) && !answered) {
      spdlog::warn("the coordinator at {} has no HeartbeatStream (an older version): "
                   "heartbeating with one call per beat", options_.coordinator);
      stream = false;
      continue;
    }
    if (answered) backoff = min_backoff;
    spdlog::debug("heartbeat stream to {} ended: {}; re-opening in {}", options_.coordinator,
                  s.ToString(), absl::FormatDuration(backoff));
    hooks_.on_failure(s);
    {
      absl::MutexLock l(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff)) return;
    }
    backoff = std::min(backoff * 2, max_backoff);
  }
}

bool Heartbeat::Unary() {
  {
    absl::MutexLock l(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.interval)) return false;
  }
  const Beat beat = hooks_.current();
  absl::StatusOr<v1::HeartbeatResponse> resp = coordinator_.Heartbeat(BeatRequest(options_, beat));
  if (!resp.ok()) {
    hooks_.on_failure(resp.status());
    return true;
  }
  {
    absl::MutexLock l(&mu_);
    last_reply_ = absl::Now();
  }
  hooks_.on_reply(*resp);
  hooks_.on_change(*resp, beat.seen);
  return true;
}

absl::Status Heartbeat::Stream(bool* answered) {
  {
    absl::MutexLock l(&mu_);
    stream_ended_ = false;
    stream_change_.reset();
  }
  // The coordinator stays silent while nothing changes; it answers at least this often, well
  // within the silence after which the stream is re-opened (common/heartbeat_keepalive.h).
  const int64_t reply_interval_ms = StreamReplyIntervalMs(options_.timeout, options_.interval);
  std::unique_ptr<HeartbeatStreamCall> call = coordinator_.StartHeartbeatStream(
      [this](const v1::HeartbeatResponse& reply) { OnStreamReply(reply); },
      [this] {
        absl::MutexLock l(&mu_);
        stream_ended_ = true;
      });
  const StreamSilence silence_check;
  const absl::Time opened = silence_check.opened;
  absl::Time next_beat = opened;
  absl::Status silence;
  bool first = true;
  while (true) {
    absl::Time last_reply;
    std::optional<v1::HeartbeatResponse> change;
    bool ended;
    {
      absl::MutexLock l(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(this, &Heartbeat::WakeUp), next_beat);
      if (stopping_) break;
      change.swap(stream_change_);
      ended = stream_ended_;
      last_reply = last_reply_;
    }
    const Beat beat = hooks_.current();
    if (change.has_value()) {
      *answered = true;
      hooks_.on_change(*change, beat.seen);
    }
    if (ended) break;
    const absl::Time now = absl::Now();
    silence = silence_check.Check(now, last_reply, options_.timeout, "HeartbeatStream");
    if (!silence.ok()) break;
    if (last_reply > opened) *answered = true;
    if (now < next_beat) continue;  // woken early for a reply
    v1::HeartbeatRequest req = BeatRequest(options_, beat);
    if (first) req.set_reply_interval_ms(reply_interval_ms);
    // A beat not sent because the previous write is still in flight is simply skipped; the
    // first one is retried until it goes out (it carries reply_interval_ms).
    if (call->Write(req)) first = false;
    next_beat = std::max(next_beat + options_.interval, now);
  }
  bool stopping;
  {
    absl::MutexLock l(&mu_);
    stopping = stopping_;
  }
  // Stopping: say so, so that the coordinator does not take the stream's end for a lost
  // connection (an elastic job declares such a member dead sooner).
  v1::HeartbeatRequest closing = BeatRequest(options_, hooks_.current());
  closing.set_closing(true);
  const absl::Status status = stopping ? call->Finish(&closing) : call->Finish();
  if (!silence.ok()) return silence;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return absl::OkStatus();
  }
  return status.ok() ? absl::UnavailableError("the coordinator ended the HeartbeatStream")
                     : status;
}

void Heartbeat::OnStreamReply(const v1::HeartbeatResponse& reply) {
  hooks_.on_reply(reply);
  const Beat beat = hooks_.current();
  absl::MutexLock l(&mu_);
  last_reply_ = absl::Now();
  if (reply.generation() != beat.generation && reply.generation() != beat.seen) {
    stream_change_ = reply;
  }
}

}  // namespace modelavg::client
