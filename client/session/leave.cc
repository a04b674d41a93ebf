#include "client/session/leave.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "client/session/retry_wait.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {

absl::Status SendLeave(CoordinatorClient& coordinator, CoordinatorOutage& outage,
                       const Clock& clock, const ClientOptions& options,
                       v1::LeaveRequest req, absl::string_view reason,
                       const absl::Status& failure, CancelToken* cancel) {
  const std::string& job_id = req.job_id();
  const int32_t rank = req.rank();
  // A worker whose averaging failed does not leave in order: the coordinator counts it as a
  // death (an elastic job below min_world_size stops instead of running on without it).
  const std::string why =
      failure.ok() ? std::string(reason) : absl::StrCat(reason, ": ", failure.message());
  req.set_reason(why);
  req.set_failed(!failure.ok());
  // Through a coordinator outage (a restart at the end of the job) the Leave of a worker that
  // finished is retried, for at most leave_timeout: it is not failed by a coordinator that is
  // back in seconds, and a destructor never waits long. A failed worker tries once: the
  // coordinator counts it dead at its heartbeat timeout anyway.
  const absl::Time started = clock.Now();
  const absl::Time deadline =
      started + (failure.ok() ? options.leave_timeout : absl::ZeroDuration());
  absl::Duration backoff = absl::Milliseconds(100);
  int attempts = 0;
  while (true) {
    ++attempts;
    absl::StatusOr<v1::LeaveResponse> resp = coordinator.Leave(req, cancel);
    if (resp.ok()) break;
    const absl::Status& s = resp.status();
    if (cancel != nullptr && cancel->cancelled()) {
      return absl::CancelledError(absl::StrCat(
          "leaving job ", job_id, ": cancelled after ", attempts,
          " attempt(s); unless the Leave reached the coordinator, it counts rank ", rank,
          " as dead at its heartbeat timeout"));
    }
    const bool unreachable = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
    if (!unreachable) return s;
    outage.NoteUnreachable(s);
    // An outage already past coordinator_outage_timeout is not waited for again.
    if (outage.Exceeded() || clock.Now() + backoff >= deadline) {
      return absl::Status(
          s.code(), absl::StrCat("leaving job ", job_id, ": the coordinator at ",
                                 options.coordinator, " did not answer within "
                                 "ClientOptions.leave_timeout (",
                                 absl::FormatDuration(options.leave_timeout), ", ", attempts,
                                 " attempts); it will count rank ", rank,
                                 " as dead at its heartbeat timeout: ", s.message()));
    }
    if (attempts == 1) {
      spdlog::warn("leaving job {}: coordinator {} unreachable ({}); retrying for up to {}",
                   job_id, options.coordinator, std::string(s.message()),
                   absl::FormatDuration(options.leave_timeout));
    }
    SleepUnlessCancelled(clock, cancel, backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
    // The record says what happened.
    req.set_reason(absl::StrCat(why, "; sent again after the coordinator was unreachable for ",
                                absl::FormatDuration(absl::Trunc(clock.Now() - started,
                                                                 absl::Milliseconds(100)))));
  }
  spdlog::info("rank {} {} job {} ({}){}", rank, failure.ok() ? "left" : "failed out of", job_id,
               why,
               attempts > 1 ? absl::StrCat(" after ", attempts, " attempts (coordinator outage)")
                            : std::string());
  return absl::OkStatus();
}

void SendFailOut(CoordinatorClient& coordinator, const ClientOptions& options,
                 v1::LeaveRequest req, const absl::Status& failure) {
  req.set_reason(absl::StrCat("failed out: ", failure.message()));
  req.set_failed(true);
  absl::StatusOr<v1::LeaveResponse> resp = coordinator.Leave(req);
  if (!resp.ok()) {
    // Its peers then learn it at this rank's heartbeat timeout (its heartbeats have stopped).
    spdlog::error("rank {} failed out of job {} but could not tell the coordinator ({}); its "
                  "peers will count it dead at its heartbeat timeout",
                  req.rank(), options.job_id, resp.status().ToString());
    return;
  }
  spdlog::error("rank {} failed out of job {} (generation {} -> {}): {}", req.rank(),
                options.job_id, req.generation(), resp->generation(),
                std::string(failure.message()));
}

}  // namespace modelavg::client
