// Checks the JSON lines of modelavg-trace-worker processes (tools/trace_worker.cc) against
// the averaging rule alone, whatever the membership did: it needs no reference run, so it holds
// for jobs whose members die, stall and are replaced at moments the test does not control.
//
// From each process's lines it rebuilds that rank's value before every call, exactly as the
// worker computes it in float32: before(s) = after(s - 1) + (rank + 1) * (s + 1) * 0.5, with
// after(-1) = rank, and for a replacement from its admission line on (the value it received).
// Then, for every line:
//  * AVERAGE: the rank is among the members; the joining ranks are members too; the value is the
//    mean, over the members that are not joining, of their before values at that step (relative
//    tolerance 1e-5, absolute 1e-4, as the conformance tests); every member that printed that
//    step printed the same members, joining ranks and level; with the job's group sizes, the
//    members lie in one block of that level;
//  * SKIP: the value is the before value, no members;
//  * lines of one step agree on the action and the level (the schedule's decision is global);
//  * an "admitted" line is the first of its process, at a step > 0, an AVERAGE that lists its
//    rank as joining; a rank listed as joining printed (if it printed that step) an admitted line;
//  * each process prints consecutive steps of one rank, from 0 (or its admission step).
// CheckTracesFollowRule adds, for every line, the decision of the rule restated naively
// (naive_schedule.h, sharded replicas included): the action, the level, and the members (exactly
// the rule's group in a job that kept every rank, a subset of it otherwise).
#ifndef MODELAVG_TESTS_INTEGRATION_TRACE_CHECK_H_
#define MODELAVG_TESTS_INTEGRATION_TRACE_CHECK_H_

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "modelavg/v1/coordinator.pb.h"
#include "tests/reference/naive_schedule.h"

namespace modelavg::testing {

// One line of modelavg-trace-worker's output.
struct TraceLine {
  int64_t step = -1;
  int32_t rank = -1;
  double value = 0;
  std::string action;  // "AVERAGE" or "SKIP"
  int32_t level = -1;
  int64_t generation = -1;
  std::vector<int32_t> members;
  std::vector<int32_t> joining;
  bool admitted = false;
  bool outer = false;  // "outer" (AVERAGE lines of a level with an outer optimizer)
  int64_t unix_ms = -1;  // -1: the worker ran without --unix_ms
  std::string text;      // the line as printed
  int32_t fragment = 0;  // "fragment" (streaming levels; 0 when absent)
  int32_t plan = 0;      // "plan" (after a plan update; 0 when absent)
  std::vector<double> values;  // "values": one per tensor (--tensors=T); empty when absent
  int64_t round = -1;          // "round": a paced level's round (-1 when absent)
  double weight = -1;          // "weight": this member's weight in that round (-1 when absent)
};

// The lines of one worker process.
struct Trace {
  std::string who;  // names the process in messages, e.g. "rank 5 (replacement)"
  std::vector<TraceLine> lines;
};

inline absl::StatusOr<TraceLine> ParseTraceLine(const std::string& text) {
  google::protobuf::Struct obj;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text, &obj);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not JSON: ", text));
  }
  const auto& f = obj.fields();
  auto number = [&](const char* key, bool required, double* out) -> absl::Status {
    auto it = f.find(key);
    if (it == f.end()) {
      return required ? absl::InvalidArgumentError(absl::StrCat("no \"", key, "\": ", text))
                      : absl::OkStatus();
    }
    if (it->second.kind_case() != google::protobuf::Value::kNumberValue) {
      return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" is not a number: ", text));
    }
    *out = it->second.number_value();
    return absl::OkStatus();
  };
  auto ranks = [&](const char* key, std::vector<int32_t>* out) -> absl::Status {
    auto it = f.find(key);
    if (it == f.end() || it->second.kind_case() != google::protobuf::Value::kListValue) {
      return absl::InvalidArgumentError(absl::StrCat("no \"", key, "\" list: ", text));
    }
    for (const auto& v : it->second.list_value().values()) {
      if (v.kind_case() != google::protobuf::Value::kNumberValue) {
        return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" holds a non-number: ", text));
      }
      out->push_back(static_cast<int32_t>(v.number_value()));
    }
    return absl::OkStatus();
  };
  TraceLine line;
  line.text = text;
  double step = 0, rank = 0, level = 0, generation = 0, unix_ms = -1;
  for (absl::Status s : {number("step", true, &step), number("rank", true, &rank),
                         number("value", true, &line.value), number("level", true, &level),
                         number("generation", true, &generation),
                         number("unix_ms", false, &unix_ms), ranks("members", &line.members),
                         ranks("joining", &line.joining)}) {
    if (!s.ok()) return s;
  }
  line.step = static_cast<int64_t>(step);
  line.rank = static_cast<int32_t>(rank);
  line.level = static_cast<int32_t>(level);
  line.generation = static_cast<int64_t>(generation);
  line.unix_ms = static_cast<int64_t>(unix_ms);
  auto action = f.find("action");
  if (action == f.end() || (action->second.string_value() != "AVERAGE" &&
                            action->second.string_value() != "SKIP")) {
    return absl::InvalidArgumentError(absl::StrCat("no \"action\" AVERAGE or SKIP: ", text));
  }
  line.action = action->second.string_value();
  if (auto outer = f.find("outer"); outer != f.end()) {
    if (outer->second.kind_case() != google::protobuf::Value::kBoolValue) {
      return absl::InvalidArgumentError(absl::StrCat("\"outer\" is not a bool: ", text));
    }
    line.outer = outer->second.bool_value();
  }
  double fragment = 0;
  if (absl::Status s = number("fragment", false, &fragment); !s.ok()) return s;
  line.fragment = static_cast<int32_t>(fragment);
  double plan = 0;
  if (absl::Status s = number("plan", false, &plan); !s.ok()) return s;
  line.plan = static_cast<int32_t>(plan);
  double round = -1;
  if (absl::Status s = number("round", false, &round); !s.ok()) return s;
  line.round = static_cast<int64_t>(round);
  if (absl::Status s = number("weight", false, &line.weight); !s.ok()) return s;
  if (auto values = f.find("values"); values != f.end()) {
    if (values->second.kind_case() != google::protobuf::Value::kListValue) {
      return absl::InvalidArgumentError(absl::StrCat("\"values\" is not a list: ", text));
    }
    for (const auto& v : values->second.list_value().values()) {
      if (v.kind_case() != google::protobuf::Value::kNumberValue) {
        return absl::InvalidArgumentError(absl::StrCat("\"values\" holds a non-number: ", text));
      }
      line.values.push_back(v.number_value());
    }
  }
  auto admitted = f.find("admitted");
  if (admitted != f.end()) {
    if (admitted->second.kind_case() != google::protobuf::Value::kBoolValue) {
      return absl::InvalidArgumentError(absl::StrCat("\"admitted\" is not a bool: ", text));
    }
    line.admitted = admitted->second.bool_value();
  }
  return line;
}

// Parses a worker's whole stdout. A last line without its '\n' (the process was killed while
// printing it) is left out.
inline absl::StatusOr<Trace> ParseTrace(const std::string& who, const std::string& out) {
  Trace trace;
  trace.who = who;
  std::vector<std::string> lines = absl::StrSplit(out, '\n');
  lines.pop_back();  // "" after the last '\n', or an unfinished line
  for (const std::string& text : lines) {
    if (text.empty()) continue;
    absl::StatusOr<TraceLine> line = ParseTraceLine(text);
    if (!line.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": ", line.status().message()));
    }
    trace.lines.push_back(*std::move(line));
  }
  return trace;
}

struct TraceCheckResult {
  std::vector<std::string> errors;
  int64_t averages = 0;    // AVERAGE lines checked
  int64_t skips = 0;       // SKIP lines checked
  int64_t admissions = 0;  // admitted lines checked
  bool ok() const { return errors.empty(); }
  // The first errors, one a line.
  std::string Report(size_t max = 30) const {
    std::vector<std::string> first(errors.begin(),
                                   errors.begin() + std::min(max, errors.size()));
    return absl::StrCat(errors.size(), " error(s):\n  ", absl::StrJoin(first, "\n  "));
  }
};

// The worker's update, in its arithmetic.
inline float TraceDelta(int32_t rank, int64_t step) {
  return static_cast<float>((rank + 1) * (step + 1)) * 0.5f;
}

// `group_sizes[level]`: the job's group size of each level (empty: not checked).
// `check_values` false: only the structure (a job with outer levels: outer_trace_check.h
// checks the values).
inline TraceCheckResult CheckTraces(const std::vector<Trace>& traces,
                                    const std::vector<int32_t>& group_sizes = {},
                                    bool check_values = true) {
  constexpr double kRelTol = 1e-5, kAbsTol = 1e-4;
  TraceCheckResult result;
  auto error = [&](std::string e) { result.errors.push_back(std::move(e)); };
  auto close = [&](double got, double want) {
    return std::fabs(got - want) <= std::max(kAbsTol, kRelTol * std::fabs(want));
  };
  // (rank, step) -> value before the call, and who it comes from.
  std::map<std::pair<int32_t, int64_t>, std::pair<float, std::string>> before;
  // step -> rank -> line (one per (step, rank); a second is an error).
  std::map<int64_t, std::map<int32_t, const TraceLine*>> by_step;
  auto set_before = [&](int32_t rank, int64_t step, float v, const std::string& who) {
    auto [it, inserted] = before.try_emplace({rank, step}, v, who);
    if (!inserted && it->second.first != v) {
      error(absl::StrCat("rank ", rank, " step ", step, ": ", it->second.second, " and ", who,
                         " imply different values before the call (", it->second.first,
                         " and ", v, ")"));
    }
  };

  for (const Trace& t : traces) {
    if (t.lines.empty()) continue;
    const int32_t rank = t.lines[0].rank;
    float after = static_cast<float>(rank);  // after(-1)
    for (size_t i = 0; i < t.lines.size(); ++i) {
      const TraceLine& l = t.lines[i];
      const std::string where = absl::StrCat(t.who, " step ", l.step);
      if (l.rank != rank) {
        error(absl::StrCat(where, ": printed rank ", l.rank, " after rank ", rank));
        break;
      }
      const int64_t want_step = i == 0 ? (l.admitted ? l.step : 0) : t.lines[i - 1].step + 1;
      if (l.step != want_step) {
        error(absl::StrCat(t.who, ": step ", l.step, " follows step ",
                           i == 0 ? std::string("(none)") : absl::StrCat(t.lines[i - 1].step),
                           "; expected step ", want_step));
        break;
      }
      if (l.admitted) {
        ++result.admissions;
        if (i != 0 || l.step <= 0) {
          error(absl::StrCat(where, ": \"admitted\" on a line that is not the first of a "
                                    "replacement (admission steps are > 0)"));
        }
        if (l.action != "AVERAGE" ||
            std::find(l.joining.begin(), l.joining.end(), rank) == l.joining.end()) {
          error(absl::StrCat(where, ": the admission line must be an AVERAGE that lists rank ",
                             rank, " as joining: ", l.text));
        }
      } else {
        set_before(rank, l.step, after + TraceDelta(rank, l.step), t.who);
      }
      after = static_cast<float>(l.value);
      auto [it, inserted] = by_step[l.step].try_emplace(rank, &l);
      if (!inserted) {
        error(absl::StrCat("rank ", rank, " step ", l.step, " printed twice: ", it->second->text,
                           " and ", l.text));
      }
    }
    // The value a process killed during its next call had going into it.
    const TraceLine& last = t.lines.back();
    set_before(rank, last.step + 1, after + TraceDelta(rank, last.step + 1), t.who);
  }

  for (const auto& [step, lines] : by_step) {
    const TraceLine* first = lines.begin()->second;
    for (const auto& [rank, l] : lines) {
      const std::string where = absl::StrCat("rank ", rank, " step ", step);
      if (l->action != first->action || l->level != first->level) {
        error(absl::StrCat("step ", step, ": rank ", rank, " did ", l->action, " level ",
                           l->level, " but rank ", first->rank, " did ", first->action, " level ",
                           first->level));
      }
      if (l->action == "SKIP") {
        ++result.skips;
        if (!l->members.empty() || !l->joining.empty()) {
          error(absl::StrCat(where, ": SKIP with members or joining ranks: ", l->text));
        }
        auto b = before.find({rank, step});
        if (check_values && b != before.end() && !close(l->value, b->second.first)) {
          error(absl::StrCat(where, ": SKIP changed the value from ", b->second.first, " to ",
                             l->value));
        }
        continue;
      }
      ++result.averages;
      const std::set<int32_t> members(l->members.begin(), l->members.end());
      const std::set<int32_t> joining(l->joining.begin(), l->joining.end());
      if (members.count(rank) == 0) {
        error(absl::StrCat(where, ": its own rank is not among the members: ", l->text));
      }
      if (members.size() != l->members.size()) {
        error(absl::StrCat(where, ": members listed twice: ", l->text));
      }
      for (int32_t j : joining) {
        if (members.count(j) == 0) {
          error(absl::StrCat(where, ": joining rank ", j, " is not a member: ", l->text));
        }
      }
      if (!group_sizes.empty()) {
        if (l->level < 0 || l->level >= static_cast<int32_t>(group_sizes.size())) {
          error(absl::StrCat(where, ": level ", l->level, " is not one of the job's ",
                             group_sizes.size()));
        } else {
          const int32_t g = group_sizes[l->level];
          for (int32_t m : members) {
            if (m / g != rank / g) {
              error(absl::StrCat(where, ": member ", m, " is outside rank ", rank,
                                 "'s block of ", g, " at level ", l->level));
            }
          }
        }
      }
      // The average of the contributors' values before the call.
      double sum = 0;
      int contributors = 0;
      bool known = true;
      for (int32_t m : members) {
        if (joining.count(m) != 0) continue;
        auto b = before.find({m, step});
        if (b == before.end()) {
          error(absl::StrCat(where, ": member ", m, " has no known value before step ", step,
                             " (no line of rank ", m, " at step ", step - 1, ")"));
          known = false;
          continue;
        }
        sum += b->second.first;
        ++contributors;
      }
      if (contributors == 0 && known) {
        error(absl::StrCat(where, ": no member contributed (all joining?): ", l->text));
      } else if (known && check_values) {
        const double mean = sum / contributors;
        if (!close(l->value, mean)) {
          error(absl::StrCat(where, ": value ", l->value, " but the mean of members [",
                             absl::StrJoin(l->members, ", "), "] less joining [",
                             absl::StrJoin(l->joining, ", "), "] before the call is ", mean));
        }
      }
      if (joining.count(rank) != 0 && !l->admitted) {
        error(absl::StrCat(where, ": listed as joining, but the line is not an admission: ",
                           l->text));
      }
      // Every member that printed this step saw the same averaging.
      for (int32_t m : members) {
        auto other = lines.find(m);
        if (other == lines.end()) continue;  // it died during or after the call
        const TraceLine* o = other->second;
        if (o->action != "AVERAGE" || o->members != l->members || o->joining != l->joining ||
            o->level != l->level) {
          error(absl::StrCat("step ", step, ": rank ", rank, " printed ", l->text,
                             " but its member rank ", m, " printed ", o->text));
        }
      }
    }
  }
  return result;
}

// Every line of `traces` against the rule restated naively for `spec` (NaiveDecide; levels of
// one fragment): the same action and level, and as members the rule's group — exactly, with
// `every_rank_lived` (a job that kept all its ranks the whole run), else a subset of it that
// holds the line's rank. Then CheckTraces (values unless !check_values: a job with outer
// levels, whose values outer_trace_check.h checks; agreement between members).
inline TraceCheckResult CheckTracesFollowRule(const std::vector<Trace>& traces,
                                              const v1::JobSpec& spec,
                                              bool every_rank_lived = true,
                                              bool check_values = true) {
  std::vector<int32_t> group_sizes;
  for (const v1::Level& l : spec.levels()) group_sizes.push_back(l.group_size());
  TraceCheckResult result = CheckTraces(traces, group_sizes, check_values);
  for (const Trace& t : traces) {
    for (const TraceLine& l : t.lines) {
      const NaiveDecision d = NaiveDecide(spec, l.step, l.rank);
      const std::string where = absl::StrCat(t.who, " step ", l.step, ": ", l.text);
      if (l.action != (d.average ? "AVERAGE" : "SKIP") || (d.average && l.level != d.level)) {
        result.errors.push_back(absl::StrCat(where, ": the rule says ",
                                             d.average ? "AVERAGE" : "SKIP", " level ", d.level));
        continue;
      }
      if (!d.average) continue;
      const std::vector<int32_t> group(d.group.begin(), d.group.end());
      bool subset = std::find(l.members.begin(), l.members.end(), l.rank) != l.members.end();
      for (int32_t m : l.members) {
        subset = subset && std::find(group.begin(), group.end(), m) != group.end();
      }
      if ((every_rank_lived && l.members != group) || !subset) {
        result.errors.push_back(absl::StrCat(where, ": members [", absl::StrJoin(l.members, ", "),
                                             "] but the rule's group is [",
                                             absl::StrJoin(group, ", "), "]"));
      }
    }
  }
  return result;
}

}  // namespace modelavg::testing

#endif  // MODELAVG_TESTS_INTEGRATION_TRACE_CHECK_H_
