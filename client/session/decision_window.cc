#include "client/session/decision_window.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rpc/coordinator_client.h"
#include "client/rpc/coordinator_outage.h"
#include "common/job_spec.h"
#include "common/status_util.h"
#include "spdlog/spdlog.h"

namespace modelavg::client {
namespace {

std::string Describe(const Decision& d) {
  return d.average ? absl::StrCat("average at level ", d.level, " of plan ", d.plan,
                                  " subgroup ", d.subgroup.index)
                   : absl::StrCat("skip (plan ", d.plan, ")");
}

// How often a rank waiting for the coordinator (at the end of what it may use) looks again.
constexpr absl::Duration kWaitPoll = absl::Milliseconds(20);
// How far ahead a rank keeps using what it holds once a new plan is proposed: about this long of
// its steps (at least kMinGiveBackSteps), so that it learns the switch step before it gets
// there (the answer and the switch step take a beat each, ~100 ms apiece).
constexpr absl::Duration kGiveBackAfter = absl::Milliseconds(500);
constexpr int64_t kMinGiveBackSteps = 2;

}  // namespace

DecisionWindow::DecisionWindow(CoordinatorClient& coordinator, CoordinatorOutage& outage,
                               const Clock& clock, PlanHistory plans, std::string job_id,
                               int32_t rank, std::string credential, int64_t size)
    : coordinator_(coordinator),
      outage_(outage),
      clock_(clock),
      job_id_(std::move(job_id)),
      rank_(rank),
      credential_(std::move(credential)),
      size_(size),
      plans_(std::make_shared<const PlanHistory>(std::move(plans))) {
  snapshots_.push_back(plans_);
}

std::shared_ptr<const PlanHistory> DecisionWindow::plans() const {
  absl::MutexLock l(&mu_);
  return plans_;
}

absl::StatusOr<Decision> DecisionWindow::At(int64_t step) {
  absl::MutexLock l(&mu_);
  // Set once this call starts waiting for the coordinator.
  absl::Time waiting_since = absl::InfiniteFuture();
  for (;;) {
    const bool inside = step >= start_ && step < start_ + static_cast<int64_t>(window_.size());
    // Past its answer to a proposal, a rank waits for the switch step (or the proposal's end).
    const bool given_back = answered_ != 0 && step > give_back_at_ &&
                            step >= plans_->SwitchStep(plans_->size() - 1);
    if (inside && !given_back) return window_[step - start_];
    if (!given_back && outage_.OutageLength() == absl::ZeroDuration()) {
      absl::Status fetched = Fetch(step);
      if (fetched.ok()) continue;
      if (!outage_.IsOutage(fetched)) return fetched;
      outage_.NoteUnreachable(fetched);
    }
    if (!given_back && step <= handed_through_ && plans_->Latest().PacedLevel() < 0) {
      // The coordinator is out of reach and this step lies within what it handed this rank:
      // no later plan switches before it, and the plans held decide it.
      window_ = plans_->Window(step, std::min(size_, handed_through_ - step + 1), rank_);
      start_ = step;
      continue;
    }
    // The coordinator must be heard first: wait (bounded by the outage timeout), unless the
    // session is over (a job deleted while a proposal was pending left its members waiting
    // here for the whole outage timeout).
    if (!broken_.ok()) return broken_;
    const absl::Time now = clock_.Now();
    if (waiting_since == absl::InfiniteFuture()) {
      waiting_since = now;
      spdlog::info("rank {} of job {}: waits at step {} for the coordinator ({})", rank_, job_id_,
                   step,
                   given_back ? absl::StrCat("a new plan was proposed; this rank gave back its "
                                             "decisions past step ",
                                             give_back_at_, " and waits for the switch step")
                              : absl::StrCat("it is out of reach and this rank was handed "
                                             "decisions only through step ",
                                             handed_through_));
    }
    if (now - waiting_since > outage_.timeout() ||
        (outage_.OutageLength() > absl::ZeroDuration() && outage_.Exceeded())) {
      return outage_.Error(
          absl::StrCat("deciding step ", step, " of rank ", rank_, " (the plans held decide only "
                       "through step ", MayUseThrough(), ")"),
          absl::UnavailableError("no answer"));
    }
    const int32_t answered = answered_;
    const int plans_held = plans_->size();
    auto news = [this, answered, plans_held]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return answered_ != answered || plans_->size() != plans_held || !broken_.ok();
    };
    clock_.AwaitWithDeadline(mu_, absl::Condition(&news), now + kWaitPoll);
  }
}

absl::Status DecisionWindow::Fetch(int64_t from_step) {
  v1::GetScheduleRequest req;
  req.set_job_id(job_id_);
  req.set_from_step(from_step);
  req.set_count(size_);
  req.set_rank(rank_);
  req.set_plans_known(plans_->size());
  req.set_credential(credential_);
  // Not under mu_: a heartbeat reply may arrive meanwhile (its plans are learnt in order).
  mu_.Unlock();
  absl::StatusOr<v1::GetScheduleResponse> reply = coordinator_.GetSchedule(req);
  mu_.Lock();
  MODELAVG_RETURN_IF_ERROR(reply.status());
  const v1::GetScheduleResponse& resp = *reply;
  MODELAVG_RETURN_IF_ERROR(Learn(resp.plan_changes()));
  // A paced job (docs/paced.md) answers through the rank's last planned sync step only: at least
  // one decision, at most the count.
  const bool paced = plans_->Latest().PacedLevel() >= 0;
  if (paced && resp.decisions_size() >= 1 && resp.decisions_size() <= size_) {
    return TakePaced(resp, from_step);
  }
  if (resp.decisions_size() != size_) {
    return absl::InternalError(absl::StrCat("GetSchedule(from ", from_step, ", count ", size_,
                                            ") returned ", resp.decisions_size(), " decisions"));
  }
  // The plans the coordinator had when it answered; one learnt since (from a heartbeat reply)
  // switches inside the window, and the decisions past its switch step are the old plan's.
  int server_plans = std::max(1, req.plans_known());
  for (const v1::PlanChange& c : resp.plan_changes()) {
    server_plans = std::max(server_plans, c.version() + 1);
  }
  int64_t usable = resp.decisions_size();
  if (server_plans < plans_->size()) {
    usable = std::clamp<int64_t>(plans_->SwitchStep(server_plans) - from_step, 0, usable);
  }
  std::vector<Decision> window;
  window.reserve(usable);
  for (int64_t i = 0; i < usable; ++i) {
    Decision got = DecisionFromProto(resp.decisions(static_cast<int>(i)));
    const Decision want = plans_->DecisionFor(from_step + i, rank_);
    if (!(got == want)) {
      return absl::InternalError(absl::StrCat(
          "the coordinator's decision for step ", from_step + i, " (", Describe(got),
          ") differs from the job's plans as this rank holds them (", Describe(want),
          "); client and coordinator versions disagree"));
    }
    window.push_back(std::move(got));
  }
  window_ = std::move(window);
  start_ = from_step;
  handed_through_ = std::max(handed_through_, from_step + size_ - 1);
  return absl::OkStatus();
}

absl::Status DecisionWindow::TakePaced(const v1::GetScheduleResponse& resp, int64_t from_step) {
  // The paced level's decisions are the coordinator's plan, which this rank cannot recompute;
  // what it can check it does: every other step is the lower levels' (the schedule's rule
  // without the paced level), a paced round is the paced level's, of this rank's subgroup, with
  // one weight per member and rounds that rise.
  const Schedule& schedule = plans_->Latest();
  const int paced_level = schedule.PacedLevel();
  std::vector<Decision> window;
  window.reserve(resp.decisions_size());
  int64_t last_round = -1;
  for (int i = 0; i < resp.decisions_size(); ++i) {
    const int64_t step = from_step + i;
    Decision got = DecisionFromProto(resp.decisions(i));
    const bool round_ok =
        got.round >= 0 && got.average && got.level == paced_level &&
        got.subgroup == schedule.SubgroupOf(paced_level, rank_) && got.step == step &&
        got.weights.size() == got.Members().size() && got.round > last_round;
    if (got.round >= 0 ? !round_ok : !(got == schedule.DecisionBelowPaced(step, rank_))) {
      return absl::InternalError(absl::StrCat(
          "the coordinator's decision for step ", step, " (", Describe(got),
          got.round >= 0 ? absl::StrCat(", paced round ", got.round) : "",
          ") is not one this rank can follow under the job's paced plan (the lower levels' "
          "decision would be ",
          Describe(schedule.DecisionBelowPaced(step, rank_)), ", the window's last paced round ",
          last_round, "); client and coordinator versions disagree"));
    }
    if (got.round >= 0) last_round = got.round;
    window.push_back(std::move(got));
  }
  window_ = std::move(window);
  start_ = from_step;
  // Nothing past the window may be recomputed here (the plan is the coordinator's): a rank cut
  // off from the coordinator waits for it at the end of what it was handed.
  handed_through_ = std::max(handed_through_, from_step + resp.decisions_size() - 1);
  return absl::OkStatus();
}

template <typename Repeated>
absl::Status DecisionWindow::Learn(const Repeated& changes) {
  for (const v1::PlanChange& c : changes) {
    if (c.version() < plans_->size()) continue;  // known already
    if (c.version() != plans_->size()) {
      return absl::InternalError(absl::StrCat("the coordinator sent plan version ", c.version(),
                                              " of job ", job_id_, " but this rank holds ",
                                              plans_->size(), " plans"));
    }
    absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(c.spec());
    absl::StatusOr<Schedule> schedule =
        spec.ok() ? Schedule::Create(*std::move(spec)) : absl::StatusOr<Schedule>(spec.status());
    if (!schedule.ok()) {
      return absl::InternalError(absl::StrCat("plan version ", c.version(), " of job ", job_id_,
                                              " does not validate here: ",
                                              schedule.status().message()));
    }
    auto next = std::make_shared<PlanHistory>(*plans_);
    MODELAVG_RETURN_IF_ERROR(next->Add(*std::move(schedule), c.switch_step()));
    plans_ = std::move(next);
    snapshots_.push_back(plans_);
    // Decisions held past the switch were the old plan's.
    const int64_t keep = std::max<int64_t>(0, c.switch_step() - start_);
    if (static_cast<int64_t>(window_.size()) > keep) window_.resize(keep);
    if (answered_ == c.version()) answered_ = 0;
    spdlog::info("rank {} of job {}: plan version {} from step {} (the rank is at step {})", rank_,
                 job_id_, c.version(), c.switch_step(), last_step_);
  }
  return absl::OkStatus();
}

void DecisionWindow::Break(const absl::Status& why) {
  absl::MutexLock l(&mu_);
  if (broken_.ok() && !why.ok()) broken_ = why;
}

DecisionWindow::BeatFields DecisionWindow::OnBeat(int64_t step) {
  absl::MutexLock l(&mu_);
  last_step_ = step;
  const absl::Time now = clock_.Now();
  if (pace_step_ < 0 || step < pace_step_) {
    pace_step_ = step;
    pace_time_ = now;
  } else if (now - pace_time_ >= absl::Milliseconds(steps_per_second_ > 0 ? 1000 : 200)) {
    // A first estimate after 200 ms, then one a second.
    steps_per_second_ = static_cast<double>(step - pace_step_) /
                        absl::ToDoubleSeconds(now - pace_time_);
    pace_step_ = step;
    pace_time_ = now;
  }
  return BeatFields{plans_->size(), MayUseThrough(), answered_};
}

absl::Status DecisionWindow::OnReply(const v1::HeartbeatResponse& reply) {
  absl::MutexLock l(&mu_);
  MODELAVG_RETURN_IF_ERROR(Learn(reply.plan_changes()));
  const int32_t proposed = reply.proposed_plan();
  if (proposed == 0) {
    answered_ = 0;  // no proposal, or it ended without a plan
  } else if (proposed == plans_->size() && answered_ != proposed) {
    const int64_t ahead = std::max<int64_t>(
        kMinGiveBackSteps,
        static_cast<int64_t>(std::ceil(steps_per_second_ * absl::ToDoubleSeconds(kGiveBackAfter))));
    give_back_at_ = std::min(handed_through_, last_step_ + ahead);
    give_back_at_ = std::max(give_back_at_, last_step_);
    answered_ = proposed;
    spdlog::info("rank {} of job {}: plan version {} proposed; this rank keeps its decisions "
                 "through step {} (it is at step {}) and gives back the rest",
                 rank_, job_id_, proposed, give_back_at_, last_step_);
  }
  return absl::OkStatus();
}

}  // namespace modelavg::client
