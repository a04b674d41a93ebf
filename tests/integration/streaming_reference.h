// A naive re-statement of streaming sync (docs/streaming.md) for the trace worker's synthetic
// update with --tensors=T equal tensors, kept apart from client/ and common/:
//
//   x_r,t starts at r; before the call of step s every element of tensor t gets
//   (t + 1) * (r + 1) * (s + 1) * 0.5.
//   Tensor t belongs to fragment t / (T / F) of a level of F fragments (equal tensors split in
//   equal runs). Fragment f of level l (period H) syncs at the steps with (s - origin) mod H ==
//   f * H / F (origin: warm-up in a periodic job, 0 otherwise); the walk from the last level to
//   the first takes the first level with a fragment due. Only that fragment's tensors change:
//   plain: x := mean of the group; outer, first sync of the fragment: A := mean, then
//   x := (1 - mix) A + mix x_local; later: D := mean of (A - x), SGD on A as in DiLoCo,
//   x := (1 - mix) A' + mix x_local. Anchors and momenta per (level, tensor).
//   With sync_delay tau > 0 the call at the sync step s changes nothing: the group's mean (first
//   sync) or mean of (A - x) is taken from the values at s and applied at step s + tau, after
//   that step's update and before that step's own decision, with x_local the values then.
#ifndef MODELAVG_TESTS_INTEGRATION_STREAMING_REFERENCE_H_
#define MODELAVG_TESTS_INTEGRATION_STREAMING_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"
#include "tests/integration/naive_outer_sgd.h"
#include "tests/integration/naive_schedule.h"

namespace modelavg::testing {

struct StreamingStep {
  bool average = false;
  int level = -1;
  int fragment = 0;
  std::vector<double> values;  // per tensor, after the call
  // Per tensor: the largest |A - x| over the group's members at this outer step (0 otherwise),
  // for the compressed payloads' bound.
  std::vector<double> max_delta;
};

inline int Fragments(const v1::Level& l) { return l.fragments() > 1 ? l.fragments() : 1; }

// A sync in flight (sync_delay > 0): per rank, per tensor of the fragment, the group's mean.
struct Pending {
  int64_t apply = 0;
  int level = 0;
  bool first = false;
  std::vector<int> tensors;
  std::vector<std::vector<double>> mean;  // [rank][i]
};

// expected[s][r].
inline std::vector<std::vector<StreamingStep>> StreamingReference(const v1::JobSpec& spec,
                                                                  int64_t steps, int tensors) {
  const int world = spec.world_size();
  const int levels = spec.levels_size();
  std::vector<std::vector<double>> x(world, std::vector<double>(tensors));
  for (int r = 0; r < world; ++r) {
    for (int t = 0; t < tensors; ++t) x[r][t] = r;
  }
  using State = std::vector<std::vector<std::vector<std::optional<double>>>>;  // [l][r][t]
  State anchor(levels, std::vector<std::vector<std::optional<double>>>(
                           world, std::vector<std::optional<double>>(tensors)));
  State momentum = anchor;
  std::vector<Pending> pending;
  std::vector<std::vector<StreamingStep>> out;
  for (int64_t s = 0; s < steps; ++s) {
    for (int r = 0; r < world; ++r) {
      for (int t = 0; t < tensors; ++t) x[r][t] += (t + 1) * (r + 1) * (s + 1) * 0.5;
    }
    // The decision (the same for every rank but the group).
    int level = -1, fragment = 0;
    if (s >= spec.warmup_steps()) {
      const int64_t from = spec.mode() == v1::PERIODIC ? s - spec.warmup_steps() : s;
      for (int i = levels - 1; i >= 0 && level < 0; --i) {
        const int64_t h = spec.levels(i).period();
        const int f_count = Fragments(spec.levels(i));
        for (int f = 0; f < f_count; ++f) {
          if (from % h == f * (h / f_count)) {
            level = i;
            fragment = f;
            break;
          }
        }
      }
    }
    // Due background syncs first (their means were taken at their sync step).
    for (size_t k = 0; k < pending.size();) {
      if (pending[k].apply != s) {
        ++k;
        continue;
      }
      const Pending& p = pending[k];
      const v1::Level& l = spec.levels(p.level);
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < p.tensors.size(); ++i) {
          const int t = p.tensors[i];
          double a;
          if (p.first) {
            a = p.mean[r][i];
          } else {
            a = NaiveOuterSgd(l.outer(), p.mean[r][i], &momentum[p.level][r][t],
                              *anchor[p.level][r][t]);
          }
          anchor[p.level][r][t] = a;
          x[r][t] = (1 - l.mix()) * a + l.mix() * x[r][t];
        }
      }
      pending.erase(pending.begin() + k);
    }
    std::vector<std::vector<double>> next = x;
    State next_anchor = anchor, next_momentum = momentum;
    std::vector<StreamingStep> row(world);
    for (int r = 0; r < world; ++r) {
      row[r].average = level >= 0;
      row[r].level = level;
      row[r].fragment = fragment;
      row[r].max_delta.assign(tensors, 0.0);
      if (level < 0) continue;
      const v1::Level& l = spec.levels(level);
      const std::vector<int> group =
          NaiveGroup(spec, spec.world_size() == l.group_size() ? world : l.group_size(), r);
      const double g = static_cast<double>(group.size());
      const int per = tensors / Fragments(l);
      for (int t = fragment * per; t < (fragment + 1) * per; ++t) {
        double mean = 0;
        for (int m : group) mean += x[m][t] / g;
        if (!l.has_outer()) {
          next[r][t] = mean;
          continue;
        }
        const double mix = l.mix();
        if (l.sync_delay() > 0) {
          // Started now, applied at s + tau: record this member's view of the group's mean.
          if (t == fragment * per) {
            if (r == 0) {
              Pending p;
              p.apply = s + l.sync_delay();
              p.level = level;
              p.first = !anchor[level][0][t].has_value();
              for (int u = fragment * per; u < (fragment + 1) * per; ++u) p.tensors.push_back(u);
              p.mean.assign(world, std::vector<double>(per));
              pending.push_back(p);
            }
          }
          Pending& p = pending.back();
          double v = 0;
          for (int m : group) {
            v += (p.first ? x[m][t] : *anchor[level][m][t] - x[m][t]) / g;
            if (!p.first) {
              row[r].max_delta[t] =
                  std::max(row[r].max_delta[t], std::fabs(*anchor[level][m][t] - x[m][t]));
            }
          }
          p.mean[r][t - fragment * per] = v;
          continue;
        }
        if (!anchor[level][r][t].has_value()) {
          next_anchor[level][r][t] = mean;
          next[r][t] = (1 - mix) * mean + mix * x[r][t];
          continue;
        }
        double d = 0, max_delta = 0;
        for (int m : group) {
          d += (*anchor[level][m][t] - x[m][t]) / g;
          max_delta = std::max(max_delta, std::fabs(*anchor[level][m][t] - x[m][t]));
        }
        row[r].max_delta[t] = max_delta;
        std::optional<double> m = momentum[level][r][t];
        const double a = NaiveOuterSgd(l.outer(), d, &m, *anchor[level][r][t]);
        next_momentum[level][r][t] = m;
        next_anchor[level][r][t] = a;
        next[r][t] = (1 - mix) * a + mix * x[r][t];
      }
    }
    x = next;
    anchor = next_anchor;
    momentum = next_momentum;
    for (int r = 0; r < world; ++r) row[r].values = x[r];
    out.push_back(row);
  }
  return out;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_STREAMING_REFERENCE_H_
