#include "server/membership/plan_updates.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"

namespace modelavg::server {
namespace {

template <typename T>
void Grow(std::vector<T>& v, int32_t rank, T fill) {
  if (rank >= static_cast<int32_t>(v.size())) v.resize(rank + 1, fill);
}

}  // namespace

PlanUpdates::PlanUpdates(const v1::JobSpec& spec, Schedule first, int64_t created_unix_ms)
    : history_(std::make_shared<const PlanHistory>(std::move(first))) {
  v1::PlanChange v0;
  v0.set_version(0);
  v0.set_switch_step(0);
  *v0.mutable_spec() = spec;
  v0.set_unix_ms(created_unix_ms);
  plans_.push_back(std::move(v0));
}

absl::Status PlanUpdates::Restore(const std::vector<v1::PlanChange>& changes) {
  for (const v1::PlanChange& c : changes) {
    if (c.version() != size()) {
      return absl::InvalidArgumentError(absl::StrCat("stored plan version ", c.version(),
                                                     " does not follow version ", size() - 1));
    }
    absl::StatusOr<ScheduleSpec> spec = ScheduleSpecFromProto(c.spec());
    absl::StatusOr<Schedule> schedule =
        spec.ok() ? Schedule::Create(*std::move(spec)) : absl::StatusOr<Schedule>(spec.status());
    if (!schedule.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("stored plan version ", c.version(), ": ",
                                                     schedule.status().message()));
    }
    if (absl::Status s = Accept(c, *std::move(schedule)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void PlanUpdates::Handed(int32_t rank, int64_t last_step) {
  Grow(handed_, rank, int64_t{-1});
  handed_[rank] = std::max(handed_[rank], last_step);
}

void PlanUpdates::Reported(int32_t rank, int64_t used_through, int32_t answered) {
  Grow(reported_, rank, int64_t{-1});
  Grow(answered_, rank, 0);
  reported_[rank] = used_through;
  answered_[rank] = answered;
}

int64_t PlanUpdates::UsedThrough(int32_t rank) const {
  int64_t through = -1;
  if (rank < static_cast<int32_t>(handed_.size())) through = handed_[rank];
  if (rank < static_cast<int32_t>(reported_.size())) through = std::max(through, reported_[rank]);
  return through;
}

bool PlanUpdates::Answered(int32_t rank) const {
  return proposal_ && rank < static_cast<int32_t>(answered_.size()) &&
         answered_[rank] == proposal_->version;
}

void PlanUpdates::Propose(v1::JobSpec spec, Schedule schedule, absl::Time deadline,
                          UpdateCallback done) {
  proposal_ = Proposal{size(), std::move(spec), std::move(schedule), deadline, std::move(done)};
}

PlanUpdates::Proposal PlanUpdates::TakeProposal() {
  Proposal p = *std::move(proposal_);
  proposal_.reset();
  return p;
}

int64_t PlanUpdates::ChooseSwitchStep(const std::vector<int32_t>& members,
                                      const std::vector<int64_t>& steps, int64_t floor) const {
  int64_t last = floor - 1;
  for (size_t i = 0; i < members.size(); ++i) {
    const int32_t r = members[i];
    // A member that answered gave back what it held past its answer; one that did not may use
    // all it was handed. Either way it may be at its reported step already.
    const int64_t through =
        Answered(r) ? reported_[r] : std::max(UsedThrough(r), steps[i]);
    last = std::max({last, through, steps[i]});
  }
  return history_->SwitchStepFrom(last + 1);
}

v1::PlanChange PlanUpdates::ChangeOf(const Proposal& proposal, int64_t switch_step,
                                     int64_t unix_ms) {
  v1::PlanChange c;
  c.set_version(proposal.version);
  c.set_switch_step(switch_step);
  *c.mutable_spec() = proposal.spec;
  c.set_unix_ms(unix_ms);
  return c;
}

absl::Status PlanUpdates::Accept(const v1::PlanChange& change, Schedule schedule) {
  auto next = std::make_shared<PlanHistory>(*history_);
  if (absl::Status s = next->Add(std::move(schedule), change.switch_step()); !s.ok()) return s;
  history_ = std::move(next);
  plans_.push_back(change);
  return absl::OkStatus();
}

const v1::PlanChange* PlanUpdates::Pending(int64_t min_step) const {
  const v1::PlanChange& last = plans_.back();
  return last.version() > 0 && last.switch_step() > min_step ? &last : nullptr;
}

}  // namespace modelavg::server
