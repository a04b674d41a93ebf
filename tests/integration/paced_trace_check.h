// Checks modelavg-trace-worker traces of a paced job (docs/paced.md) against the rule restated
// naively, every rank, every round: it reads the decisions each member actually received (its
// lines) and recomputes what each round must give, without the coordinator's plan.
//
// From each rank's own lines it rebuilds its value before every call (float32, as trace_check.h:
// before(s) = after(s - 1) + (rank + 1) * (s + 1) * 0.5, after(-1) = rank) and, per round r of
// the paced level, its sync step s_i(r): the step of its line with "round": r. Then:
//  * every rank printed each round 0 .. rounds - 1 once, at rising steps, and stopped right
//    after round rounds - 1 (its last line) when `rounds` is set;
//  * the ranks of one paced group (group_size consecutive ranks) synced each round at the same
//    step;
//  * each member's printed weight is n_i(r) x T_i, with n_i(r) = s_i(r) - s_i(r - 1)
//    (s_i(-1) = -1) and T_i its tokens per step;
//  * every member of a round lists the same members, and each one's value after it is, with w_j
//    those weights and x_j the members' values before their own sync steps:
//      plain level:  sum_j w_j x_j / sum_j w_j;
//      outer level (lr, momentum, nesterov; FP32): round 0 as plain (the anchors A := that);
//      then D = sum_j w_j (A - x_j) / sum_j w_j, B := D (first) or momentum * B + D,
//      g = D + momentum * B (nesterov) or B (or D without momentum), A := A - lr * g, value A.
//  * a lower level's AVERAGE (no round) is the plain mean of its members' values before that
//    step (they share their steps); a SKIP keeps the value.
// Values within relative 1e-5 (absolute 1e-4), the conformance tests' tolerance.
#ifndef MODELAVG_TESTS_INTEGRATION_PACED_TRACE_CHECK_H_
#define MODELAVG_TESTS_INTEGRATION_PACED_TRACE_CHECK_H_

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {

struct PacedCheck {
  // Tokens per step of each rank (empty: 1 each).
  std::vector<double> tokens;
  // Ranks synced together (the paced level's group: lcm of replica_size and the lower levels'
  // group sizes).
  int32_t group_size = 1;
  // The rounds each rank must print (0: not checked).
  int64_t rounds = 0;
  // The paced level's outer optimizer (FP32 payload), when it has one.
  bool outer = false;
  double lr = 1.0;
  double momentum = 0.0;
  bool nesterov = false;
  // false: the structure only (rounds, weights, groups' steps), not the values (a streaming
  // level, whose fragments hold the trace worker's tensors apart).
  bool check_values = true;
  // An elastic job: members die and are replaced (the rounds each process printed are checked,
  // not that every rank printed every round).
  bool elastic = false;
};

// What the check saw, for the test's own assertions on the pacing.
struct PacedRounds {
  // sync[i][r]: rank i's sync step of round r (-1 when not printed).
  std::vector<std::vector<int64_t>> sync;
  // arrive_ms[i][r], leave_ms[i][r]: when rank i's call of round r started (the return of its
  // previous call plus its step delay, given to the check) and returned; -1 without unix_ms.
  std::vector<std::vector<double>> arrive_ms;
  std::vector<std::vector<double>> leave_ms;
};

inline TraceCheckResult CheckPacedTraces(const std::vector<Trace>& traces, const PacedCheck& c,
                                         const std::vector<double>& step_delay_ms = {},
                                         PacedRounds* seen = nullptr) {
  constexpr double kRelTol = 1e-5, kAbsTol = 1e-4;
  TraceCheckResult result;
  auto error = [&](std::string e) { result.errors.push_back(std::move(e)); };
  auto close = [&](double got, double want) {
    return std::fabs(got - want) <= std::max(kAbsTol, kRelTol * std::fabs(want));
  };
  // Ranks by their lines (an elastic job's replacement is a process of its own for its rank).
  int32_t world = 0;
  for (const Trace& t : traces) {
    for (const TraceLine& l : t.lines) world = std::max(world, l.rank + 1);
  }
  auto tokens = [&](int32_t r) {
    return r < static_cast<int32_t>(c.tokens.size()) ? c.tokens[r] : 1.0;
  };
  std::vector<std::map<int64_t, float>> before(world);
  std::vector<std::map<int64_t, const TraceLine*>> at(world);
  // round -> rank -> line
  std::map<int64_t, std::map<int32_t, const TraceLine*>> rounds;
  PacedRounds local;
  PacedRounds& out = seen != nullptr ? *seen : local;
  out.sync.assign(world, {});
  out.arrive_ms.assign(world, {});
  out.leave_ms.assign(world, {});
  for (const Trace& t : traces) {
    if (t.lines.empty()) continue;
    const int32_t i = t.lines[0].rank;
    // A replacement starts at its admission line, with the value it received there.
    float after = static_cast<float>(i);
    int64_t last_round = -1, expect_step = t.lines[0].admitted ? t.lines[0].step : 0;
    double prev_ms = -1;
    for (const TraceLine& l : t.lines) {
      if (l.rank != i || l.step != expect_step) {
        error(absl::StrCat(t.who, ": line of rank ", l.rank, " step ", l.step, " where rank ", i,
                           " step ", expect_step, " was expected"));
        break;
      }
      ++expect_step;
      if (!l.admitted) before[i][l.step] = after + TraceDelta(i, l.step);
      after = static_cast<float>(l.value);
      at[i][l.step] = &l;
      if (l.round >= 0) {
        if (last_round >= 0 && l.round <= last_round) {
          error(absl::StrCat(t.who, ": round ", l.round, " at step ", l.step, " follows round ",
                             last_round));
        }
        if (last_round < 0 && !l.admitted && l.round != 0) {
          error(absl::StrCat(t.who, ": its first round is ", l.round));
        }
        last_round = l.round;
        rounds[l.round][i] = &l;
        out.sync[i].resize(std::max<size_t>(out.sync[i].size(), l.round + 1), -1);
        out.arrive_ms[i].resize(out.sync[i].size(), -1);
        out.leave_ms[i].resize(out.sync[i].size(), -1);
        out.sync[i][l.round] = l.step;
        if (l.unix_ms >= 0) {
          out.leave_ms[i][l.round] = static_cast<double>(l.unix_ms);
          const double delay =
              i < static_cast<int32_t>(step_delay_ms.size()) ? step_delay_ms[i] : 0;
          if (prev_ms >= 0) out.arrive_ms[i][l.round] = prev_ms + delay;
        }
      }
      prev_ms = static_cast<double>(l.unix_ms);
    }
    if (c.rounds > 0 && !c.elastic) {
      if (last_round != c.rounds - 1) {
        error(absl::StrCat(t.who, ": its last round is ", last_round, ", not ", c.rounds - 1));
      } else if (!t.lines.empty() && t.lines.back().round != c.rounds - 1) {
        error(absl::StrCat(t.who, ": it went on to step ", t.lines.back().step,
                           " after its last round"));
      }
    }
  }
  std::optional<double> anchor, buffer;
  for (const auto& [r, lines] : rounds) {
    // The members every rank of the round lists; the first line's as the reference.
    const TraceLine* first = lines.begin()->second;
    if (static_cast<int32_t>(lines.size()) != static_cast<int32_t>(first->members.size())) {
      error(absl::StrCat("round ", r, ": ", lines.size(), " ranks printed it, members ",
                         absl::StrJoin(first->members, ",")));
    }
    double sum_w = 0, sum_wx = 0, sum_wd = 0;
    std::map<int32_t, double> weight;
    bool complete = true;
    for (int32_t j : first->members) {
      auto it = lines.find(j);
      if (it == lines.end() || j >= world) {
        error(absl::StrCat("round ", r, ": member ", j, " printed no line of it"));
        complete = false;
        continue;
      }
      const int64_t s = it->second->step;
      const bool joining = std::find(first->joining.begin(), first->joining.end(), j) !=
                           first->joining.end();
      // Its previous round: the last one it printed before this (a replacement's admission
      // round, or, after a round it missed while retried without it, the one before).
      int64_t prev = -1;
      for (int64_t q = r - 1; q >= 0; --q) {
        if (static_cast<size_t>(q) < out.sync[j].size() && out.sync[j][q] >= 0) {
          prev = out.sync[j][q];
          break;
        }
      }
      const double w = joining ? 0.0 : static_cast<double>(s - prev) * tokens(j);
      weight[j] = w;
      if (it->second->weight != w) {
        error(absl::StrCat("round ", r, ": rank ", j, " printed weight ", it->second->weight,
                           ", the rule's is (", s, " - ", prev, ") x ", tokens(j), " = ", w));
      }
      // Its group's ranks synced at the same step.
      const int32_t lead = j / c.group_size * c.group_size;
      auto mate = lines.find(lead);
      if (mate != lines.end() && mate->second->step != s) {
        error(absl::StrCat("round ", r, ": rank ", j, " synced at step ", s, " but rank ", lead,
                           " of its group at step ", mate->second->step));
      }
      if (joining) continue;
      const double x = before[j][s];
      sum_w += w;
      sum_wx += w * x;
      if (anchor) sum_wd += w * (*anchor - x);
    }
    if (!complete || sum_w <= 0) continue;
    double want;
    if (!c.outer || !anchor) {
      want = sum_wx / sum_w;
      if (c.outer) anchor = want;
    } else {
      const double d = sum_wd / sum_w;
      double g = d;
      if (c.momentum != 0) {
        buffer = buffer ? c.momentum * *buffer + d : d;
        g = c.nesterov ? d + c.momentum * *buffer : *buffer;
      }
      anchor = *anchor - c.lr * g;
      want = *anchor;
    }
    for (const auto& [j, line] : lines) {
      ++result.averages;
      if (line->members != first->members) {
        error(absl::StrCat("round ", r, ": rank ", j, " lists members ",
                           absl::StrJoin(line->members, ","), ", rank ", first->rank, " lists ",
                           absl::StrJoin(first->members, ",")));
      }
      if (c.check_values && !close(line->value, want)) {
        error(absl::StrCat("round ", r, ": rank ", j, " (step ", line->step, ") has ",
                           line->value, ", the weighted rule gives ", want));
      }
    }
  }
  // The lower levels and the skips.
  for (int32_t i = 0; i < world && c.check_values; ++i) {
    for (const auto& [s, l] : at[i]) {
      if (l->round >= 0) continue;
      if (l->action == "SKIP") {
        ++result.skips;
        if (!close(l->value, before[i][s])) {
          error(absl::StrCat("rank ", i, " step ", s, ": SKIP changed the value"));
        }
        continue;
      }
      double sum = 0;
      int n = 0;
      for (int32_t m : l->members) {
        auto b = m < world ? before[m].find(s) : before[0].end();
        if (m >= world || b == before[m].end()) {
          error(absl::StrCat("rank ", i, " step ", s, ": member ", m, " has no value there"));
          continue;
        }
        sum += b->second;
        ++n;
      }
      ++result.averages;
      if (n > 0 && !close(l->value, sum / n)) {
        error(absl::StrCat("rank ", i, " step ", s, " (level ", l->level, "): ", l->value,
                           ", the mean of members ", absl::StrJoin(l->members, ","), " is ",
                           sum / n));
      }
    }
  }
  return result;
}

// Where the rounds a coordinator keeps (GetJob's pacing.last_rounds) disagree with the rounds the
// members ran (`seen`, from CheckPacedTraces; the groups are group_size consecutive ranks): a
// round whose group sync step is not the step its members synced at, or a round a member ran
// that the coordinator does not list (from the first round it lists on). After a coordinator
// restart or a fail-over, a round handed out by the previous coordinator and planned anew
// differently by the next one shows here. Empty when they agree.
inline std::vector<std::string> PacingDisagreements(const v1::PacingStatus& pacing,
                                                    const PacedRounds& seen,
                                                    int32_t group_size = 1) {
  std::vector<std::string> errors;
  if (pacing.last_rounds().empty()) return {"GetJob's pacing lists no round"};
  const int64_t first = pacing.last_rounds(0).round();
  std::map<int64_t, const v1::PacedRound*> kept;
  for (const v1::PacedRound& r : pacing.last_rounds()) kept[r.round()] = &r;
  for (size_t i = 0; i < seen.sync.size(); ++i) {
    for (size_t r = static_cast<size_t>(std::max<int64_t>(first, 0)); r < seen.sync[i].size();
         ++r) {
      if (seen.sync[i][r] < 0) continue;
      auto it = kept.find(static_cast<int64_t>(r));
      if (it == kept.end()) {
        errors.push_back(absl::StrCat("rank ", i, " ran round ", r, " at step ", seen.sync[i][r],
                                      "; the coordinator lists rounds ", first, "..",
                                      pacing.last_rounds().rbegin()->round()));
        continue;
      }
      const int32_t g = static_cast<int32_t>(i) / group_size;
      if (g >= it->second->sync_steps_size() || it->second->sync_steps(g) != seen.sync[i][r]) {
        errors.push_back(absl::StrCat("round ", r, ": rank ", i, " synced at step ",
                                      seen.sync[i][r], ", the coordinator's round says ",
                                      it->second->ShortDebugString()));
      }
    }
  }
  return errors;
}

// The rounds of `before` (GetJob's pacing, read from a coordinator just before it was killed)
// that `after` (the pacing of the coordinator that took over: restarted, or a standby) lost or
// plans differently, a line each: the members may hold any round planned before the kill, so
// each must come back as it was. Empty when every one did.
inline std::vector<std::string> RoundsLostOrChanged(const v1::PacingStatus& before,
                                                    const v1::PacingStatus& after) {
  std::vector<std::string> errors;
  for (const v1::PacedRound& want : before.last_rounds()) {
    auto got = std::find_if(after.last_rounds().begin(), after.last_rounds().end(),
                            [&](const v1::PacedRound& r) { return r.round() == want.round(); });
    if (got == after.last_rounds().end()) {
      errors.push_back(absl::StrCat("round ", want.round(), " planned before the kill is lost: ",
                                    after.ShortDebugString()));
    } else if (got->ShortDebugString() != want.ShortDebugString()) {
      errors.push_back(absl::StrCat("round ", want.round(), " was ", want.ShortDebugString(),
                                    " before the kill, ", got->ShortDebugString(), " after"));
    }
  }
  return errors;
}

// A finished paced job of one-rank groups, whole: each rank's output `outs[r]` parsed and
// checked against the rule (CheckPacedTraces) for `rounds` rounds, every rank in every round,
// and the coordinator's `pacing` (GetJob's, at the end) listing exactly those rounds at the steps
// the members synced at (PacingDisagreements). The problems, a line each; empty when none.
inline std::vector<std::string> PacedJobProblems(const std::vector<std::string>& outs,
                                                 int64_t rounds,
                                                 const std::vector<double>& delay_ms,
                                                 const v1::PacingStatus& pacing) {
  std::vector<Trace> traces;
  for (size_t r = 0; r < outs.size(); ++r) {
    absl::StatusOr<Trace> t = ParseTrace(absl::StrCat("rank ", r), outs[r]);
    if (!t.ok()) return {t.status().ToString()};
    traces.push_back(*std::move(t));
  }
  PacedCheck check;
  check.rounds = rounds;
  PacedRounds seen;
  const TraceCheckResult result = CheckPacedTraces(traces, check, delay_ms, &seen);
  std::vector<std::string> errors;
  if (!result.ok()) errors.push_back(result.Report());
  if (result.averages < rounds * static_cast<int64_t>(outs.size())) {
    errors.push_back(absl::StrCat(result.averages, " paced averages checked, want at least ",
                                  rounds, " rounds x ", outs.size(), " ranks"));
  }
  if (pacing.rounds_planned() != rounds || pacing.last_rounds_size() != rounds) {
    errors.push_back(absl::StrCat("GetJob's pacing has ", pacing.rounds_planned(),
                                  " rounds planned and lists ", pacing.last_rounds_size(),
                                  "; the job ran ", rounds, ": ", pacing.ShortDebugString()));
  }
  for (std::string& e : PacingDisagreements(pacing, seen)) errors.push_back(std::move(e));
  return errors;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_PACED_TRACE_CHECK_H_
