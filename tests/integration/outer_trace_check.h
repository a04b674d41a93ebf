// Checks modelavg-trace-worker traces of a job whose levels may carry an outer optimizer
// (DiLoCo) against the rule alone, whatever the membership did (deaths, retried rounds,
// replacements): like trace_check.h, it needs no reference run.
//
// It rebuilds each rank's value before every call (before(s) = after(s - 1) + the worker's
// update, float32) and simulates each rank's outer state per level from the lines themselves,
// in double precision. For an AVERAGE line of rank r at level l with members M and joining J,
// the contributors C = M \ J:
//  * a plain level: the value is the mean over C of before;
//  * an outer level, r joining: r first takes, for every outer level, the simulated state of
//    the lowest member of C in r's block of that level that holds r's shard (its donor), then
//    as below;
//  * an outer level, r without an anchor: the mean over C of before; the anchor := that value;
//  * an outer level, r with an anchor A (and momentum buffer B): D = mean over C of
//    (A_m - before_m); B := D if unset, else momentum * B + D; g := D + momentum * B (nesterov)
//    or B (g := D without momentum); A := A - lr * g; the value must be A.
// The structural checks (members, joining, admission lines, step order) are trace_check.h's:
// run CheckTraces with check_values = false beside this.
#ifndef MODELAVG_TESTS_INTEGRATION_OUTER_TRACE_CHECK_H_
#define MODELAVG_TESTS_INTEGRATION_OUTER_TRACE_CHECK_H_

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/integration/trace_check.h"

namespace modelavg::testing {

struct OuterSim {
  std::optional<double> anchor;
  std::optional<double> momentum;
};

inline TraceCheckResult CheckOuterTraces(const std::vector<Trace>& traces,
                                         const v1::JobSpec& spec) {
  constexpr double kRelTol = 1e-5, kAbsTol = 1e-4;
  TraceCheckResult result;
  auto error = [&](std::string e) { result.errors.push_back(std::move(e)); };
  auto close = [&](double got, double want) {
    return std::fabs(got - want) <= std::max(kAbsTol, kRelTol * std::fabs(want));
  };
  std::map<std::pair<int32_t, int64_t>, float> before;     // (rank, step) -> value before
  std::map<int64_t, std::map<int32_t, const TraceLine*>> by_step;
  for (const Trace& t : traces) {
    if (t.lines.empty()) continue;
    const int32_t rank = t.lines[0].rank;
    float after = static_cast<float>(rank);
    for (const TraceLine& l : t.lines) {
      if (!l.admitted) before[{rank, l.step}] = after + TraceDelta(rank, l.step);
      after = static_cast<float>(l.value);
      by_step[l.step][rank] = &l;
    }
    const int64_t next = t.lines.back().step + 1;
    before[{rank, next}] = after + TraceDelta(rank, next);
  }
  // rank -> level -> simulated outer state (before the step being checked).
  std::map<int32_t, std::map<int, OuterSim>> state;
  for (const auto& [step, lines] : by_step) {
    std::map<int32_t, std::map<int, OuterSim>> next_state = state;
    for (const auto& [rank, l] : lines) {
      if (l->action != "AVERAGE") continue;
      const std::string where = absl::StrCat("rank ", rank, " step ", step);
      if (l->level < 0 || l->level >= spec.levels_size()) {
        error(absl::StrCat(where, ": level ", l->level, " is not one of the job's"));
        continue;
      }
      const v1::Level& level = spec.levels(l->level);
      if (l->outer != level.has_outer()) {
        error(absl::StrCat(where, ": \"outer\" is ", l->outer, " but level ", l->level,
                           level.has_outer() ? " has" : " has no", " outer optimizer"));
      }
      std::vector<int32_t> contributors;
      for (int32_t m : l->members) {
        if (std::find(l->joining.begin(), l->joining.end(), m) == l->joining.end()) {
          contributors.push_back(m);
        }
      }
      bool known = !contributors.empty();
      for (int32_t m : contributors) known = known && before.count({m, step}) > 0;
      if (!known) {
        error(absl::StrCat(where, ": a contributor's value before the step is unknown: ",
                           l->text));
        continue;
      }
      const double n = static_cast<double>(contributors.size());
      std::map<int, OuterSim> mine = state[rank];
      const bool joining =
          std::find(l->joining.begin(), l->joining.end(), rank) != l->joining.end();
      if (joining) {
        // Every outer level's state from the lowest contributor of this rank's block there
        // that holds its shard (sharded replicas).
        mine.clear();
        const int shards = spec.replica_size() > 1 ? spec.replica_size() : 1;
        for (int k = 0; k < spec.levels_size(); ++k) {
          if (!spec.levels(k).has_outer()) continue;
          const int g = spec.levels(k).group_size();
          for (int32_t m : contributors) {
            if (m / g == rank / g && m % shards == rank % shards) {
              mine[k] = state[m][k];
              break;
            }
          }
        }
      }
      double want = 0;
      OuterSim& s = mine[l->level];
      if (!level.has_outer() || !s.anchor.has_value()) {
        double sum = 0;
        for (int32_t m : contributors) sum += before[{m, step}];
        want = sum / n;
        if (level.has_outer()) s.anchor = want;
      } else {
        double sum = 0;
        bool ok = true;
        for (int32_t m : contributors) {
          const std::optional<double>& a = state[m][l->level].anchor;
          if (!a.has_value()) {
            error(absl::StrCat(where, ": contributor ", m, " has no anchor at level ", l->level,
                               " while rank ", rank, " has one"));
            ok = false;
            break;
          }
          sum += *a - before[{m, step}];
        }
        if (!ok) continue;
        const double d = sum / n;
        const double mu = level.outer().momentum();
        double g = d;
        if (mu != 0) {
          s.momentum = s.momentum.has_value() ? mu * *s.momentum + d : d;
          g = level.outer().nesterov() ? d + mu * *s.momentum : *s.momentum;
        }
        s.anchor = *s.anchor - level.outer().lr() * g;
        want = *s.anchor;
      }
      ++result.averages;
      if (!close(l->value, want)) {
        error(absl::StrCat(where, ": value ", l->value, " but the rule gives ", want, " (level ",
                           l->level, level.has_outer() ? ", outer" : ", plain", ", members [",
                           absl::StrJoin(l->members, ", "), "] less joining [",
                           absl::StrJoin(l->joining, ", "), "])"));
      }
      next_state[rank] = mine;
    }
    state = next_state;
  }
  return result;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_OUTER_TRACE_CHECK_H_
