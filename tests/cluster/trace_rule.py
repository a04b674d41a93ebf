"""Checks modelavg-trace-worker output against the averaging rule alone (Python).

The same rule as tests/integration/trace_check.h, restated for the cluster tests and the chaos
soak (bench/chaos): it needs no reference run, so it holds for jobs whose members are cut off,
killed, stopped, evicted and replaced at moments the test does not control. From each process's
JSON lines it rebuilds that rank's value before every call, as the worker computes it:
before(s) = after(s - 1) + (rank + 1) * (s + 1) * 0.5, with after(-1) = rank (or, for a
replacement, from its admission line on). Then for every line:

* every value is finite (a NaN or an Inf that reached a line spread through an average);
* AVERAGE: the rank is among the members; the value is the mean, over the members that are not
  joining, of their before values at that step; every member that printed the step printed the
  same members and level. A member that printed nothing at that step must have died in that
  very call: its process's last line is the step before (its value going in is then known);
* SKIP: the value is the before value, and the line lists no members;
* each process prints consecutive steps of one rank, from 0 or from its admission step, in
  generations that never go down; no two processes print the same (rank, step).

:func:`check` raises :class:`Violation` naming the first broken rule; :func:`check_all` returns
every violation and the figures (lines, averages checked, processes) instead.
:func:`naive_decision` is the hierarchical schedule restated (DESIGN.md), for strict jobs whose
every decision is known in advance.
"""

import json
import math

REL_TOL = 1e-5
ABS_TOL = 1e-4


class Violation(AssertionError):
    """A trace that breaks the averaging rule."""


def parse(text, who):
    """The JSON lines of one process's stdout (non-JSON lines are an error). A last line cut
    short (a process killed while it wrote) is left out."""
    lines = []
    raw_lines = text.splitlines()
    for i, raw in enumerate(raw_lines):
        raw = raw.strip()
        if not raw:
            continue
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            if i == len(raw_lines) - 1 and not text.endswith("\n"):
                break  # killed mid-line
            raise Violation(f"{who}: not a JSON line: {raw!r}")
    return lines


def _close(a, b):
    return abs(a - b) <= max(ABS_TOL, REL_TOL * max(abs(a), abs(b)))


def naive_decision(step, warmup, levels):
    """(action, level) at `step` for a HIERARCHICAL job: levels [(period, group_size)]."""
    if step < warmup:
        return "SKIP", -1
    for i in range(len(levels) - 1, -1, -1):
        if step % levels[i][0] == 0:
            return "AVERAGE", i
    return "SKIP", -1


def _delta(rank, step):
    return (rank + 1) * (step + 1) * 0.5


def check_all(traces):
    """traces: {who: [line dicts]}. Returns (violations, figures): every broken rule found (in
    the order found: per process, then per line), and {'lines', 'averages', 'processes'}."""
    violations = []
    befores = {}  # who -> {step: value before the call (None: an admission, contributed nothing)}
    last_step = {}  # who -> its last printed step
    owner = {}  # (rank, step) -> who printed it
    for who, lines in traces.items():
        if not lines:
            continue
        rank = lines[0]["rank"]
        first = lines[0]["step"]
        if first != 0 and not lines[0].get("admitted"):
            violations.append(f"{who}: starts at step {first} without an admitted line")
            continue
        value = float(rank)
        per_step = {}
        generation = 0
        for i, line in enumerate(lines):
            s = line["step"]
            if line["rank"] != rank:
                violations.append(f"{who}: rank changed from {rank}: {line}")
                break
            if s != first + i:
                violations.append(f"{who}: step {first + i} expected, got {line}")
                break
            if not math.isfinite(line["value"]):
                violations.append(f"{who}: step {s}: the value is {line['value']}, not finite: "
                                  f"{line}")
            if line.get("generation", 0) < generation:
                violations.append(f"{who}: step {s} in generation {line['generation']} after "
                                  f"generation {generation}")
            generation = max(generation, line.get("generation", 0))
            if (rank, s) in owner:
                violations.append(f"{who} and {owner[(rank, s)]} both printed rank {rank} at "
                                  f"step {s}")
            owner[(rank, s)] = who
            if i == 0 and line.get("admitted"):
                per_step[s] = None  # contributed nothing
            else:
                per_step[s] = value + _delta(rank, s)
            if line["action"] == "SKIP" and (line.get("members") or line.get("joining")):
                violations.append(f"{who}: SKIP with members or joining ranks at step {s}: "
                                  f"{line}")
            if line["action"] == "SKIP" and not _close(line["value"], per_step[s]):
                violations.append(f"{who}: SKIP at step {s} changed the value: {per_step[s]} "
                                  f"before, {line['value']} after")
            value = line["value"]
        befores[who] = per_step
        last_step[who] = lines[-1]["step"]
        # The value a process killed during its next call had going into it.
        per_step.setdefault(lines[-1]["step"] + 1, value + _delta(rank, lines[-1]["step"] + 1))

    # (rank, step) -> the line of the process that printed it, and that process.
    printed = {}
    for who, lines in traces.items():
        for line in lines:
            printed.setdefault((line["rank"], line["step"]), (who, line))

    checked = 0
    averages = 0
    for who, lines in traces.items():
        for line in lines:
            checked += 1
            if line["action"] != "AVERAGE":
                continue
            averages += 1
            s, members = line["step"], sorted(line["members"])
            joining = set(line.get("joining", []))
            if line["rank"] not in members:
                violations.append(f"{who}: AVERAGE at step {s} without its own rank: {line}")
                continue
            contributions = []
            broken = False
            for m in members:
                found = printed.get((m, s))
                if found is not None:
                    peer_who, peer = found
                    if (peer["action"] != "AVERAGE" or sorted(peer["members"]) != members
                            or peer.get("level") != line.get("level")
                            or set(peer.get("joining", [])) != joining):
                        violations.append(f"{who}: step {s} averaged with {members} at level "
                                          f"{line.get('level')}, but its member rank {m} "
                                          f"printed {peer}")
                        broken = True
                        continue
                    before = befores.get(peer_who, {}).get(s)
                else:
                    # It died in this very call: a process of rank m whose last line is s - 1.
                    dead = [w for w, ls in traces.items()
                            if ls and ls[0]["rank"] == m and last_step.get(w) == s - 1]
                    if not dead:
                        violations.append(
                            f"{who}: step {s} averaged with {members}, but no process of rank "
                            f"{m} printed step {s} or died in its call (none ended at step "
                            f"{s - 1})")
                        broken = True
                        continue
                    before = befores[dead[0]].get(s)
                if m in joining:
                    continue
                if before is None:
                    violations.append(f"{who}: rank {m} contributed at step {s} yet was "
                                      "admitted there")
                    broken = True
                    continue
                contributions.append(before)
            if broken:
                continue
            if not contributions:
                violations.append(f"{who}: step {s}: every member was joining")
                continue
            mean = sum(contributions) / len(contributions)
            if not math.isfinite(line["value"]) or not _close(line["value"], mean):
                violations.append(
                    f"{who}: step {s} with members {members}: value {line['value']}, the "
                    f"members' mean is {mean} (their values before: {contributions})")
    figures = {"lines": checked, "averages": averages,
               "processes": sum(1 for ls in traces.values() if ls)}
    return violations, figures


def check(traces):
    """traces: {who: [line dicts]}. Raises Violation naming the first broken rule; returns the
    number of lines checked."""
    violations, figures = check_all(traces)
    if violations:
        raise Violation(violations[0] + (f" (and {len(violations) - 1} more)"
                                         if len(violations) > 1 else ""))
    return figures["lines"]
