// A naive re-statement of a paced level's plan (docs/paced.md), kept apart from server/ so that
// the tests compare server/pacing/pacing.h with an independent reading of the rule:
//
//   Two ranks are in one group iff a chain of "same replica" (r / replica_size equal) and "same
//   group of a lower level" (r / group_size_l equal, l below the paced level) links them.
//   A group's pace is its slowest member's among those whose pace is known (> 0 and finite).
//   Round 0: every group syncs at the first step s >= warm-up the level averages at (PERIODIC:
//   warm-up itself; HIERARCHICAL: the first multiple of p = period / fragments), and took s + 1
//   steps.
//   Round r >= 1: with T = p / v the time the slowest known group (pace v) needs for p steps,
//   a group of known pace v_g takes the most steps n, p <= n <= 16 p, that it can finish within
//   T (n / v_g <= T, with a slack of a millionth of a step); a group of unknown pace, or every
//   group when no pace is known, takes p. Its sync step moves on by n.
//   The fragment of round r is (the schedule's fragment at round 0's step + r) mod fragments.
#ifndef MODELAVG_TESTS_REFERENCE_PACED_REFERENCE_H_
#define MODELAVG_TESTS_REFERENCE_PACED_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace modelavg::testing {

struct NaivePacedLevel {
  int32_t world_size = 0;
  int32_t replica_size = 1;
  // The group sizes of the levels below the paced one.
  std::vector<int32_t> lower_group_sizes;
  int64_t period = 0;
  int32_t fragments = 1;
  int64_t warmup_steps = 0;
  bool periodic = false;
};

struct NaivePacedRound {
  int64_t round = 0;
  int32_t fragment = 0;
  std::vector<int64_t> sync_step;    // per group, groups in order of their lowest rank
  std::vector<int64_t> inner_steps;  // per group
};

// The group of each rank, numbered in order of each group's lowest rank.
inline std::vector<int32_t> NaivePacedGroups(const NaivePacedLevel& l) {
  std::vector<int32_t> parent(l.world_size);
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](int32_t r) {
    while (parent[r] != r) r = parent[r];
    return r;
  };
  auto link = [&](int32_t a, int32_t b) {
    a = find(a);
    b = find(b);
    if (a != b) parent[std::max(a, b)] = std::min(a, b);
  };
  for (int32_t a = 0; a < l.world_size; ++a) {
    for (int32_t b = a + 1; b < l.world_size; ++b) {
      bool same = a / l.replica_size == b / l.replica_size;
      for (int32_t g : l.lower_group_sizes) same = same || a / g == b / g;
      if (same) link(a, b);
    }
  }
  std::vector<int32_t> group(l.world_size, -1);
  int32_t next = 0;
  std::vector<int32_t> number(l.world_size, -1);
  for (int32_t r = 0; r < l.world_size; ++r) {
    const int32_t root = find(r);
    if (number[root] < 0) number[root] = next++;
    group[r] = number[root];
  }
  return group;
}

inline bool NaiveKnown(double pace) { return pace > 0 && pace < INFINITY; }

// Each group's pace from the ranks' paces.
inline std::vector<double> NaiveGroupPaces(const NaivePacedLevel& l,
                                           const std::vector<double>& rank_pace) {
  const std::vector<int32_t> group = NaivePacedGroups(l);
  int32_t groups = 0;
  for (int32_t g : group) groups = std::max(groups, g + 1);
  std::vector<double> out(groups, -1.0);
  for (int32_t r = 0; r < l.world_size; ++r) {
    if (!NaiveKnown(rank_pace[r])) continue;
    if (!NaiveKnown(out[group[r]]) || rank_pace[r] < out[group[r]]) out[group[r]] = rank_pace[r];
  }
  return out;
}

inline NaivePacedRound NaivePacedFirst(const NaivePacedLevel& l, int32_t groups) {
  const int64_t p = l.period / l.fragments;
  int64_t s = l.warmup_steps;
  if (!l.periodic) {
    while (s % p != 0) ++s;
  }
  // The schedule's fragment at s: (s / p) mod F, s counted from warm-up when periodic.
  const int64_t from = l.periodic ? s - l.warmup_steps : s;
  NaivePacedRound out;
  out.round = 0;
  out.fragment = static_cast<int32_t>((from / p) % l.fragments);
  out.sync_step.assign(groups, s);
  out.inner_steps.assign(groups, s + 1);
  return out;
}

inline NaivePacedRound NaivePacedNext(const NaivePacedLevel& l, const NaivePacedRound& prev,
                                      const std::vector<double>& group_pace) {
  const int64_t p = l.period / l.fragments;
  double slowest = -1;
  for (double v : group_pace) {
    if (NaiveKnown(v) && (!NaiveKnown(slowest) || v < slowest)) slowest = v;
  }
  NaivePacedRound out;
  out.round = prev.round + 1;
  out.fragment = (prev.fragment + 1) % l.fragments;
  for (size_t g = 0; g < group_pace.size(); ++g) {
    int64_t n = p;
    if (NaiveKnown(group_pace[g]) && NaiveKnown(slowest)) {
      // The slowest group's time for p steps, in units of this group's steps.
      const double budget = static_cast<double>(p) * group_pace[g] / slowest + 1e-6;
      // One step at a time: the tests keep p small.
      while (n + 1 <= 16 * p && static_cast<double>(n + 1) <= budget) ++n;
    }
    out.sync_step.push_back(prev.sync_step[g] + n);
    out.inner_steps.push_back(n);
  }
  return out;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_REFERENCE_PACED_REFERENCE_H_
