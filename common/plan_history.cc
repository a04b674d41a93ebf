#include "modelavg/common/plan_history.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace modelavg {

LevelCarry LevelCarryOf(const ScheduleSpec& prev, const ScheduleSpec& next, int level) {
  const ScheduleLevel& n = next.levels[level];
  if (!n.outer.has_value()) return LevelCarry::kPlain;
  if (level >= static_cast<int>(prev.levels.size())) return LevelCarry::kFresh;
  const ScheduleLevel& p = prev.levels[level];
  if (!p.outer.has_value() || p.group_size != n.group_size || p.fragments != n.fragments) {
    return LevelCarry::kFresh;
  }
  return LevelCarry::kKeepOuter;
}

bool ResidualCarries(const ScheduleLevel& prev, const ScheduleLevel& next) {
  return prev.payload == next.payload && prev.topk_density == next.topk_density;
}

absl::Status ValidatePlanChange(const ScheduleSpec& prev, const ScheduleSpec& next) {
  if (prev.world_size != next.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "world_size may not change in a running job (", prev.world_size, " -> ",
        next.world_size,
        "): the ranks, their credentials and their shards are fixed; create a new job, or use "
        "an elastic job's min_world_size to run with fewer"));
  }
  if (prev.mode != next.mode) {
    return absl::InvalidArgumentError(
        "mode may not change in a running job: a periodic and a hierarchical averager keep "
        "their phases differently; create a new job");
  }
  if (prev.replica_size != next.replica_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_size may not change in a running job (", prev.replica_size, " -> ",
        next.replica_size, "): every rank holds its shard of a replica of that size"));
  }
  return absl::OkStatus();
}

absl::Status PlanHistory::Add(Schedule next, int64_t switch_step) {
  if (size() >= kMaxPlanVersions) {
    return absl::InvalidArgumentError(absl::StrCat("the job has ", size(),
                                                   " plans, the most one job may have"));
  }
  if (switch_step <= plans_.back().switch_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "switch step ", switch_step, " is not past the last plan's switch step ",
        plans_.back().switch_step));
  }
  if (absl::Status s = ValidatePlanChange(Latest().spec(), next.spec()); !s.ok()) return s;
  plans_.push_back({std::move(next), switch_step});
  return absl::OkStatus();
}

int PlanHistory::VersionAt(int64_t step) const {
  // Few versions; the newest is the most likely.
  for (int v = size() - 1; v > 0; --v) {
    if (step >= plans_[v].switch_step) return v;
  }
  return 0;
}

Decision PlanHistory::DecisionFor(int64_t step, int32_t rank) const {
  const int v = VersionAt(step);
  Decision d = plans_[v].schedule.DecisionFor(step, rank);
  d.plan = v;
  return d;
}

std::vector<Decision> PlanHistory::Window(int64_t from_step, int64_t count, int32_t rank) const {
  std::vector<Decision> out;
  if (count <= 0) return out;
  out.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    if (from_step > std::numeric_limits<int64_t>::max() - i) break;
    out.push_back(DecisionFor(from_step + i, rank));
  }
  return out;
}

std::vector<Decision> PlanHistory::WindowAllSubgroups(int64_t from_step, int64_t count) const {
  std::vector<Decision> out;
  int64_t step = from_step;
  int64_t left = count;
  while (left > 0) {
    const int v = VersionAt(step);
    // The steps of this version within the window.
    int64_t n = left;
    if (v + 1 < size()) n = std::min(n, plans_[v + 1].switch_step - step);
    std::vector<Decision> part = plans_[v].schedule.WindowAllSubgroups(step, n);
    for (Decision& d : part) d.plan = v;
    out.insert(out.end(), std::make_move_iterator(part.begin()),
               std::make_move_iterator(part.end()));
    if (step > std::numeric_limits<int64_t>::max() - n) break;
    step += n;
    left -= n;
  }
  return out;
}

int64_t PlanHistory::SwitchStepFrom(int64_t earliest) const {
  // A round started at s is applied at s + d with d < the level's step period: looking back
  // over the longest delay suffices.
  int64_t longest = 0;
  for (const Entry& entry : plans_) {
    for (const ScheduleLevel& l : entry.schedule.spec().levels) {
      longest = std::max(longest, l.sync_delay);
    }
  }
  int64_t e = std::max(earliest, plans_.back().switch_step + 1);
  for (;;) {
    bool in_flight = false;
    for (int64_t s = std::max<int64_t>(0, e - longest); s < e && !in_flight; ++s) {
      const Schedule& plan = At(s);
      const int level = plan.LevelAt(s);
      if (level < 0) continue;
      const int64_t d = plan.spec().levels[level].sync_delay;
      in_flight = d > 0 && s + d >= e;
    }
    if (!in_flight) return e;
    ++e;
  }
}

LevelCarry PlanHistory::CarryAt(int version, int level) const {
  return LevelCarryOf(plans_[version - 1].schedule.spec(), plans_[version].schedule.spec(),
                      level);
}

int PlanHistory::LineageStart(int version, int level) const {
  int v = version;
  while (v > 0 && CarryAt(v, level) == LevelCarry::kKeepOuter) --v;
  return v;
}

int64_t PlanHistory::FirstStepOf(int version, int level) const {
  for (int w = LineageStart(version, level); w <= version; ++w) {
    const int64_t f = plans_[w].schedule.FirstStepFrom(level, plans_[w].switch_step);
    if (f >= 0 && (w + 1 >= size() || f < plans_[w + 1].switch_step)) return f;
  }
  return -1;
}

int64_t PlanHistory::FirstSyncOf(int version, int level, int32_t fragment) const {
  for (int w = LineageStart(version, level); w <= version; ++w) {
    const int64_t f = plans_[w].schedule.FirstSyncFrom(level, fragment, plans_[w].switch_step);
    if (f >= 0 && (w + 1 >= size() || f < plans_[w + 1].switch_step)) return f;
  }
  return -1;
}

}  // namespace modelavg
