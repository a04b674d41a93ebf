#include "server/pacing/paced_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace modelavg::server {

absl::StatusOr<PacedPlan> PacedPlan::Create(const Schedule& schedule) {
  absl::StatusOr<Pacing> pacing = Pacing::Create(schedule);
  if (!pacing.ok()) return pacing.status();
  PacedPlan plan(*std::move(pacing), schedule.world_size(),
                 schedule.spec().levels.back().rounds);
  return plan;
}

PacedPlan::PacedPlan(Pacing pacing, int32_t world, int64_t budget)
    : pacing_(std::move(pacing)),
      world_(world),
      budget_(budget),
      pace_(world, -1.0),
      step_(world, -1),
      tokens_(std::make_shared<const std::vector<double>>(world, 1.0)) {}

void PacedPlan::NotePace(int32_t rank, double steps_per_second) {
  if (rank < 0 || rank >= world_) return;
  pace_[rank] = std::isfinite(steps_per_second) && steps_per_second > 0 ? steps_per_second : -1.0;
}

void PacedPlan::NoteStep(int32_t rank, int64_t step, absl::Time now) {
  if (rank < 0 || rank >= world_) return;
  step_[rank] = std::max(step_[rank], step);
  const int32_t g = pacing_.GroupOf(rank);
  // The rounds this report reaches for the first time (newest first; older ones were reached
  // before or together).
  for (auto it = rounds_.rbegin(); it != rounds_.rend(); ++it) {
    // A member reports its step counter, past the call it is in: inside its round's call (sync
    // step s) it reports s + 1, and s while it has not reached the call yet.
    if (it->round.sync_step[g] >= step) continue;
    if (it->first_arrival != absl::InfiniteFuture()) break;
    it->first_arrival = now;
  }
}

void PacedPlan::Forget(int32_t rank) {
  if (rank < 0 || rank >= world_) return;
  pace_[rank] = -1.0;
  step_[rank] = -1;
}

std::vector<int32_t> PacedPlan::Stragglers(absl::Time now, double max_lag,
                                           const std::vector<bool>& live) const {
  std::vector<int32_t> late;
  if (max_lag <= 0) return late;
  // The latest round some group reached.
  auto it = std::find_if(rounds_.rbegin(), rounds_.rend(), [](const PlannedRound& p) {
    return p.first_arrival != absl::InfiniteFuture();
  });
  if (it == rounds_.rend()) return late;
  double slowest = -1;
  for (double v : it->group_paces) {
    if (v > 0 && (slowest < 0 || v < slowest)) slowest = v;
  }
  if (slowest <= 0) return late;
  const absl::Duration expected =
      absl::Seconds(static_cast<double>(pacing_.step_period()) / slowest);
  if (now - it->first_arrival <= max_lag * expected) return late;
  for (int32_t g = 0; g < pacing_.num_groups(); ++g) {
    // A group is there when each of its live members reported its sync step.
    std::vector<int32_t> members;
    bool behind = false;
    for (int32_t r = g * pacing_.group_size(); r < (g + 1) * pacing_.group_size(); ++r) {
      if (r >= static_cast<int32_t>(live.size()) || !live[r]) continue;
      members.push_back(r);
      behind = behind || step_[r] <= it->round.sync_step[g];
    }
    if (behind) late.insert(late.end(), members.begin(), members.end());
  }
  return late;
}

absl::Status PacedPlan::CheckTokens(double tokens_per_step) {
  if (tokens_per_step == 0.0) return absl::OkStatus();
  if (!(std::isfinite(tokens_per_step) && tokens_per_step > 0 &&
        tokens_per_step <= kMaxTokensPerStep)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens_per_step must be 0 (read as 1) or in (0, ", kMaxTokensPerStep, "], got ",
        tokens_per_step, " (MODELAVG_TOKENS_PER_STEP or the client option tokens_per_step)"));
  }
  return absl::OkStatus();
}

void PacedPlan::NoteTokens(int32_t rank, double tokens_per_step) {
  if (rank < 0 || rank >= world_ || !CheckTokens(tokens_per_step).ok()) return;
  const double t = tokens_per_step == 0.0 ? 1.0 : tokens_per_step;
  if ((*tokens_)[rank] == t) return;
  auto next = std::make_shared<std::vector<double>>(*tokens_);
  (*next)[rank] = t;
  tokens_ = std::move(next);
}

absl::StatusOr<std::vector<PlannedRound>> PacedPlan::RoundsNeeded(int32_t rank,
                                                                  int64_t step) const {
  const int32_t g = pacing_.GroupOf(rank);
  std::vector<PlannedRound> out;
  if (rounds_.empty()) {
    // Round 0 with the tokens of the members that asked for it (the job's members by then).
    out.push_back(PlannedRound{pacing_.First(), tokens_, pacing_.GroupPaces(pace_)});
  }
  auto last = [&]() -> const PacedRound& {
    return out.empty() ? rounds_.back().round : out.back().round;
  };
  while (last().sync_step[g] < step && (budget_ == 0 || last().round + 1 < budget_)) {
    std::vector<double> paces = pacing_.GroupPaces(pace_);
    absl::StatusOr<PacedRound> next = pacing_.Next(last(), paces);
    if (!next.ok()) return next.status();
    out.push_back(PlannedRound{*std::move(next), tokens_, std::move(paces)});
  }
  return out;
}

absl::StatusOr<PlannedRound> PacedPlan::NextRound() const {
  if (rounds_.empty()) return PlannedRound{pacing_.First(), tokens_, pacing_.GroupPaces(pace_)};
  const PacedRound& last = rounds_.back().round;
  if (budget_ > 0 && last.round + 1 >= budget_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job's last paced round (", budget_ - 1, " of its budget of ", budget_,
        " rounds) is planned: no round is left to admit a replacement at"));
  }
  std::vector<double> paces = pacing_.GroupPaces(pace_);
  absl::StatusOr<PacedRound> next = pacing_.Next(last, paces);
  if (!next.ok()) return next.status();
  return PlannedRound{*std::move(next), tokens_, std::move(paces)};
}

void PacedPlan::Commit(std::vector<PlannedRound> rounds) {
  for (PlannedRound& r : rounds) {
    rounds_.push_back(std::move(r));
    if (rounds_.size() > kMaxKeptRounds) {
      rounds_.pop_front();
      ++dropped_;
    }
  }
}

int64_t PacedPlan::FirstKeptAfter(size_t adding) const {
  const size_t total = rounds_.size() + adding;
  return dropped_ + static_cast<int64_t>(total > kMaxKeptRounds ? total - kMaxKeptRounds : 0);
}

absl::StatusOr<bool> PacedPlan::PlanFor(int32_t rank, int64_t step) {
  absl::StatusOr<std::vector<PlannedRound>> needed = RoundsNeeded(rank, step);
  if (!needed.ok()) return needed.status();
  const bool any = !needed->empty();
  Commit(*std::move(needed));
  return any;
}

v1::PacedRound PacedPlan::ToProto(const PlannedRound& planned) const {
  v1::PacedRound out;
  out.set_round(planned.round.round);
  out.set_fragment(planned.round.fragment);
  out.set_group_size(pacing_.group_size());
  out.mutable_sync_steps()->Add(planned.round.sync_step.begin(), planned.round.sync_step.end());
  out.mutable_inner_steps()->Add(planned.round.inner_steps.begin(),
                                 planned.round.inner_steps.end());
  out.mutable_tokens_per_step()->Add(planned.tokens->begin(), planned.tokens->end());
  for (double p : planned.group_paces) out.add_group_paces(p > 0 ? p : 0);
  return out;
}

double PacedPlan::IdleSaved(const PlannedRound& planned) const {
  double slowest = -1;
  for (double v : planned.group_paces) {
    if (v > 0 && (slowest < 0 || v < slowest)) slowest = v;
  }
  if (slowest <= 0) return 0;
  const double p = static_cast<double>(pacing_.step_period());
  double sum = 0;
  int known = 0;
  for (size_t g = 0; g < planned.group_paces.size(); ++g) {
    const double v = planned.group_paces[g];
    if (v <= 0) continue;
    sum += static_cast<double>(planned.round.inner_steps[g] - pacing_.step_period()) * slowest /
           (p * v);
    ++known;
  }
  return known > 0 ? sum / known : 0;
}

v1::PacingStatus PacedPlan::Status() const {
  v1::PacingStatus out;
  for (double v : pacing_.GroupPaces(pace_)) out.add_group_paces(v > 0 ? v : 0);
  const size_t shown = std::min<size_t>(rounds_.size(), 8);
  for (size_t i = rounds_.size() - shown; i < rounds_.size(); ++i) {
    *out.add_last_rounds() = ToProto(rounds_[i]);
  }
  out.set_rounds_planned(rounds_.empty() ? 0 : rounds_.back().round.round + 1);
  out.set_rounds_budget(budget_);
  if (!rounds_.empty()) out.set_idle_saved(IdleSaved(rounds_.back()));
  return out;
}

absl::Status PacedPlan::Restore(const std::vector<v1::PacedRound>& stored) {
  std::deque<PlannedRound> rounds;
  std::shared_ptr<const std::vector<double>> tokens = tokens_;
  for (const v1::PacedRound& r : stored) {
    const size_t groups = static_cast<size_t>(pacing_.num_groups());
    if (r.group_size() != pacing_.group_size() || static_cast<size_t>(r.sync_steps_size()) != groups ||
        static_cast<size_t>(r.inner_steps_size()) != groups ||
        r.tokens_per_step_size() != world_ ||
        (!rounds.empty() && r.round() != rounds.back().round.round + 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stored paced round ", r.round(), " does not fit the job (", pacing_.num_groups(),
          " groups of ", pacing_.group_size(), " ranks, rounds in order): ", r.ShortDebugString()));
    }
    PlannedRound p;
    p.round.round = r.round();
    p.round.fragment = r.fragment();
    p.round.sync_step.assign(r.sync_steps().begin(), r.sync_steps().end());
    p.round.inner_steps.assign(r.inner_steps().begin(), r.inner_steps().end());
    std::vector<double> t(r.tokens_per_step().begin(), r.tokens_per_step().end());
    if (*tokens != t) tokens = std::make_shared<const std::vector<double>>(std::move(t));
    p.tokens = tokens;
    for (double v : r.group_paces()) p.group_paces.push_back(v > 0 ? v : -1);
    rounds.push_back(std::move(p));
  }
  rounds_ = std::move(rounds);
  dropped_ = rounds_.empty() ? 0 : rounds_.front().round.round;
  tokens_ = tokens;
  return absl::OkStatus();
}

int64_t PacedPlan::DecidedThrough(int32_t rank) const {
  if (rounds_.empty()) return -1;
  const PacedRound& last = rounds_.back().round;
  if (budget_ > 0 && last.round + 1 >= budget_) return std::numeric_limits<int64_t>::max();
  return last.sync_step[pacing_.GroupOf(rank)];
}

void PacedPlan::FillRound(const PlannedRound& planned, const MemberSteps& members,
                          Decision* d) const {
  const PacedRound& r = planned.round;
  const std::vector<int32_t> ranks = d->subgroup.Ranks();
  d->members.clear();
  d->joining.clear();
  d->weights.clear();
  for (int32_t m : ranks) {
    // Each member is a member, or joins, at its own group's sync step of the round.
    const int64_t at = r.sync_step[pacing_.GroupOf(m)];
    if (!members.all_from_start) {
      const int64_t from = members.from_step[m];
      if (from == kNotMember || from > at || at >= members.until_step[m]) continue;
      if (from == at) {
        d->members.push_back(m);
        d->joining.push_back(m);
        d->weights.push_back(0.0);
        continue;
      }
    }
    d->members.push_back(m);
    d->weights.push_back(static_cast<double>(r.inner_steps[pacing_.GroupOf(m)]) *
                         (*planned.tokens)[m]);
  }
}

absl::StatusOr<Decision> PacedPlan::DecisionFor(const Schedule& schedule,
                                                const MemberSteps& members, int64_t step,
                                                int32_t rank) const {
  const int32_t g = pacing_.GroupOf(rank);
  if (rounds_.empty()) {
    return absl::FailedPreconditionError("no paced round is planned yet (PlanFor comes first)");
  }
  const int64_t first_kept = rounds_.front().round.sync_step[g];
  if (dropped_ > 0 && step <= first_kept) {
    return absl::OutOfRangeError(absl::StrCat(
        "step ", step, " of rank ", rank, " lies in paced rounds no longer kept (the oldest kept, ",
        dropped_, ", syncs this rank at step ", first_kept, "; ", kMaxKeptRounds,
        " rounds are kept)"));
  }
  // The round whose sync step of group g is `step`, if any (sync steps rise with the round).
  auto it = std::lower_bound(
      rounds_.begin(), rounds_.end(), step,
      [g](const PlannedRound& p, int64_t s) { return p.round.sync_step[g] < s; });
  if (it != rounds_.end() && it->round.sync_step[g] == step) {
    Decision d = schedule.PacedDecision(step, rank, it->round.round, it->round.fragment);
    FillRound(*it, members, &d);
    return d;
  }
  Decision d = schedule.DecisionBelowPaced(step, rank);
  if (d.average && !members.all_from_start) {
    // As ApplyMembers: the ranks of the subgroup that are members at this step.
    std::vector<int32_t> in;
    for (int32_t m : d.subgroup.Ranks()) {
      const int64_t from = members.from_step[m];
      if (from == kNotMember || from > step || step >= members.until_step[m]) continue;
      in.push_back(m);
      if (from == step) d.joining.push_back(m);
    }
    d.members = std::move(in);
  }
  return d;
}

}  // namespace modelavg::server
