#include "server/membership/admission.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace modelavg::server {
namespace {

// The first step >= `step` at which `schedule` averages at some level.
int64_t NextAveragingStep(const Schedule& schedule, int64_t step) {
  const ScheduleSpec& spec = schedule.spec();
  step = std::max(step, spec.warmup_steps);
  if (spec.mode == AveragingMode::kPeriodic) {
    const int64_t p = spec.levels[0].period;
    const int64_t offset = step - spec.warmup_steps;
    return spec.warmup_steps + (offset + p - 1) / p * p;
  }
  int64_t next = std::numeric_limits<int64_t>::max();
  for (const ScheduleLevel& level : spec.levels) {
    next = std::min(next, (step + level.period - 1) / level.period * level.period);
  }
  return next;
}

}  // namespace

bool InsideDelayedSync(const Schedule& schedule, int64_t step) {
  const std::vector<ScheduleLevel>& levels = schedule.spec().levels;
  for (int level = 0; level < static_cast<int>(levels.size()); ++level) {
    for (int64_t d = 1; d < levels[level].sync_delay && d <= step; ++d) {
      if (schedule.LevelAt(step - d) == level) return true;
    }
  }
  return false;
}

absl::StatusOr<int64_t> FindAdmissionStep(const Schedule& schedule,
                                          const std::vector<int32_t>& ranks,
                                          const std::vector<int64_t>& from_step, int64_t floor,
                                          const std::string& job_id) {
  const auto newcomer = [&](int32_t r) {
    return std::find(ranks.begin(), ranks.end(), r) != ranks.end();
  };
  // Per level, the earliest step from which every newcomer has in its subgroup a member that
  // is not a newcomer: the latest of the newcomers' earliest such members.
  std::vector<int64_t> earliest(schedule.num_levels(), kNotMember);
  bool any = false;
  for (int level = 0; level < schedule.num_levels(); ++level) {
    int64_t latest = -1;
    for (int32_t rank : ranks) {
      int64_t mine = kNotMember;
      for (int32_t r : schedule.SubgroupOf(level, rank).Ranks()) {
        if (!newcomer(r)) mine = std::min(mine, from_step[r]);
      }
      latest = std::max(latest, mine);
    }
    earliest[level] = ranks.empty() ? kNotMember : latest;
    any = any || earliest[level] != kNotMember;
  }
  const std::string who = ranks.size() == 1
                              ? absl::StrCat("rank ", ranks[0])
                              : absl::StrCat("ranks ", absl::StrJoin(ranks, ","));
  if (!any) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " has no live member other than ", who,
        " to give a replacement its parameters (with sharded replicas: a live replica that "
        "holds the same shards); it cannot be admitted"));
  }
  // Steps far beyond any real run keep the arithmetic below clear of overflow.
  constexpr int64_t kMaxFloor = std::numeric_limits<int64_t>::max() / 4;
  const int64_t start = std::max<int64_t>(floor, 1);
  if (start > kMaxFloor) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, ": the members report step ", floor,
        ", too large to choose an admission step after it"));
  }
  const int64_t end = start + kMaxAdmissionScan;
  for (int64_t s = start;; ++s) {
    s = NextAveragingStep(schedule, s);
    if (s >= end) break;
    const int level = schedule.LevelAt(s);
    if (level >= 0 && earliest[level] < s && !InsideDelayedSync(schedule, s)) return s;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "job ", job_id, ": no averaging step in [", start, ", ", end,
      ") gives ", who, " a live peer in its subgroup (one admitted before that step) to "
      "receive the parameters from; a replacement is admitted at an averaging step of a block "
      "that still has a live member"));
}

}  // namespace modelavg::server
