#include "client/session/decision_window.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "common/job_spec.h"
#include "common/status_util.h"

namespace modelavg::client {
namespace {

std::string Describe(const Decision& d) {
  return d.average ? absl::StrCat("average at level ", d.level, " subgroup ", d.subgroup.index)
                   : std::string("skip");
}

}  // namespace

absl::StatusOr<Decision> DecisionWindow::At(int64_t step) {
  absl::MutexLock l(&mu_);
  if (step < start_ || step >= start_ + static_cast<int64_t>(window_.size())) {
    MODELAVG_RETURN_IF_ERROR(Fetch(step));
  }
  return window_[step - start_];
}

absl::Status DecisionWindow::Fetch(int64_t from_step) {
  auto local_window = [&] {
    window_ = schedule_.Window(from_step, size_, rank_);
    start_ = from_step;
    return absl::OkStatus();
  };
  if (outage_.OutageLength() > absl::ZeroDuration()) return local_window();
  v1::GetScheduleRequest req;
  req.set_job_id(job_id_);
  req.set_from_step(from_step);
  req.set_count(size_);
  req.set_rank(rank_);
  absl::StatusOr<v1::GetScheduleResponse> reply = coordinator_.GetSchedule(req);
  if (!reply.ok() && outage_.IsOutage(reply.status())) {
    outage_.NoteUnreachable(reply.status());
    return local_window();
  }
  MODELAVG_RETURN_IF_ERROR(reply.status());
  const v1::GetScheduleResponse& resp = *reply;
  if (resp.decisions_size() != size_) {
    return absl::InternalError(absl::StrCat("GetSchedule(from ", from_step, ", count ", size_,
                                            ") returned ", resp.decisions_size(), " decisions"));
  }
  std::vector<Decision> window;
  window.reserve(resp.decisions_size());
  for (int64_t i = 0; i < resp.decisions_size(); ++i) {
    Decision got = DecisionFromProto(resp.decisions(static_cast<int>(i)));
    const Decision want = schedule_.DecisionFor(from_step + i, rank_);
    if (!(got == want)) {
      return absl::InternalError(absl::StrCat(
          "the coordinator's decision for step ", from_step + i, " (", Describe(got),
          ") differs from the schedule of the job's spec (", Describe(want),
          "); client and coordinator versions disagree"));
    }
    window.push_back(std::move(got));
  }
  window_ = std::move(window);
  start_ = from_step;
  return absl::OkStatus();
}

}  // namespace modelavg::client
