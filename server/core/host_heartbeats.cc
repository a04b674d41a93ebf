#include "server/core/host_heartbeats.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/heartbeat_keepalive.h"
#include "server/core/heartbeat_replies.h"

namespace modelavg::server {
namespace {

void SetError(const absl::Status& s, v1::MemberHeartbeatReply* reply) {
  reply->clear_reply();
  reply->set_error_code(static_cast<int32_t>(s.code()));
  reply->set_error_message(std::string(s.message()));
}

// Adds `reply` to *out, replacing an answer for the same member that is still unsent there.
// `unsent` is how many entries *out had before this request (only those can repeat a member:
// a request names each member once).
void Merge(v1::MemberHeartbeatReply reply, int unsent, v1::HostHeartbeatResponse* out) {
  for (int i = 0; i < unsent; ++i) {
    v1::MemberHeartbeatReply* old = out->mutable_members(i);
    if (old->rank() == reply.rank() && old->job_id() == reply.job_id()) {
      *old = std::move(reply);
      return;
    }
  }
  *out->add_members() = std::move(reply);
}

}  // namespace

absl::StatusOr<bool> HostHeartbeats::Beat(const v1::HostHeartbeatRequest& request,
                                          v1::HostHeartbeatResponse* out) {
  const int64_t interval_ms = request.reply_interval_ms();
  if (interval_ms < 1 || interval_ms > kMaxReplyIntervalMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reply_interval_ms is ", interval_ms, ": a HostHeartbeatStream's must be in 1..",
        kMaxReplyIntervalMs, " (the longest the coordinator may stay silent)"));
  }
  if (static_cast<size_t>(request.beats_size()) > kMaxBeatsPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a HostHeartbeatRequest carries at most ", kMaxBeatsPerRequest, " beats, this one ",
        request.beats_size(), "; send the others on another stream"));
  }
  // (Views of the request's own strings, sorted: no copy of a job id per beat.)
  std::vector<std::pair<absl::string_view, int32_t>> named;
  named.reserve(request.beats_size());
  for (const v1::HeartbeatRequest& beat : request.beats()) {
    named.emplace_back(beat.job_id(), beat.rank());
  }
  std::sort(named.begin(), named.end());
  if (auto twice = std::adjacent_find(named.begin(), named.end()); twice != named.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", twice->second, " of job ", twice->first.substr(0, 256),
        " beats twice in one HostHeartbeatRequest; send one beat per member"));
  }
  const int unsent = out->members_size();
  for (const v1::HeartbeatRequest& beat : request.beats()) {
    v1::MemberHeartbeatReply reply;
    absl::StatusOr<bool> news = BeatOne(beat, &reply);
    if (!news.ok()) return news.status();
    if (*news) Merge(std::move(reply), unsent, out);
  }
  const absl::Time now = registry_->clock()->Now();
  return out->members_size() > 0 || !written_ ||
         now - last_written_ >= absl::Milliseconds(interval_ms);
}

void HostHeartbeats::Sent() {
  written_ = true;
  last_written_ = registry_->clock()->Now();
}

absl::StatusOr<bool> HostHeartbeats::BeatOne(const v1::HeartbeatRequest& beat,
                                             v1::MemberHeartbeatReply* reply) {
  const Key key(beat.job_id(), beat.rank());
  reply->set_job_id(beat.job_id().substr(0, 256));
  reply->set_rank(beat.rank());
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = members_.find(key);
    if (it != members_.end()) {
      job = it->second.member.job;
    } else if (members_.size() >= kMaxMembers && !beat.closing() && !beat.lost()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a HostHeartbeatStream carries at most ", kMaxMembers,
          " members; open another stream for rank ", beat.rank(), " of job ",
          beat.job_id().substr(0, 256)));
    }
  }
  if (job == nullptr) {
    if (check_) {
      if (absl::Status s = check_(beat.job_id()); !s.ok()) {
        if (beat.lost()) return false;
        SetError(s, reply);
        return true;
      }
    }
    absl::StatusOr<std::shared_ptr<Job>> found = registry_->Find(beat.job_id());
    if (!found.ok()) {
      // (A relay's lost member of a job that is gone: nobody to tell.)
      if (beat.lost()) return false;
      SetError(found.status(), reply);
      return true;
    }
    job = *std::move(found);
  }
  if (beat.lost()) {
    // Not a beat: the relay's process lost the one that carried this member. Off the stream,
    // and lost as a broken stream of its own (the job checks the credential).
    {
      absl::MutexLock lock(&mu_);
      auto it = members_.find(key);
      if (it != members_.end() && it->second.member.credential == beat.credential()) {
        members_.erase(it);
      }
    }
    job->HeartbeatStreamLost(beat.rank(), beat.credential());
    return false;
  }
  v1::HeartbeatResponse answer;
  if (absl::Status s = job->Heartbeat(beat, &answer); !s.ok()) {
    // Forgotten: its next beat counts as a first one.
    absl::MutexLock lock(&mu_);
    members_.erase(key);
    SetError(s, reply);
    return true;
  }
  absl::MutexLock lock(&mu_);
  auto it = members_.find(key);
  if (beat.closing()) {
    // Off the stream on purpose: its end says nothing of this member.
    if (it != members_.end()) members_.erase(it);
    return false;
  }
  if (it == members_.end()) {
    it = members_.emplace(key, Tracked{Member{job, beat.rank(), beat.credential()}, {}}).first;
  } else {
    // (A member that joined again beats with its new credential.)
    if (it->second.member.credential != beat.credential()) {
      it->second.member.credential = beat.credential();
    }
    if (SameHeartbeatNews(answer, it->second.last)) return false;
  }
  it->second.last = answer;
  answer.set_coordinator_incarnation(registry_->incarnation());
  *reply->mutable_reply() = std::move(answer);
  return true;
}

std::vector<HostHeartbeats::Member> HostHeartbeats::Members() const {
  absl::MutexLock lock(&mu_);
  std::vector<Member> out;
  out.reserve(members_.size());
  for (const auto& [key, tracked] : members_) out.push_back(tracked.member);
  return out;
}

size_t HostHeartbeats::member_count() const {
  absl::MutexLock lock(&mu_);
  return members_.size();
}

}  // namespace modelavg::server
