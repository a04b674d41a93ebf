#include "modelavg/common/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/outer_fields.h"
#include "common/payload_fields.h"

namespace modelavg {

std::vector<int32_t> SubgroupRange::Ranks() const {
  std::vector<int32_t> ranks(size);
  for (int32_t i = 0; i < size; ++i) ranks[i] = RankAt(i);
  return ranks;
}

std::string SubgroupRange::Describe() const {
  if (size <= 0) return "none";
  if (stride == 1 || size == 1) {
    return size == 1 ? absl::StrCat(first_rank) : absl::StrCat(first_rank, "..", LastRank());
  }
  return absl::StrJoin(Ranks(), ",");
}

absl::Status ValidateScheduleSpec(const ScheduleSpec& spec) {
  if (spec.world_size < 1 || spec.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size must be in [1, ", kMaxWorldSize,
                                                   "], got ", spec.world_size));
  }
  if (spec.warmup_steps < 0 || spec.warmup_steps > kMaxWarmupSteps) {
    return absl::InvalidArgumentError(absl::StrCat("warmup_steps must be in [0, ",
                                                   kMaxWarmupSteps, "], got ",
                                                   spec.warmup_steps));
  }
  if (spec.levels.empty()) {
    return absl::InvalidArgumentError(
        "levels must not be empty: give at least one {period, group_size}");
  }
  if (spec.levels.size() > kMaxLevels) {
    return absl::InvalidArgumentError(absl::StrCat("a job has at most ", kMaxLevels,
                                                   " levels, got ", spec.levels.size()));
  }
  if (spec.mode == AveragingMode::kPeriodic && spec.levels.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode PERIODIC takes exactly one level (period, group_size = world_size), got ",
        spec.levels.size(), " levels; use mode HIERARCHICAL for several"));
  }
  std::set<int64_t> periods;
  for (size_t i = 0; i < spec.levels.size(); ++i) {
    const ScheduleLevel& level = spec.levels[i];
    if (level.period <= 0 || level.period > kMaxPeriod) {
      return absl::InvalidArgumentError(absl::StrCat("levels[", i, "].period must be in [1, ",
                                                     kMaxPeriod, "], got ", level.period));
    }
    if (level.group_size <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("levels[", i, "].group_size must be >= 1, got ", level.group_size));
    }
    if (level.group_size > spec.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("levels[", i, "].group_size ",
                                                     level.group_size, " exceeds world_size ",
                                                     spec.world_size));
    }
    if (spec.world_size % level.group_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("levels[", i, "].group_size ",
                                                     level.group_size,
                                                     " does not divide world_size ",
                                                     spec.world_size));
    }
    if (level.outer.has_value()) {
      if (absl::Status s = ValidateOuter(*level.outer, i); !s.ok()) return s;
    }
    if (absl::Status s = ValidateStreamingLevel(level, i, level.outer.has_value()); !s.ok()) return s;
    if (!periods.insert(level.period).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "levels[", i, "].period ", level.period,
          " appears twice; periods must be distinct (PyTorch keys its levels by period)"));
    }
  }
  if (spec.levels.back().group_size != spec.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the last level's group_size must equal world_size ", spec.world_size, ", got ",
        spec.levels.back().group_size));
  }
  if (absl::Status s = ValidateReplicaSize(spec); !s.ok()) return s;
  return ValidatePacing(spec);
}

int32_t PacedGroupSize(const ScheduleSpec& spec, size_t level) {
  int64_t size = std::max(1, spec.replica_size);
  for (size_t i = 0; i < level && i < spec.levels.size(); ++i) {
    size = std::lcm(size, static_cast<int64_t>(spec.levels[i].group_size));
  }
  return static_cast<int32_t>(std::min<int64_t>(size, spec.world_size));
}

absl::Status ValidatePacing(const ScheduleSpec& spec) {
  for (size_t i = 0; i < spec.levels.size(); ++i) {
    const ScheduleLevel& level = spec.levels[i];
    const std::string at = absl::StrCat("levels[", i, "]");
    if (!(level.max_lag == 0.0 || (level.max_lag >= 1.0 && level.max_lag <= kMaxMaxLag))) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".max_lag must be 0 (no bound) or in [1, ", kMaxMaxLag, "], got ", level.max_lag,
          ": a group is failed out when it falls more than max_lag times its expected round "
          "time behind, and below one round that is ordinary jitter"));
    }
    if (level.max_lag != 0.0 && !level.paced) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".max_lag ", level.max_lag, " needs ", at,
          ".paced: it bounds how far a paced group may fall behind its planned round"));
    }
    if (level.rounds != 0 && !level.paced) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".rounds ", level.rounds, " needs ", at,
          ".paced: only a paced job is counted in rounds (a step-locked one in steps)"));
    }
    if (level.rounds < 0 || level.rounds > kMaxPacedRounds) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".rounds must be in [0, ",
                                                     kMaxPacedRounds, "], got ", level.rounds));
    }
    if (!level.paced) continue;
    if (i + 1 != spec.levels.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".paced: only the last level may be paced (one paced level, above step-locked "
          "ones), and ", at, " is not the last of the job's ", spec.levels.size(), " levels"));
    }
    const int32_t group = PacedGroupSize(spec, i);
    if (group >= spec.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".paced: the level has one group to pace: the lower levels and the replicas lock "
          "ranks together in blocks of lcm(replica_size, lower group sizes) = ", group,
          " = world_size ", spec.world_size,
          " ranks, which always take the same steps; pacing needs at least two blocks"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateReplicaSize(const ScheduleSpec& spec) {
  const int32_t s = spec.replica_size;
  if (s < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_size must be >= 1 (the ranks of one model replica; 0 or 1: every rank holds a "
        "whole replica), got ", s));
  }
  if (s == 1) return absl::OkStatus();
  if (spec.world_size % s != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_size ", s, " does not divide world_size ", spec.world_size,
        ": the world is a whole number of replicas of replica_size ranks each"));
  }
  for (size_t i = 0; i < spec.levels.size(); ++i) {
    if (spec.levels[i].group_size % s != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replica_size ", s, " does not divide levels[", i, "].group_size ",
          spec.levels[i].group_size,
          ": a level's groups are made of whole replicas (each rank averages with the ranks of "
          "its group that hold its shard)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateStreamingLevel(const ScheduleLevel& level, size_t index, bool outer) {
  const std::string at = absl::StrCat("levels[", index, "]");
  if (level.fragments < 1 || level.fragments > kMaxFragments) {
    return absl::InvalidArgumentError(absl::StrCat(at, ".fragments must be in [1, ",
                                                   kMaxFragments, "], got ", level.fragments));
  }
  if (level.period % level.fragments != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ".fragments ", level.fragments, " does not divide ", at, ".period ", level.period,
        ": each fragment syncs once a period, one every period / fragments steps"));
  }
  const int64_t step_period = level.StepPeriod();
  if (level.sync_delay < 0 || level.sync_delay >= step_period) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ".sync_delay must be in [0, period / fragments = ", step_period, "), got ",
        level.sync_delay, " (a fragment's result is applied before the next fragment starts)"));
  }
  if (!(level.mix >= 0.0 && level.mix <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ".mix must be in [0, 1], got ", level.mix));
  }
  const char* payload_name = PayloadName(level.payload);
  if (!(level.error_feedback >= 0.0 && level.error_feedback <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ".error_feedback must be in [0, 1] (0: off, 1: classic error feedback), got ",
        level.error_feedback));
  }
  if (absl::Status s = CheckPayloadFields(
          level.payload, level.topk_density, level.error_feedback, outer,
          [&at](absl::string_view field, double value) {
            return absl::StrCat(at, ".", field, " ", value);
          });
      !s.ok()) {
    return s;
  }
  if (!outer) {
    if (level.error_feedback != 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".error_feedback ", level.error_feedback,
          " needs an outer level with a compressed payload: a plain level averages the "
          "parameters themselves; give ", at,
          " an outer optimizer (lr 1, momentum 0 is plain averaging) and a payload, or set "
          "error_feedback 0"));
    }
    if (level.payload != Payload::kFp32) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".payload ", payload_name,
          " needs an outer level: a plain level averages the parameters themselves, which do "
          "not survive compression; to average the compressed delta instead, give ", at,
          " an outer optimizer with lr 1 and momentum 0 (equal to plain averaging)"));
    }
    if (level.sync_delay != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".sync_delay ", level.sync_delay,
          " needs an outer level (a delayed result is applied to the level's anchor); give ", at,
          " an outer optimizer (lr 1, momentum 0 is plain averaging) or set sync_delay 0"));
    }
    if (level.mix != 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ".mix ", level.mix,
          " needs an outer level (it mixes the level's anchor with the local parameters); give ",
          at, " an outer optimizer or set mix 0"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> ScheduleWarnings(const ScheduleSpec& spec) {
  std::vector<std::string> warnings;
  if (spec.levels.empty()) return warnings;
  if (spec.levels.back().period == 1) {
    warnings.push_back(
        "the largest (last) period is 1: every step averages over the world, which costs as much "
        "as all-reducing gradients; plain data-parallel training is cheaper");
  }
  for (size_t i = 1; i < spec.levels.size(); ++i) {
    const ScheduleLevel& a = spec.levels[i - 1];
    const ScheduleLevel& b = spec.levels[i];
    if (b.StepPeriod() <= a.StepPeriod()) {
      if (a.fragments == 1 && b.fragments == 1) {
        warnings.push_back(absl::StrCat(
            "periods are not ascending (levels[", i - 1, "].period ", a.period, ", levels[", i,
            "].period ", b.period,
            "): later levels take precedence when several periods divide a step"));
      } else {
        warnings.push_back(absl::StrCat(
            "step periods (period / fragments) are not ascending (levels[", i - 1, "]: ",
            a.StepPeriod(), ", levels[", i, "]: ", b.StepPeriod(),
            "): later levels take precedence when several step periods divide a step"));
      }
      break;
    }
  }
  return warnings;
}

absl::StatusOr<Schedule> Schedule::Create(ScheduleSpec spec) {
  if (absl::Status s = ValidateScheduleSpec(spec); !s.ok()) return s;
  return Schedule(std::move(spec));
}

int Schedule::LevelAt(int64_t step) const {
  if (step < spec_.warmup_steps) return -1;
  if (spec_.mode == AveragingMode::kPeriodic) {
    return (step - spec_.warmup_steps) % spec_.levels[0].StepPeriod() == 0 ? 0 : -1;
  }
  for (int i = num_levels() - 1; i >= 0; --i) {
    if (step % spec_.levels[i].StepPeriod() == 0) return i;
  }
  return -1;
}

int32_t Schedule::FragmentAt(int level, int64_t step) const {
  const ScheduleLevel& l = spec_.levels[level];
  if (l.fragments <= 1) return 0;
  const int64_t from = spec_.mode == AveragingMode::kPeriodic ? step - spec_.warmup_steps : step;
  return static_cast<int32_t>((from / l.StepPeriod()) % l.fragments);
}

SubgroupRange Schedule::SubgroupOf(int level, int32_t rank) const {
  const int32_t s = spec_.replica_size;
  return Subgroup(level, rank / spec_.levels[level].group_size * s + rank % s);
}

int32_t Schedule::NumSubgroups(int level) const {
  return spec_.world_size / spec_.levels[level].group_size * spec_.replica_size;
}

SubgroupRange Schedule::Subgroup(int level, int32_t index) const {
  // Subgroup index = block * S + shard: the shard's ranks of the block, S apart.
  const int32_t g = spec_.levels[level].group_size;
  const int32_t s = spec_.replica_size;
  return SubgroupRange{index, index / s * g + index % s, g / s, s};
}

std::vector<SubgroupRange> Schedule::SubgroupsAt(int level) const {
  std::vector<SubgroupRange> out;
  const int32_t n = NumSubgroups(level);
  out.reserve(n);
  for (int32_t index = 0; index < n; ++index) out.push_back(Subgroup(level, index));
  return out;
}

Decision Schedule::AveragingDecision(int64_t step, int level, const SubgroupRange& group) const {
  Decision d;
  d.step = step;
  d.average = true;
  d.level = level;
  d.period = spec_.levels[level].period;
  d.outer = spec_.levels[level].outer.has_value();
  d.fragment = FragmentAt(level, step);
  d.fragments = spec_.levels[level].fragments;
  d.subgroup = group;
  return d;
}

Decision Schedule::DecisionFor(int64_t step, int32_t rank) const {
  const int level = LevelAt(step);
  if (level < 0) {
    Decision skip;
    skip.step = step;
    return skip;
  }
  return AveragingDecision(step, level, SubgroupOf(level, rank));
}

int Schedule::PacedLevel() const {
  return !spec_.levels.empty() && spec_.levels.back().paced ? num_levels() - 1 : -1;
}

Decision Schedule::DecisionBelowPaced(int64_t step, int32_t rank) const {
  int level = -1;
  if (step >= spec_.warmup_steps && spec_.mode != AveragingMode::kPeriodic) {
    for (int i = PacedLevel() - 1; i >= 0; --i) {
      if (step % spec_.levels[i].StepPeriod() == 0) {
        level = i;
        break;
      }
    }
  }
  if (level < 0) {
    Decision skip;
    skip.step = step;
    return skip;
  }
  return AveragingDecision(step, level, SubgroupOf(level, rank));
}

Decision Schedule::PacedDecision(int64_t step, int32_t rank, int64_t round,
                                 int32_t fragment) const {
  const int level = PacedLevel();
  Decision d = AveragingDecision(step, level, SubgroupOf(level, rank));
  d.fragment = fragment;
  d.round = round;
  return d;
}

int64_t Schedule::FirstStepFrom(int level, int64_t from) const {
  const int64_t period = spec_.levels[level].StepPeriod();
  const int64_t start = std::max(from, spec_.warmup_steps);
  if (spec_.mode == AveragingMode::kPeriodic) {
    // Acts at warmup + k * period.
    const int64_t k = (start - spec_.warmup_steps + period - 1) / period;
    return spec_.warmup_steps + k * period;
  }
  // Hierarchical: the multiples of the period from `start` on, the first no later level takes.
  for (int64_t k = (start + period - 1) / period, n = 0; n < kFirstStepSearch; ++k, ++n) {
    if (LevelAt(k * period) == level) return k * period;
  }
  return -1;
}

int64_t Schedule::FirstSyncFrom(int level, int32_t fragment, int64_t from) const {
  const int64_t first = FirstStepFrom(level, from);
  if (first < 0) return -1;
  const int64_t p = spec_.levels[level].StepPeriod();
  for (int64_t s = first, n = 0; n < kFirstStepSearch; s += p, ++n) {
    if (LevelAt(s) == level && FragmentAt(level, s) == fragment) return s;
  }
  return -1;
}

std::vector<Decision> Schedule::Window(int64_t from_step, int64_t count, int32_t rank) const {
  std::vector<Decision> out;
  if (count <= 0) return out;
  out.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    if (from_step > std::numeric_limits<int64_t>::max() - i) break;
    out.push_back(DecisionFor(from_step + i, rank));
  }
  return out;
}

std::vector<Decision> Schedule::WindowAllSubgroups(int64_t from_step, int64_t count) const {
  std::vector<Decision> out;
  for (int64_t i = 0; i < count; ++i) {
    if (from_step > std::numeric_limits<int64_t>::max() - i) break;
    const int64_t step = from_step + i;
    const int level = LevelAt(step);
    if (level < 0) {
      Decision d;
      d.step = step;
      out.push_back(d);
      continue;
    }
    for (const SubgroupRange& group : SubgroupsAt(level)) {
      out.push_back(AveragingDecision(step, level, group));
    }
  }
  return out;
}

}  // namespace modelavg
