#include "common/job_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/outer_fields.h"
#include "common/payload_fields.h"
#include "common/status_util.h"

namespace modelavg {

absl::Status ValidateJobId(absl::string_view job_id) {
  if (job_id.empty()) {
    return absl::InvalidArgumentError("job_id must not be empty");
  }
  if (job_id.size() > kMaxJobIdLength) {
    return absl::InvalidArgumentError(absl::StrCat("job_id is ", job_id.size(),
                                                   " characters; at most ", kMaxJobIdLength,
                                                   " are allowed"));
  }
  for (char c : job_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job_id \"", job_id, "\" has a character outside [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

namespace {

// The streaming fields of `level` (index `i`) into `out`; INVALID_ARGUMENT for a negative
// fragment count or an unknown payload (the rest is checked with the schedule).
absl::Status StreamingFromProto(const v1::Level& level, int i, ScheduleLevel* out) {
  if (level.fragments() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "levels[", i, "].fragments must be >= 1 (0: one fragment), got ", level.fragments()));
  }
  out->fragments = level.fragments() == 0 ? 1 : level.fragments();
  out->sync_delay = level.sync_delay();
  out->mix = level.mix();
  const PayloadInfo* payload = PayloadInfoOfProto(level.payload());
  if (payload == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("levels[", i, "].payload must be ",
                     PayloadNameList([](const PayloadInfo&) { return true; }), ", got ",
                     level.payload()));
  }
  out->payload = payload->payload;
  out->error_feedback = level.error_feedback();
  out->topk_density = level.topk_density();
  return absl::OkStatus();
}

// The paced levels' rules that need more than the schedule spec (ValidatePacing has the rest).
absl::Status CheckPacingOfJob(const v1::JobSpec& spec, const ScheduleSpec& schedule) {
  const bool elastic = spec.min_world_size() > 0 && spec.min_world_size() < spec.world_size();
  for (size_t i = 0; i < schedule.levels.size(); ++i) {
    const ScheduleLevel& level = schedule.levels[i];
    if (level.max_lag != 0.0 && !elastic) {
      return absl::InvalidArgumentError(absl::StrCat(
          "levels[", i, "].max_lag ", level.max_lag,
          " needs an elastic job (min_world_size below world_size ", spec.world_size(),
          "): a group that falls that far behind is failed out as a straggler, and a strict "
          "job cannot go on without it; set min_world_size or max_lag 0 (no bound)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ScheduleSpec> ScheduleSpecFromProto(const v1::JobSpec& spec) {
  if (absl::Status s = ValidateJobId(spec.job_id()); !s.ok()) return s;
  ScheduleSpec out;
  switch (spec.mode()) {
    case v1::PERIODIC:
      out.mode = AveragingMode::kPeriodic;
      break;
    case v1::HIERARCHICAL:
      out.mode = AveragingMode::kHierarchical;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("mode must be PERIODIC or HIERARCHICAL, got ",
                       v1::Mode_Name(spec.mode()).empty() ? absl::StrCat(spec.mode())
                                                          : v1::Mode_Name(spec.mode())));
  }
  out.world_size = spec.world_size();
  out.warmup_steps = spec.warmup_steps();
  if (spec.replica_size() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_size must be >= 0 (the ranks of one model replica; 0 or 1: every rank holds a "
        "whole replica), got ", spec.replica_size()));
  }
  out.replica_size = spec.replica_size() == 0 ? 1 : spec.replica_size();
  // Checked before copying: a spec of a million levels costs nothing more than its parse.
  if (spec.levels_size() > static_cast<int>(kMaxLevels)) {
    return absl::InvalidArgumentError(absl::StrCat("a job has at most ", kMaxLevels,
                                                   " levels, got ", spec.levels_size()));
  }
  for (int i = 0; i < spec.levels_size(); ++i) {
    const v1::Level& level = spec.levels(i);
    ScheduleLevel l{level.period(), level.group_size()};
    if (level.has_outer()) {
      l.outer = OuterFromProto(level.outer());
    }
    MODELAVG_RETURN_IF_ERROR(StreamingFromProto(level, i, &l));
    l.paced = level.paced();
    l.max_lag = level.max_lag();
    l.rounds = level.rounds();
    out.levels.push_back(l);
  }
  if (absl::Status s = ValidateScheduleSpec(out); !s.ok()) return s;
  if (spec.heartbeat_timeout_ms() < 0 || spec.heartbeat_timeout_ms() > kMaxHeartbeatTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_timeout_ms must be in [0, ", kMaxHeartbeatTimeoutMs,
                     "] (0: the coordinator's default), got ", spec.heartbeat_timeout_ms()));
  }
  if (spec.heartbeat_timeout_ms() > 0 && spec.heartbeat_timeout_ms() < kMinHeartbeatTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat_timeout_ms is ", spec.heartbeat_timeout_ms(), "; it must be at least ",
        kMinHeartbeatTimeoutMs, " (or 0: the coordinator's default): members beat every 100 ms, "
        "and a shorter timeout declares live members dead at the first late beat"));
  }
  if (spec.min_world_size() < 0 || spec.min_world_size() > spec.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_world_size must be in [1, world_size = ", spec.world_size(),
        "] (0: world_size, a strict job), got ", spec.min_world_size()));
  }
  if (out.replica_size > 1 && spec.min_world_size() % out.replica_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replica_size ", out.replica_size, " does not divide min_world_size ",
        spec.min_world_size(),
        ": an elastic job of sharded replicas loses and admits whole replicas, so its smallest "
        "world is a whole number of them"));
  }
  if (spec.join_timeout_ms() < 0 || spec.join_timeout_ms() > kMaxJoinTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("join_timeout_ms must be in [0, ", kMaxJoinTimeoutMs,
                     "] (0: the coordinator's default), got ", spec.join_timeout_ms()));
  }
  if (spec.join_timeout_ms() > 0 && spec.join_timeout_ms() < kMinJoinTimeoutMs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join_timeout_ms is ", spec.join_timeout_ms(), "; it must be at least ",
        kMinJoinTimeoutMs, " (or 0: the coordinator's default): a Join waits for every other "
        "worker of the world to start and reach the coordinator"));
  }
  MODELAVG_RETURN_IF_ERROR(CheckPacingOfJob(spec, out));
  return out;
}

void ScheduleSpecToProto(const ScheduleSpec& spec, v1::JobSpec* out) {
  out->set_world_size(spec.world_size);
  out->set_warmup_steps(spec.warmup_steps);
  out->set_mode(spec.mode == AveragingMode::kPeriodic ? v1::PERIODIC : v1::HIERARCHICAL);
  if (spec.replica_size > 1) {
    out->set_replica_size(spec.replica_size);
  } else {
    out->clear_replica_size();
  }
  out->clear_levels();
  for (const ScheduleLevel& level : spec.levels) {
    v1::Level* l = out->add_levels();
    l->set_period(level.period);
    l->set_group_size(level.group_size);
    if (level.outer.has_value()) {
      OuterToProto(*level.outer, l->mutable_outer());
    }
    if (level.fragments > 1) l->set_fragments(level.fragments);
    l->set_sync_delay(level.sync_delay);
    l->set_mix(level.mix);
    l->set_payload(static_cast<v1::Payload>(PayloadInfoOf(level.payload).proto));
    l->set_error_feedback(level.error_feedback);
    l->set_topk_density(level.topk_density);
    l->set_paced(level.paced);
    l->set_max_lag(level.max_lag);
    l->set_rounds(level.rounds);
  }
}

void DecisionToProto(const Decision& d, int64_t generation, v1::StepDecision* out) {
  out->Clear();
  out->set_step(d.step);
  out->set_generation(generation);
  out->set_plan(d.plan);
  if (!d.average) {
    out->set_action(v1::SKIP);
    return;
  }
  out->set_action(v1::AVERAGE);
  out->set_level(d.level);
  out->set_period(d.period);
  out->set_outer(d.outer);
  out->set_fragment(d.fragment);
  out->set_fragments(d.fragments);
  out->set_subgroup(d.subgroup.index);
  out->mutable_ranks()->Reserve(d.subgroup.size);
  for (int32_t i = 0; i < d.subgroup.size; ++i) out->add_ranks(d.subgroup.RankAt(i));
  if (d.members.empty()) {
    *out->mutable_members() = out->ranks();
  } else {
    out->mutable_members()->Add(d.members.begin(), d.members.end());
  }
  out->mutable_joining()->Add(d.joining.begin(), d.joining.end());
  if (d.round >= 0) out->set_round(d.round);
  out->mutable_weights()->Add(d.weights.begin(), d.weights.end());
}

Decision DecisionFromProto(const v1::StepDecision& d) {
  Decision out;
  out.step = d.step();
  out.generation = d.generation();
  out.plan = d.plan();
  if (d.action() != v1::AVERAGE) return out;
  out.average = true;
  out.level = d.level();
  out.period = d.period();
  out.outer = d.outer();
  out.fragment = d.fragment();
  out.fragments = d.fragments() > 0 ? d.fragments() : 1;
  out.subgroup.index = d.subgroup();
  out.subgroup.size = d.ranks_size();
  out.subgroup.first_rank = d.ranks_size() > 0 ? d.ranks(0) : 0;
  // The ranks are evenly spaced by the job's replica size (1: consecutive).
  out.subgroup.stride = d.ranks_size() > 1 ? std::max(1, d.ranks(1) - d.ranks(0)) : 1;
  out.members.assign(d.members().begin(), d.members().end());
  out.joining.assign(d.joining().begin(), d.joining().end());
  out.round = d.has_round() ? d.round() : -1;
  out.weights.assign(d.weights().begin(), d.weights().end());
  return out;
}

std::vector<std::pair<std::string, std::string>> PacingRows(const v1::PacingStatus& pacing) {
  std::vector<std::pair<std::string, std::string>> rows;
  auto pace = [](std::string* out, double v) {
    absl::StrAppend(out, v > 0 ? absl::StrFormat("%.3g", v) : "?");
  };
  rows.emplace_back("group paces",
                    absl::StrCat(absl::StrJoin(pacing.group_paces(), ", ", pace), " steps/s"));
  rows.emplace_back("rounds planned",
                    absl::StrCat(pacing.rounds_planned(),
                                 pacing.rounds_budget() > 0
                                     ? absl::StrCat(" of ", pacing.rounds_budget())
                                     : std::string()));
  for (auto it = pacing.last_rounds().rbegin(); it != pacing.last_rounds().rend(); ++it) {
    std::vector<std::string> steps, weights;
    for (int g = 0; g < it->sync_steps_size(); ++g) {
      steps.push_back(absl::StrCat(it->sync_steps(g)));
    }
    const int32_t size = std::max(1, it->group_size());
    for (int r = 0; r < it->tokens_per_step_size(); ++r) {
      const int g = r / size;
      if (g < it->inner_steps_size()) {
        weights.push_back(absl::StrFormat("%g", static_cast<double>(it->inner_steps(g)) *
                                                    it->tokens_per_step(r)));
      }
    }
    rows.emplace_back(absl::StrCat("round ", it->round()),
                      absl::StrCat("sync steps ", absl::StrJoin(steps, ", "), " (+",
                                   absl::StrJoin(it->inner_steps(), ", +"), "); weights ",
                                   absl::StrJoin(weights, ", ")));
  }
  rows.emplace_back("idle saved", absl::StrFormat("%.0f%%", 100 * pacing.idle_saved()));
  return rows;
}

}  // namespace modelavg
