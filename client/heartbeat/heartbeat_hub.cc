#include "client/heartbeat/heartbeat_hub.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/heartbeat_keepalive.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

// The hubs of this process, by what reaches their coordinator.
absl::Mutex hubs_mu(absl::kConstInit);
std::map<std::string, std::weak_ptr<HeartbeatHub>>* hubs ABSL_GUARDED_BY(hubs_mu) = nullptr;

std::string KeyOf(const ConnectionOptions& o) {
  return absl::StrCat(o.coordinator, "\n", o.auth_token, "\n", o.tls, "\n", o.tls_ca_file, "\n",
                      o.tls_cert_file, "\n", o.tls_key_file);
}

// A Heartbeat of one unary call per beat: written before the stream had members to share.
constexpr absl::Duration kDefaultInterval = absl::Milliseconds(100);

// Streams to the host's relay in a row that got no answer, its lock held all along, before this
// process gives up on it (with the follower's backoff, about a quarter of a second).
constexpr int kMaxRelayFailures = 5;

}  // namespace

absl::StatusOr<std::shared_ptr<HeartbeatHub>> HeartbeatHub::For(
    const ConnectionOptions& options, const std::string& relay_dir) {
  absl::MutexLock lock(&hubs_mu);
  if (hubs == nullptr) hubs = new std::map<std::string, std::weak_ptr<HeartbeatHub>>();
  for (auto it = hubs->begin(); it != hubs->end();) {
    it = it->second.expired() ? hubs->erase(it) : std::next(it);
  }
  std::weak_ptr<HeartbeatHub>& slot = (*hubs)[absl::StrCat(KeyOf(options), "\n", relay_dir)];
  if (std::shared_ptr<HeartbeatHub> hub = slot.lock()) return hub;
  std::optional<RelayPaths> paths;
  if (!relay_dir.empty()) {
    absl::StatusOr<RelayPaths> p = RelayPathsFor(relay_dir, KeyOf(options));
    if (!p.ok()) return p.status();
    paths = *std::move(p);
  }
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> coordinator =
      CoordinatorClient::Create(options);
  if (!coordinator.ok()) return coordinator.status();
  std::shared_ptr<HeartbeatHub> hub(new HeartbeatHub(*std::move(coordinator), std::move(paths)));
  slot = hub;
  return hub;
}

HeartbeatHub::HeartbeatHub(std::unique_ptr<CoordinatorClient> coordinator,
                           std::optional<RelayPaths> relay_paths)
    : coordinator_(std::move(coordinator)), relay_paths_(std::move(relay_paths)) {
  thread_ = std::thread([this] { Loop(); });
}

HeartbeatHub::~HeartbeatHub() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  relay_.reset();  // (the thread is gone: the followers go to the next relay)
}

void HeartbeatHub::Wake() {
  absl::MutexLock l(&mu_);
  changed_ = true;
}

void HeartbeatHub::PickRoute() {
  if (!relay_paths_.has_value() || route_ == Route::kLeader) return;
  auto direct = [this](const absl::Status& why) {
    spdlog::warn("heartbeat relay in {} unusable ({}): this process's ranks beat on a stream "
                 "of their own to the coordinator",
                 relay_paths_->socket, why.ToString());
    relay_paths_.reset();
    route_ = Route::kDirect;
  };
  absl::StatusOr<int> lock = TryRelayLock(*relay_paths_);
  if (!lock.ok()) return direct(lock.status());
  if (*lock < 0) {
    // Another process serves: its socket.
    if (local_ == nullptr) {
      ConnectionOptions o;
      o.coordinator = "unix:" + relay_paths_->socket;
      o.rpc_timeout = coordinator_->options().rpc_timeout;
      absl::StatusOr<std::unique_ptr<CoordinatorClient>> c = CoordinatorClient::Create(o);
      if (!c.ok()) return direct(c.status());
      local_ = *std::move(c);
    }
    if (route_ != Route::kFollower) {
      spdlog::debug("heartbeat relay: this process's beats go through {}", relay_paths_->socket);
    }
    route_ = Route::kFollower;
    return;
  }
  absl::StatusOr<std::unique_ptr<HeartbeatRelay>> relay =
      HeartbeatRelay::Start(*relay_paths_, *lock, [this] { Wake(); });
  if (!relay.ok()) return direct(relay.status());
  relay_ = *std::move(relay);
  route_ = Route::kLeader;
}

uint64_t HeartbeatHub::Add(const Heartbeat::Options& options, Heartbeat::Hooks hooks,
                           std::function<void()> unsupported) {
  {
    absl::MutexLock l(&mu_);
    if (!unsupported_) {
      const uint64_t id = next_id_++;
      members_.emplace(id, Member{options, std::move(hooks), std::move(unsupported), {}, false});
      changed_ = true;
      return id;
    }
  }
  unsupported();
  return 0;
}

void HeartbeatHub::Remove(uint64_t id) {
  absl::MutexLock l(&mu_);
  auto it = members_.find(id);
  if (it == members_.end()) return;
  it->second.removing = true;
  changed_ = true;
  // The hub's thread drops the member once its closing beat is out (within one write, or at
  // once between streams); it never blocks for long (a stream's end waits at most ~400 ms).
  auto gone = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return members_.count(id) == 0;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&gone), absl::Seconds(5))) {
    spdlog::warn("heartbeat: still waiting for the shared HostHeartbeatStream to let a member "
                 "go");
  }
}

absl::Duration HeartbeatHub::Interval() const {
  absl::Duration d = relay_ != nullptr ? relay_->Interval() : absl::InfiniteDuration();
  for (const auto& [id, m] : members_) d = std::min(d, m.options.interval);
  return d == absl::InfiniteDuration() ? kDefaultInterval : d;
}

void HeartbeatHub::DropRemoved() {
  for (auto it = members_.begin(); it != members_.end();) {
    it = it->second.removing ? members_.erase(it) : std::next(it);
  }
}

absl::Duration HeartbeatHub::Timeout() const {
  absl::Duration d = absl::InfiniteDuration();
  for (const auto& [id, m] : members_) d = std::min(d, m.options.timeout);
  return d;
}

void HeartbeatHub::Loop() {
  absl::Duration backoff = absl::ZeroDuration();
  while (true) {
    absl::Duration min_backoff, max_backoff;
    {
      absl::MutexLock l(&mu_);
      // No member: nothing to carry.
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !members_.empty();
      };
      mu_.Await(absl::Condition(&idle));
      if (stopping_) return;
      // (As a rank's own stream, for the members' shortest interval and timeout.)
      min_backoff = Interval();
      max_backoff = MaxStreamBackoff(min_backoff, Timeout());
    }
    PickRoute();
    if (route_ == Route::kFollower && (relay_silent_ || relay_failures_ >= kMaxRelayFailures)) {
      // The process that holds the relay's lock does not serve (stopped, hung, or not listening
      // yet for this long): this process beats on a stream of its own until that one breaks.
      spdlog::warn("heartbeat relay at {}: {}; this process's ranks beat on a stream of their own "
                   "to the coordinator",
                   relay_paths_->socket,
                   relay_silent_ ? "it went silent" : "it refused every connection");
      route_ = Route::kDirect;
      relay_silent_ = false;
      relay_failures_ = 0;
    }
    if (route_ == Route::kFollower) {
      // The relay is on this host: a broken stream to it is mostly a relay that died, whose
      // place another process takes within milliseconds.
      min_backoff = std::min(min_backoff, absl::Milliseconds(10));
      max_backoff = std::min(max_backoff, absl::Milliseconds(100));
    }
    if (backoff < min_backoff) backoff = min_backoff;
    bool answered = false;
    const absl::Status s = Stream(&answered);
    if (s.ok()) continue;  // stopping, or no member left
    if (absl::IsUnimplemented(s) && !answered) {
      spdlog::warn("the coordinator at {} has no HostHeartbeatStream (an older version): each "
                   "rank heartbeats on a stream of its own",
                   coordinator_->options().coordinator);
      // (The relay's followers are told the same, now and when they come.)
      if (relay_ != nullptr) relay_->EndAll(s, /*unsupported=*/true);
      std::vector<std::function<void()>*> fallbacks;
      {
        absl::MutexLock l(&mu_);
        unsupported_ = true;  // from now on Add sends a member to its own stream at once
        for (auto& [id, m] : members_) {
          if (!m.removing) fallbacks.push_back(&m.unsupported);
        }
      }
      // The members go only once their fallback has run (Remove waits for that).
      for (std::function<void()>* f : fallbacks) (*f)();
      absl::MutexLock l(&mu_);
      members_.clear();
      continue;
    }
    if (answered) backoff = min_backoff;
    relay_failures_ = route_ == Route::kFollower && !answered ? relay_failures_ + 1 : 0;
    spdlog::debug("shared heartbeat stream to {} ended: {}; re-opening in {}",
                  coordinator_->options().coordinator, s.ToString(), absl::FormatDuration(backoff));
    FailAll(s);
    if (relay_ != nullptr) relay_->EndAll(s);
    const absl::Time until = absl::Now() + backoff;
    absl::MutexLock l(&mu_);
    while (true) {
      // Members taken off meanwhile need no closing beat: no stream carries them.
      DropRemoved();
      changed_ = false;
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || changed_; };
      if (mu_.AwaitWithDeadline(absl::Condition(&wake), until)) {
        if (stopping_) return;
        continue;
      }
      break;
    }
    backoff = std::min(backoff * 2, max_backoff);
  }
}

v1::HostHeartbeatRequest HeartbeatHub::NextRequest(bool* dropped, bool closing_all,
                                                  std::vector<HeartbeatRelay::Taken>* taken) {
  v1::HostHeartbeatRequest req;
  int64_t keepalive_ms = relay_ != nullptr ? relay_->ReplyIntervalMs() : kMaxReplyIntervalMs;
  std::vector<std::pair<const Member*, bool>> beats;
  absl::Duration interval;
  {
    absl::MutexLock l(&mu_);
    changed_ = false;
    interval = Interval();
    for (const auto& [id, m] : members_) {
      beats.emplace_back(&m, m.removing);
      keepalive_ms =
          std::min(keepalive_ms, StreamReplyIntervalMs(m.options.timeout, m.options.interval));
    }
  }
  // (Only this thread drops members, so the pointers stay valid; `current` takes its owner's
  // lock, which is never held while calling into the hub.)
  for (const auto& [m, closing] : beats) {
    v1::HeartbeatRequest* beat = req.add_beats();
    *beat = BeatRequest(m->options, m->hooks.current());
    if (closing || closing_all) {
      beat->set_closing(true);
      *dropped = true;
    }
  }
  if (relay_ != nullptr) {
    // (Past the coordinator's bound per request, the followers' beats wait for the next one.)
    *taken = relay_->Collect(
        kMaxHostBeatsPerRequest - std::min(kMaxHostBeatsPerRequest, beats.size()), closing_all,
        &req);
  }
  req.set_reply_interval_ms(std::max<int64_t>(1, keepalive_ms));
  if (interval != absl::InfiniteDuration()) {
    req.set_beat_interval_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(interval)));
  }
  return req;
}

absl::Status HeartbeatHub::Stream(bool* answered) {
  {
    absl::MutexLock l(&mu_);
    stream_ended_ = false;
    inbox_.clear();
  }
  CoordinatorClient* upstream = route_ == Route::kFollower ? local_.get() : coordinator_.get();
  HeartbeatRelay* relay = relay_.get();  // (kept until the call has ended)
  std::unique_ptr<HostHeartbeatStreamCall> call = upstream->StartHostHeartbeatStream(
      [this, relay](const v1::HostHeartbeatResponse& reply) {
        // The followers' answers go out at once, from here.
        if (relay != nullptr) relay->Deliver(reply);
        absl::MutexLock l(&mu_);
        inbox_.push_back(reply);
        last_reply_ = absl::Now();
      },
      [this] {
        absl::MutexLock l(&mu_);
        stream_ended_ = true;
      });
  const StreamSilence silence_check;
  absl::Time next_beat = silence_check.opened;
  absl::Status silence;
  bool stopping = false;
  std::optional<v1::HostHeartbeatRequest> closing;  // the last members' closing beats
  while (true) {
    std::vector<v1::HostHeartbeatResponse> in;
    absl::Time last_reply;
    absl::Duration timeout, interval;
    bool ended, changed, live = false;
    {
      absl::MutexLock l(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(this, &HeartbeatHub::WakeUp), next_beat);
      stopping = stopping_;
      in.swap(inbox_);
      ended = stream_ended_;
      changed = changed_;
      last_reply = last_reply_;
      timeout = Timeout();
      interval = Interval();
      for (const auto& [id, m] : members_) live = live || !m.removing;
    }
    if (!in.empty()) {
      *answered = true;
      Deliver(in);
    }
    if (stopping) break;
    if (ended) break;
    const absl::Time now = absl::Now();
    // (The shortest heartbeat timeout of the members.)
    // (To the host's relay, half that: a relay that hangs, its lock still held, must leave its
    // followers time to beat on streams of their own before the coordinator times them out.)
    silence = silence_check.Check(now, last_reply,
                                  route_ == Route::kFollower ? timeout / 2 : timeout,
                                  "HostHeartbeatStream");
    if (!silence.ok()) break;
    if (now < next_beat && !changed) continue;  // woken early for a reply
    bool dropped = false;
    std::vector<HeartbeatRelay::Taken> taken;
    // (No rank of this process is left: the relay's followers are closed here too, and go to
    // the relay that takes over.)
    v1::HostHeartbeatRequest req = NextRequest(&dropped, /*closing_all=*/!live, &taken);
    if (!live) {
      // Every member is leaving: their closing beats end the stream.
      closing = std::move(req);
      break;
    }
    if (call->Write(req)) {
      if (relay != nullptr) relay->Sent(taken);
      if (dropped) {
        absl::MutexLock l(&mu_);
        DropRemoved();
      }
    } else if (dropped) {
      // The previous write is still in flight: the closing beats go with the next one, soon.
      next_beat = std::min(next_beat, now + absl::Milliseconds(5));
      absl::MutexLock l(&mu_);
      changed_ = true;
      continue;
    }
    // A beat not sent because the previous write is still in flight is simply skipped.
    if (now >= next_beat) next_beat = std::max(next_beat + interval, now);
  }
  if (stopping && !closing.has_value()) {
    bool dropped = false;
    std::vector<HeartbeatRelay::Taken> taken;
    closing = NextRequest(&dropped, /*closing_all=*/true, &taken);
  }
  const absl::Status status =
      closing.has_value() ? call->Finish(&*closing) : call->Finish();
  if (closing.has_value()) {
    if (relay_ != nullptr) {
      // The followers go to the next process that takes the relay's lock.
      relay_.reset();
      route_ = Route::kDirect;
    }
    absl::MutexLock l(&mu_);
    DropRemoved();
    return absl::OkStatus();
  }
  if (!silence.ok()) {
    if (route_ == Route::kFollower) relay_silent_ = true;
    return silence;
  }
  return status.ok() ? absl::UnavailableError("the coordinator ended the HostHeartbeatStream")
                     : status;
}

void HeartbeatHub::Deliver(const std::vector<v1::HostHeartbeatResponse>& replies) {
  for (const v1::HostHeartbeatResponse& reply : replies) {
    // (Only this thread drops members: the pointers stay valid outside the lock.)
    std::vector<std::pair<Member*, const v1::MemberHeartbeatReply*>> to;
    std::vector<std::pair<Member*, v1::HeartbeatResponse>> keepalive;
    {
      absl::MutexLock l(&mu_);
      for (auto& [id, m] : members_) {
        if (m.removing) continue;
        if (reply.members().empty()) {
          if (m.last.has_value()) keepalive.emplace_back(&m, *m.last);
          continue;
        }
        for (const v1::MemberHeartbeatReply& r : reply.members()) {
          if (r.rank() == m.options.rank && r.job_id() == m.options.job_id) to.emplace_back(&m, &r);
        }
      }
    }
    for (auto& [m, last] : keepalive) m->hooks.on_reply(last);
    for (auto& [m, r] : to) {
      if (r->error_code() != 0) {
        m->hooks.on_failure(
            absl::Status(static_cast<absl::StatusCode>(r->error_code()), r->error_message()));
        continue;
      }
      m->hooks.on_reply(r->reply());
      v1::HeartbeatResponse last = r->reply();
      last.clear_recovery_grace_ms();
      {
        absl::MutexLock l(&mu_);
        m->last = std::move(last);
      }
      const Heartbeat::Beat beat = m->hooks.current();
      if (r->reply().generation() != beat.generation && r->reply().generation() != beat.seen) {
        m->hooks.on_change(r->reply(), beat.seen);
      }
    }
  }
}

void HeartbeatHub::FailAll(const absl::Status& s) {
  std::vector<Member*> all;
  {
    absl::MutexLock l(&mu_);
    for (auto& [id, m] : members_) {
      if (!m.removing) all.push_back(&m);
    }
  }
  for (Member* m : all) m->hooks.on_failure(s);
}

}  // namespace modelavg::client
