#include "server/pacing/pacing.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace modelavg::server {

namespace {

bool Known(double pace) { return std::isfinite(pace) && pace > 0; }

}  // namespace

absl::StatusOr<Pacing> Pacing::Create(const Schedule& schedule) {
  const ScheduleSpec& spec = schedule.spec();
  const int level = schedule.num_levels() - 1;
  if (level < 0 || !spec.levels[level].paced) {
    return absl::InvalidArgumentError("the job's last level is not paced: nothing to pace");
  }
  const int32_t group_size = PacedGroupSize(spec, static_cast<size_t>(level));
  const int64_t first_step = schedule.FirstStepOf(level);
  if (first_step < 0) {
    // The last level outranks every other, so its first step is always found.
    return absl::InvalidArgumentError(
        absl::StrCat("levels[", level, "] has no first averaging step"));
  }
  return Pacing(level, group_size, spec.world_size / group_size,
                spec.levels[level].StepPeriod(), spec.levels[level].fragments, first_step,
                schedule.FragmentAt(level, first_step));
}

std::vector<double> Pacing::GroupPaces(const std::vector<double>& rank_pace) const {
  std::vector<double> out(num_groups_, -1.0);
  // Ranks past the world (a caller's longer vector) are ignored rather than read out of range.
  const size_t world = static_cast<size_t>(num_groups_) * static_cast<size_t>(group_size_);
  for (size_t rank = 0; rank < std::min(rank_pace.size(), world); ++rank) {
    const double pace = rank_pace[rank];
    if (!Known(pace)) continue;
    double& group = out[GroupOf(static_cast<int32_t>(rank))];
    group = Known(group) ? std::min(group, pace) : pace;
  }
  return out;
}

PacedRound Pacing::First() const {
  PacedRound round;
  round.round = 0;
  round.fragment = first_fragment_;
  round.sync_step.assign(num_groups_, first_step_);
  round.inner_steps.assign(num_groups_, first_step_ + 1);
  return round;
}

int64_t Pacing::InnerSteps(double pace, double slowest) const {
  if (!Known(pace) || !Known(slowest)) return step_period_;
  const double ratio = pace / slowest;
  if (!(ratio < static_cast<double>(kMaxPaceRatio))) return kMaxPaceRatio * step_period_;
  const double steps =
      std::floor(static_cast<double>(step_period_) * ratio + kPaceRoundingSlack);
  // ratio >= 1 when slowest is the smallest known pace; the bound keeps the rule's promise
  // (n >= p) for any caller.
  return std::clamp(static_cast<int64_t>(steps), step_period_, kMaxPaceRatio * step_period_);
}

absl::StatusOr<PacedRound> Pacing::Next(const PacedRound& previous,
                                                const std::vector<double>& group_pace) const {
  if (previous.sync_step.size() != static_cast<size_t>(num_groups_) ||
      previous.inner_steps.size() != static_cast<size_t>(num_groups_) ||
      group_pace.size() != static_cast<size_t>(num_groups_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a paced round needs one entry per group (", num_groups_, "), got ",
        previous.sync_step.size(), " sync steps and ", group_pace.size(), " paces"));
  }
  double slowest = -1;
  for (double pace : group_pace) {
    if (Known(pace) && (!Known(slowest) || pace < slowest)) slowest = pace;
  }
  PacedRound next;
  next.round = previous.round + 1;
  next.fragment = static_cast<int32_t>((first_fragment_ + next.round) % fragments_);
  next.sync_step.resize(num_groups_);
  next.inner_steps.resize(num_groups_);
  for (int32_t g = 0; g < num_groups_; ++g) {
    const int64_t n = InnerSteps(group_pace[g], slowest);
    if (previous.sync_step[g] > kMaxPacedStep - n) {
      return absl::OutOfRangeError(absl::StrCat(
          "round ", next.round, " of group ", g, " would sync past step ", kMaxPacedStep));
    }
    next.sync_step[g] = previous.sync_step[g] + n;
    next.inner_steps[g] = n;
  }
  return next;
}

}  // namespace modelavg::server
