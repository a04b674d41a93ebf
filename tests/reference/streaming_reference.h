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
//
//   With `model_payload` (INT8/INT4 levels of at most 1024 elements a fragment: one block) the
//   payload is restated too, from its documented encoding: per member U := beta E + D (beta the
//   level's error_feedback, E a residual per (level, tensor) starting at 0; beta 0: U = D),
//   C := q s with s = max |U| / L over the fragment and q = round-half-even(U / s) (L 127 or 7;
//   s and U / s rounded to float32 as documented), E := U - C; the group's mean of C is encoded
//   the same way again and its decoded value is the D of the outer step.
#ifndef MODELAVG_TESTS_REFERENCE_STREAMING_REFERENCE_H_
#define MODELAVG_TESTS_REFERENCE_STREAMING_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/naive_outer_sgd.h"
#include "tests/reference/naive_schedule.h"

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

// The documented INT8/INT4 round trip of one block: s = max|u| / levels, q = round-half-even(u /
// s) clamped to [-levels, levels], decoded q * s; s and u / s in float32.
inline std::vector<double> NaiveBlockRoundTrip(const std::vector<double>& u, float levels) {
  float max_abs = 0;
  for (double v : u) max_abs = std::max(max_abs, std::fabs(static_cast<float>(v)));
  const float s = max_abs / levels;
  std::vector<double> out(u.size(), 0.0);
  if (!(s > 0)) return out;
  for (size_t i = 0; i < u.size(); ++i) {
    const float ratio = static_cast<float>(u[i]) / s;
    const double q = std::max(-1.0 * levels, std::min(1.0 * levels, std::nearbyint(1.0 * ratio)));
    out[i] = q * s;
  }
  return out;
}

// A sync in flight (sync_delay > 0): per rank, per tensor of the fragment, the group's mean.
struct Pending {
  int64_t apply = 0;
  int level = 0;
  bool first = false;
  std::vector<int> tensors;
  std::vector<std::vector<double>> mean;  // [rank][i]
};

// expected[s][r], for a job whose plan changed while it ran (UpdateJob, docs/plan-updates.md):
// `plans` are (spec, switch step), version 0 first (switch step 0). At a switch step E a level
// keeps its anchors and momenta iff both plans give it an outer optimizer, the same group size
// and the same fragments; its residuals too iff its payload and density stay as well; otherwise
// they start afresh (its first sync from E on sets the anchors). The switch steps lie where no
// background sync is in flight.
inline std::vector<std::vector<StreamingStep>> StreamingReference(
    const std::vector<std::pair<v1::JobSpec, int64_t>>& plans, int64_t steps, int tensors,
    bool model_payload = false) {
  const int world = plans[0].first.world_size();
  int most_levels = 0;
  for (const auto& [p, at] : plans) most_levels = std::max(most_levels, p.levels_size());
  std::vector<std::vector<double>> x(world, std::vector<double>(tensors));
  for (int r = 0; r < world; ++r) {
    for (int t = 0; t < tensors; ++t) x[r][t] = r;
  }
  using State = std::vector<std::vector<std::vector<std::optional<double>>>>;  // [l][r][t]
  State anchor(most_levels, std::vector<std::vector<std::optional<double>>>(
                                world, std::vector<std::optional<double>>(tensors)));
  State momentum = anchor;
  // Error feedback's residual E per (level, rank, tensor).
  std::vector<std::vector<std::vector<double>>> residual(
      most_levels, std::vector<std::vector<double>>(world, std::vector<double>(tensors, 0.0)));
  std::vector<Pending> pending;
  std::vector<std::vector<StreamingStep>> out;
  size_t version = 0;
  for (int64_t s = 0; s < steps; ++s) {
    while (version + 1 < plans.size() && s >= plans[version + 1].second) {
      const v1::JobSpec& prev = plans[version].first;
      const v1::JobSpec& next = plans[version + 1].first;
      for (int l = 0; l < most_levels; ++l) {
        const bool both = l < prev.levels_size() && l < next.levels_size();
        const bool keep = both && prev.levels(l).has_outer() && next.levels(l).has_outer() &&
                          prev.levels(l).group_size() == next.levels(l).group_size() &&
                          Fragments(prev.levels(l)) == Fragments(next.levels(l));
        const bool keep_residual = keep && prev.levels(l).payload() == next.levels(l).payload() &&
                                   prev.levels(l).topk_density() == next.levels(l).topk_density();
        for (int r = 0; r < world; ++r) {
          for (int t = 0; t < tensors; ++t) {
            if (!keep) {
              anchor[l][r][t].reset();
              momentum[l][r][t].reset();
            }
            if (!keep_residual) residual[l][r][t] = 0;
          }
        }
      }
      ++version;
    }
    const v1::JobSpec& spec = plans[version].first;
    const int levels = spec.levels_size();
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
    // The modelled payload: each group's decoded mean pseudo-gradient per tensor of the
    // fragment, dbar[r][t] (the same on every member of r's group); E updated.
    std::vector<std::vector<double>> dbar(world, std::vector<double>(tensors, 0.0));
    bool modelled = false;
    if (level >= 0 && model_payload) {
      const v1::Level& l = spec.levels(level);
      const int per = tensors / Fragments(l);
      const int t0 = fragment * per;
      if (l.has_outer() && (l.payload() == v1::INT8 || l.payload() == v1::INT4) &&
          anchor[level][0][t0].has_value()) {
        modelled = true;
        const float levels_q = l.payload() == v1::INT8 ? 127.0f : 7.0f;
        const int g = l.group_size();
        for (int first = 0; first < world; first += g) {
          std::vector<double> sum(per, 0.0);
          for (int m = first; m < first + g; ++m) {
            std::vector<double> u(per);
            for (int i = 0; i < per; ++i) {
              u[i] = l.error_feedback() * residual[level][m][t0 + i] +
                     (*anchor[level][m][t0 + i] - x[m][t0 + i]);
            }
            const std::vector<double> c = NaiveBlockRoundTrip(u, levels_q);
            for (int i = 0; i < per; ++i) {
              if (l.error_feedback() != 0) residual[level][m][t0 + i] = u[i] - c[i];
              sum[i] += c[i];
            }
          }
          for (double& v : sum) v /= g;
          const std::vector<double> mean = NaiveBlockRoundTrip(sum, levels_q);
          for (int m = first; m < first + g; ++m) {
            for (int i = 0; i < per; ++i) dbar[m][t0 + i] = mean[i];
          }
        }
      }
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
          p.mean[r][t - fragment * per] = modelled ? dbar[r][t] : v;
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
        if (modelled) d = dbar[r][t];
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

inline std::vector<std::vector<StreamingStep>> StreamingReference(const v1::JobSpec& spec,
                                                                  int64_t steps, int tensors,
                                                                  bool model_payload = false) {
  return StreamingReference({{spec, 0}}, steps, tensors, model_payload);
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_STREAMING_REFERENCE_H_
