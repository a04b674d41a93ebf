// The core of one HostHeartbeatStream (see HostHeartbeatStream in coordinator.proto): the beats
// of several members in each message, each recorded as a Heartbeat; which members' answers are
// sent (a member's first beat, then news, and its errors); the stream's keep-alive; the members
// the stream holds, for when it breaks. One per stream, used by its read path only (Members()
// excepted, see there): no gRPC; time comes from the registry's clock.
#ifndef MODELAVG_SERVER_CORE_HOST_HEARTBEATS_H_
#define MODELAVG_SERVER_CORE_HOST_HEARTBEATS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/heartbeat_keepalive.h"
#include "modelavg/v1/coordinator.pb.h"
#include "server/core/job_registry.h"

namespace modelavg::server {

class HostHeartbeats {
 public:
  // Beats in one request, and members one stream tracks.
  static constexpr size_t kMaxBeatsPerRequest = kMaxHostBeatsPerRequest;
  static constexpr size_t kMaxMembers = kMaxHostStreamMembers;

  // May a beat name this job? OK, or the error that member's beat is answered with.
  using JobCheck = std::function<absl::Status(absl::string_view job_id)>;

  // `registry` outlives this. `check` (optional) is asked about each member's job before its
  // beat is recorded.
  explicit HostHeartbeats(JobRegistry* registry, JobCheck check = nullptr)
      : registry_(registry), check_(std::move(check)) {}
  HostHeartbeats(const HostHeartbeats&) = delete;
  HostHeartbeats& operator=(const HostHeartbeats&) = delete;

  // Records every beat of `request` and adds to *out (merging: a member's newer answer replaces
  // one still unsent there) the answers due. Returns whether *out is due to be sent now: it has
  // answers, or nothing was written for the request's reply_interval_ms (then an empty reply is
  // the keep-alive). A member's failed beat is an answer with its error, not an error of the
  // stream. Not OK (INVALID_ARGUMENT: a malformed request, too many beats or members, one member
  // twice): the stream ends with it.
  absl::StatusOr<bool> Beat(const v1::HostHeartbeatRequest& request,
                            v1::HostHeartbeatResponse* out);
  // A reply went out (for the keep-alive).
  void Sent();

  // The members whose beats came on this stream and did not end on purpose (closing): each is
  // told its stream was lost when the stream breaks. Any thread.
  struct Member {
    std::shared_ptr<Job> job;
    int32_t rank;
    std::string credential;
  };
  std::vector<Member> Members() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t member_count() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::pair<std::string, int32_t>;  // (job_id, rank)
  struct Tracked {
    Member member;
    // The member's last answer sent (or merged into the reply being built).
    v1::HeartbeatResponse last;
  };
  // One beat: records it, and returns whether its answer (in *reply) is news; not OK when the
  // stream cannot take one more member.
  absl::StatusOr<bool> BeatOne(const v1::HeartbeatRequest& beat, v1::MemberHeartbeatReply* reply)
      ABSL_LOCKS_EXCLUDED(mu_);

  JobRegistry* const registry_;
  const JobCheck check_;
  bool written_ = false;          // a reply went out (or is due) on this stream
  absl::Time last_written_;       // when
  mutable absl::Mutex mu_;        // the read path writes, Members() reads
  std::map<Key, Tracked> members_ ABSL_GUARDED_BY(mu_);
};

}  // namespace modelavg::server

#endif  // MODELAVG_SERVER_CORE_HOST_HEARTBEATS_H_
