// Job, schedule and plans: the step decisions (Step, GetSchedule), the communicator ids
// (PublishCommId, GetCommId) and a new plan for the running job (UpdateJob: the proposal to the
// members, the switch step, the plan written and applied).
#include "server/job/job.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/printable.h"
#include "server/job/job_internal.h"
#include "server/job/request_checks.h"
#include "server/membership/decisions.h"
#include "spdlog/spdlog.h"

namespace modelavg::server {
namespace {

std::string StateName(v1::JobState s) { return v1::JobState_Name(s); }

// The comm-id key of `key` at a level of plan `plan`: the levels of two plans are apart (plan 0's
// keys are as they always were).
std::string PlanKey(int32_t plan, const std::string& key) {
  return plan == 0 ? key : absl::StrCat("plan", plan, "/", key);
}

}  // namespace

void Job::ApplySoftFields(const v1::JobSpec& spec) {
  if (spec.heartbeat_timeout_ms() > 0) {
    heartbeat_timeout_ms_.store(spec.heartbeat_timeout_ms(), std::memory_order_relaxed);
  }
  if (membership_.elastic() && spec.min_world_size() > 0 &&
      spec.min_world_size() < membership_.world_size()) {
    membership_.SetMinWorldSize(spec.min_world_size());
  }
}

absl::Status Job::Step(const v1::StepRequest& request, v1::StepDecision* response) {
  const int32_t rank = request.rank();
  if (absl::Status s = CheckRank(rank, schedule_.world_size(), id()); !s.ok()) return s;
  if (absl::Status s = CheckStep(request.step()); !s.ok()) return s;
  const absl::Time now = clock_->Now();
  int64_t generation;
  std::shared_ptr<const MemberSteps> members;
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    if (!halted_.ok()) return halted_;
    generation = membership_.generation();
    members = membership_.DecisionMembers();
    if (request.generation() != generation) {
      return absl::FailedPreconditionError(StaleMessage(request.generation()));
    }
    if (membership_.state() != v1::RUNNING) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id(), " is ", StateName(membership_.state()), " in generation ",
                       generation, "; Step needs a RUNNING job (wait for Join to complete)"));
    }
    // Progress and liveness count only from the rank's member; anyone may read the decision.
    if (membership_.CheckCredential(rank, request.credential(), "Step", id()).ok()) {
      if (absl::Status s = membership_.CheckPlausibleStep(rank, request.step(), now, id());
          !s.ok()) {
        return s;
      }
      membership_.RecordStep(rank, request.step(), now);
      // Handed out to the rank: a later plan switches past it.
      plans_.Handed(rank, request.step());
    }
    plans = plans_.history();
    if (paced_) {
      absl::StatusOr<Decision> d = PacedDecision(rank, request.step(), *members);
      if (!d.ok()) return d.status();
      DecisionToProto(*d, generation, response);
      return absl::OkStatus();
    }
  }
  DecisionToProto(plans->DecisionFor(request.step(), rank), generation, response);
  ApplyMembers(*members, response);
  return absl::OkStatus();
}

absl::StatusOr<Decision> Job::PacedDecision(int32_t rank, int64_t step,
                                            const MemberSteps& members) {
  if (absl::Status s = PlanPaced(rank, step); !s.ok()) return s;
  return paced_->DecisionFor(schedule_, members, step, rank);
}

absl::Status Job::PlanPaced(int32_t rank, int64_t step) {
  absl::StatusOr<std::vector<PlannedRound>> needed = paced_->RoundsNeeded(rank, step);
  if (!needed.ok()) return needed.status();
  return StoreAndCommit(*std::move(needed));
}

absl::StatusOr<int64_t> Job::PacedAdmission(const std::vector<int32_t>& ranks) {
  absl::StatusOr<PlannedRound> next = paced_->NextRound();
  if (!next.ok()) return next.status();
  const int64_t round = next->round.round;
  const int64_t step = next->round.sync_step[paced_->pacing().GroupOf(ranks[0])];
  std::vector<PlannedRound> one;
  one.push_back(*std::move(next));
  if (absl::Status s = StoreAndCommit(std::move(one)); !s.ok()) return s;
  spdlog::info("job {}: rank(s) {} admitted at paced round {} (their step {})", id(),
               absl::StrJoin(ranks, ","), round, step);
  return step;
}

absl::Status Job::StoreAndCommit(std::vector<PlannedRound> needed) {
  if (needed.empty()) return absl::OkStatus();
  // Written before any member is handed them: a restart or a fail-over plans nothing anew that
  // a member already follows.
  JobDelta delta;
  for (const PlannedRound& p : needed) delta.paced_rounds.push_back(paced_->ToProto(p));
  const int64_t first_kept = paced_->FirstKeptAfter(needed.size());
  if (first_kept > paced_->dropped()) delta.drop_paced_rounds_before = first_kept;
  if (absl::Status s = Save(delta); !s.ok()) return s;
  for (const PlannedRound& p : needed) {
    const PacedRound& r = p.round;
    spdlog::info("job {}: paced round {} planned: sync steps {} (inner steps {}) with group "
                 "paces {} steps/s",
                 id(), r.round, absl::StrJoin(r.sync_step, ","),
                 absl::StrJoin(r.inner_steps, ","),
                 absl::StrJoin(p.group_paces, ",", [](std::string* out, double v) {
                   absl::StrAppend(out, v > 0 ? absl::StrFormat("%.3g", v) : "?");
                 }));
  }
  paced_->Commit(std::move(needed));
  return absl::OkStatus();
}

absl::Status Job::PacedWindow(const v1::GetScheduleRequest& request, int64_t generation,
                              const MemberSteps& members, v1::GetScheduleResponse* response) {
  if (!request.has_rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", id(), " is paced (docs/paced.md): each member has its own sync steps; ask "
        "GetSchedule for one rank"));
  }
  const int32_t rank = request.rank();
  if (absl::Status s = PlanPaced(rank, request.from_step()); !s.ok()) return s;
  // The window ends at the rank's last planned sync step: the steps after it wait for the
  // next round's plan (the member asks again once there).
  const int64_t through = paced_->DecidedThrough(rank);
  const int64_t end = through - request.from_step() < request.count()
                          ? through + 1
                          : request.from_step() + request.count();
  response->set_generation(generation);
  for (int64_t s = request.from_step(); s < end; ++s) {
    absl::StatusOr<Decision> d = paced_->DecisionFor(schedule_, members, s, rank);
    if (!d.ok()) {
      response->Clear();
      return d.status();
    }
    DecisionToProto(*d, generation, response->add_decisions());
  }
  return absl::OkStatus();
}

absl::Status Job::GetSchedule(const v1::GetScheduleRequest& request,
                              v1::GetScheduleResponse* response,
                              const std::function<bool()>& cancelled) {
  int64_t generation;
  std::shared_ptr<const MemberSteps> members;
  std::shared_ptr<const PlanHistory> plans;
  {
    absl::MutexLock lock(&mu_);
    plans = plans_.history();
  }
  if (absl::Status s = CheckDecisionWindow(*plans, request, id(), cancelled); !s.ok()) {
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    generation = membership_.generation();
    members = membership_.DecisionMembers();
    // The decisions handed out are promised: a later plan switches past them. Taken with the
    // plans they follow, under one lock, so that no update falls between.
    plans = plans_.history();
    if (request.has_rank() && !request.credential().empty() &&
        membership_.CheckCredential(request.rank(), request.credential(), "GetSchedule", id())
            .ok()) {
      plans_.Handed(request.rank(), request.from_step() + request.count() - 1);
    }
    plans_.AppendAfter(request.plans_known(), response->mutable_plan_changes());
    if (paced_) return PacedWindow(request, generation, *members, response);
  }
  return DecisionWindow(*plans, *members, generation, request, response, cancelled);
}

absl::Status Job::ValidateCommRequest(int64_t generation, int32_t plan, int32_t level,
                                      int32_t subgroup, int32_t rank,
                                      const std::string& key) const {
  if (plan < 0 || plan >= plans_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan ", plan, " is outside [0, ",
                                                   plans_.size(), ") for job ", id()));
  }
  const Schedule& schedule = plans_.history()->Plan(plan);
  if (absl::Status s = CheckCommRequest(schedule, level, subgroup, rank, key, id()); !s.ok()) {
    return s;
  }
  if (generation != membership_.generation()) {
    return absl::FailedPreconditionError(StaleMessage(generation));
  }
  if (membership_.state() != v1::RUNNING) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), " is ", StateName(membership_.state()), " in generation ",
        membership_.generation(), "; communicator ids are exchanged once the world is complete"));
  }
  const SubgroupRange g = schedule.SubgroupOf(level, rank);
  if (g.index != subgroup) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rank ", rank, " is in subgroup ", g.index, " at level ", level,
        ", not in subgroup ", subgroup, "; only the subgroup's members may use its ids"));
  }
  return absl::OkStatus();
}

absl::Status Job::PublishCommId(const v1::PublishCommIdRequest& request) {
  if (absl::Status s = CheckCommIdBlob(request.unique_id()); !s.ok()) return s;
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (!halted_.ok()) return halted_;
  if (absl::Status s =
          ValidateCommRequest(request.generation(), request.plan(), request.level(),
                              request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                   "PublishCommId", id());
      !s.ok()) {
    return s;
  }
  CommKey key{request.level(), request.subgroup(), PlanKey(request.plan(), request.key())};
  absl::StatusOr<bool> is_new =
      comm_ids_.CheckPublish(key, request.unique_id(), id(), membership_.generation());
  if (!is_new.ok()) return is_new.status();
  if (!*is_new) return absl::OkStatus();
  JobDelta published;
  published.comm_id = StoredCommId{request.level(), request.subgroup(), std::get<2>(key),
                                   request.unique_id()};
  if (absl::Status s = Save(published); !s.ok()) return s;
  comm_ids_.Put(key, request.unique_id());
  spdlog::debug("job {}: rank {} published a {}-byte id for level {}, subgroup {}, key \"{}\" "
                "in generation {}",
                id(), request.rank(), request.unique_id().size(), request.level(),
                request.subgroup(), request.key(), membership_.generation());
  for (CommIdWait& w : waits_.TakeCommIds(key)) {
    out.Complete([cb = std::move(w.done), blob = request.unique_id()]() mutable {
      cb(std::move(blob));
    });
  }
  return absl::OkStatus();
}

void Job::GetCommId(const v1::GetCommIdRequest& request, absl::Time call_deadline,
                    WaitId wait_id, CommIdCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto finish = [&](absl::StatusOr<std::string> result) {
    out.Answer(std::move(done), std::move(result));
  };
  if (!closed_.ok()) return finish(closed_);
  if (!halted_.ok()) return finish(halted_);
  if (request.timeout_ms() < 0) {
    return finish(absl::InvalidArgumentError(
        absl::StrCat("timeout_ms must be >= 0 (0: the call's deadline), got ",
                     request.timeout_ms())));
  }
  if (absl::Status s =
          ValidateCommRequest(request.generation(), request.plan(), request.level(),
                              request.subgroup(), request.rank(), request.key());
      !s.ok()) {
    return finish(s);
  }
  if (absl::Status s = membership_.CheckCredential(request.rank(), request.credential(),
                                                   "GetCommId", id());
      !s.ok()) {
    return finish(s);
  }
  CommKey key{request.level(), request.subgroup(), PlanKey(request.plan(), request.key())};
  if (const std::string* blob = comm_ids_.Find(key)) return finish(*blob);
  const absl::Time now = clock_->Now();
  const absl::Duration wait = request.timeout_ms() > 0
                                  ? absl::Milliseconds(request.timeout_ms())
                                  : join_timeout_;
  waits_.AddCommId(
      CommIdWait{wait_id, std::move(key), std::min(now + wait, call_deadline), std::move(done)});
}

void Job::UpdateJob(const v1::UpdateJobRequest& request, UpdateCallback done) {
  Outbox out(this);
  absl::MutexLock lock(&mu_);
  auto fail = [&](absl::Status status) { out.Answer(std::move(done), std::move(status)); };
  if (!closed_.ok()) return fail(closed_);
  if (!halted_.ok()) return fail(halted_);
  v1::JobSpec next = request.spec();
  next.DiscardUnknownFields();
  if (next.job_id() != id()) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "spec.job_id \"", EscapeControlCharacters(next.job_id()), "\" is not the job's (\"", id(),
        "\"): a job's id may not change; name the job in both job_id and spec.job_id")));
  }
  absl::StatusOr<ScheduleSpec> schedule_spec = ScheduleSpecFromProto(next);
  if (!schedule_spec.ok()) return fail(schedule_spec.status());
  absl::StatusOr<Schedule> schedule = Schedule::Create(*std::move(schedule_spec));
  if (!schedule.ok()) return fail(schedule.status());
  const PlanHistory& history = *plans_.history();
  const ScheduleSpec& current = history.Latest().spec();
  if (absl::Status s = ValidatePlanChange(current, schedule->spec()); !s.ok()) return fail(s);
  if (schedule->PacedLevel() >= 0 || history.Latest().PacedLevel() >= 0) {
    const bool to = schedule->PacedLevel() >= 0;
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "levels[", to ? schedule->PacedLevel() : history.Latest().PacedLevel(),
        "].paced: UpdateJob ", to ? "to" : "from",
        " a plan with a paced level is not yet supported (docs/paced.md, \"Status\"); a paced "
        "job keeps its plan, a step-locked one stays step-locked")));
  }
  const int32_t world = schedule_.world_size();
  const bool elastic_next = next.min_world_size() > 0 && next.min_world_size() < world;
  if (elastic_next != membership_.elastic()) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "min_world_size ", next.min_world_size(), " would make the ",
        membership_.elastic() ? "elastic" : "strict", " job ",
        membership_.elastic() ? "strict" : "elastic",
        "; a running job keeps its kind (an elastic job's min_world_size may change within 1..",
        world - 1, ")")));
  }
  if (next.join_timeout_ms() != 0 &&
      absl::Milliseconds(next.join_timeout_ms()) != join_timeout_) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "join_timeout_ms may not change in a running job (", absl::ToInt64Milliseconds(join_timeout_),
        " -> ", next.join_timeout_ms(), "); leave it 0 or as it is")));
  }
  if (membership_.state() != v1::RUNNING) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), " is ", StateName(membership_.state()),
        "; UpdateJob changes the plan of a RUNNING job (before the world is complete, delete and "
        "re-create the job with the new spec)")));
  }
  if (plans_.proposed() != 0) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), ": an update (plan version ", plans_.proposed(),
        ") is being proposed to the members; retry once it is answered")));
  }
  const int64_t min_step = MinStep();
  if (const v1::PlanChange* pending = plans_.Pending(std::max<int64_t>(min_step, 0))) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "job ", id(), ": plan version ", pending->version(), " switches at step ",
        pending->switch_step(), " and the members' smallest step is ", min_step,
        "; one update at a time: retry once every member has passed the switch")));
  }
  const absl::Time now = clock_->Now();
  if (now < grace_until_) {
    return fail(absl::UnavailableError(absl::StrCat(
        "job ", id(), ": the coordinator started ", "recently and its members are re-attaching (",
        absl::ToInt64Milliseconds(grace_until_ - now),
        " ms of recovery grace left); it cannot know yet how far each may still go on the "
        "current plan: retry then")));
  }
  if (schedule->spec().warmup_steps != current.warmup_steps) {
    int64_t max_step = -1;
    for (int32_t r = 0; r < world; ++r) {
      if (membership_.InRound(r)) max_step = std::max(max_step, membership_.member(r).last_step);
    }
    if (max_step >= current.warmup_steps) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "warmup_steps may change only while no member has passed the warm-up: a member is at "
          "step ", max_step, ", past warmup_steps ", current.warmup_steps,
          "; keep warmup_steps ", current.warmup_steps)));
    }
  }
  const absl::Duration answer_within =
      std::clamp(heartbeat_timeout(), absl::Seconds(1), absl::Seconds(5));
  spdlog::info("job {}: proposing plan version {} to its {} members (they answer within {} ms)",
               id(), plans_.size(), membership_.round_size(),
               absl::ToInt64Milliseconds(answer_within));
  plans_.Propose(std::move(next), *std::move(schedule), now + answer_within, std::move(done));
  MaybeFinishProposal(now, &out);
}

int64_t Job::MinStep() const {
  int64_t min_step = -1;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    if (!membership_.InRound(r)) continue;
    const int64_t step = membership_.member(r).last_step;
    if (step >= 0) min_step = min_step < 0 ? step : std::min(min_step, step);
  }
  return min_step;
}

void Job::FailProposal(const absl::Status& status, Outbox* out) {
  PlanUpdates::Proposal p = plans_.TakeProposal();
  spdlog::warn("job {}: plan version {} not accepted: {}", id(), p.version, status.ToString());
  out->Complete([done = std::move(p.done), status]() mutable { done(status); });
}

void Job::MaybeFinishProposal(absl::Time now, Outbox* out) {
  if (membership_.state() != v1::RUNNING) {
    return FailProposal(absl::AbortedError(absl::StrCat(
                            "job ", id(), " left RUNNING (", StateName(membership_.state()),
                            ") while the update was proposed; retry once it runs again")),
                        out);
  }
  std::vector<int32_t> members;
  std::vector<int64_t> steps;
  int64_t floor = 0;
  int32_t answered = 0;
  for (int32_t r = 0; r < membership_.world_size(); ++r) {
    if (!membership_.InRound(r)) continue;
    const LiveMember& m = membership_.member(r);
    members.push_back(r);
    steps.push_back(m.last_step);
    // Admissions planned already happen under the plan they were planned in.
    floor = std::max(floor, m.admitted_step + 1);
    if (plans_.Answered(r)) ++answered;
  }
  const bool all = answered == static_cast<int32_t>(members.size());
  if (!all && now < plans_.proposal()->deadline) return;
  const int64_t switch_step = plans_.ChooseSwitchStep(members, steps, floor);
  PlanUpdates::Proposal p = plans_.TakeProposal();
  const ScheduleSpec& current = plans_.history()->Latest().spec();
  if (p.schedule.spec().warmup_steps != current.warmup_steps &&
      switch_step > current.warmup_steps) {
    out->Complete([done = std::move(p.done), switch_step, w = current.warmup_steps]() mutable {
      done(absl::FailedPreconditionError(absl::StrCat(
          "warmup_steps may change only before the members pass the warm-up, and the switch "
          "would be at step ", switch_step, ", past warmup_steps ", w, "; keep warmup_steps ",
          w)));
    });
    return;
  }
  v1::PlanChange change = PlanUpdates::ChangeOf(p, switch_step, UnixMs(now));
  JobDelta delta;
  delta.plan_change = change;
  if (absl::Status s = Save(delta); !s.ok()) {
    out->Complete([done = std::move(p.done), s]() mutable { done(s); });
    return;
  }
  const Schedule latest = p.schedule;
  if (absl::Status s = plans_.Accept(change, std::move(p.schedule)); !s.ok()) {
    // Validated above; a failure here is a bug, and nothing was changed in memory.
    spdlog::error("job {}: plan version {} was written but not accepted: {}", id(),
                  change.version(), s.ToString());
    out->Complete([done = std::move(p.done), s]() mutable { done(absl::InternalError(s.message())); });
    return;
  }
  membership_.SetPlan(latest, switch_step);
  ApplySoftFields(change.spec());
  const std::string message = absl::StrCat(
      "plan version ", change.version(), " accepted: every member switches to it at step ",
      switch_step, " (", answered, " of ", members.size(), " members gave back their decisions",
      all ? "" : "; the others hold the switch back to the end of theirs", ")");
  spdlog::info("job {}: {}", id(), message);
  v1::GenerationChange entry;
  entry.set_generation(membership_.generation());
  entry.set_rank(-1);
  entry.set_reason(absl::StrCat("plan version ", change.version(), " from step ", switch_step));
  entry.set_unix_ms(UnixMs(now));
  history_.AddGeneration(std::move(entry));
  AddEvent(v1::JobEvent::PLAN_UPDATED, -1, message, false, out);
  v1::UpdateJobResponse response;
  response.set_switch_step(switch_step);
  response.set_plan_version(change.version());
  ToProtoLocked(response.mutable_job(), false);
  out->Answer(std::move(p.done), std::move(response));
}

}  // namespace modelavg::server
