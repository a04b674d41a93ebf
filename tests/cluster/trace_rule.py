"""Checks modelavg-trace-worker output against the averaging rule alone (Python).

The same rule as tests/integration/trace_check.h, restated for the cluster tests: it needs no
reference run, so it holds for jobs whose members are cut off, evicted and replaced at moments
the test does not control. From each process's JSON lines it rebuilds that rank's value before
every call, as the worker computes it: before(s) = after(s - 1) + (rank + 1) * (s + 1) * 0.5,
with after(-1) = rank (or, for a replacement, from its admission line on). Then for every line:

* AVERAGE: the rank is among the members; the value is the mean, over the members that are not
  joining, of their before values at that step; every member that printed the step printed the
  same members;
* SKIP: the value is the before value;
* each process prints consecutive steps of one rank, from 0 or from its admission step.

:func:`naive_decision` is the hierarchical schedule restated (DESIGN.md), for strict jobs whose
every decision is known in advance.
"""

import json

REL_TOL = 1e-5
ABS_TOL = 1e-4


def parse(text, who):
    """The JSON lines of one process's stdout (non-JSON lines are an error)."""
    lines = []
    for raw in text.splitlines():
        raw = raw.strip()
        if not raw:
            continue
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            raise AssertionError(f"{who}: not a JSON line: {raw!r}")
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


def check(traces):
    """traces: {who: [line dicts]}. Raises AssertionError naming the first broken rule; returns
    the number of lines checked."""
    befores = {}  # who -> {step: before}
    for who, lines in traces.items():
        if not lines:
            continue
        rank = lines[0]["rank"]
        first = lines[0]["step"]
        if first != 0 and not lines[0].get("admitted"):
            raise AssertionError(f"{who}: starts at step {first} without an admitted line")
        value = float(rank)
        per_step = {}
        for i, line in enumerate(lines):
            s = line["step"]
            if line["rank"] != rank:
                raise AssertionError(f"{who}: rank changed from {rank}: {line}")
            if s != first + i:
                raise AssertionError(f"{who}: step {first + i} expected, got {line}")
            if i == 0 and line.get("admitted"):
                per_step[s] = None  # contributed nothing
            else:
                per_step[s] = value + (rank + 1) * (s + 1) * 0.5
            if line["action"] == "SKIP":
                if not _close(line["value"], per_step[s]):
                    raise AssertionError(f"{who}: SKIP at step {s} changed the value: "
                                         f"{per_step[s]} before, {line['value']} after")
            value = line["value"]
        befores[who] = per_step

    checked = 0
    for who, lines in traces.items():
        for line in lines:
            checked += 1
            if line["action"] != "AVERAGE":
                continue
            s, members = line["step"], sorted(line["members"])
            joining = set(line.get("joining", []))
            if line["rank"] not in members:
                raise AssertionError(f"{who}: AVERAGE at step {s} without its own rank: {line}")
            contributions = []
            for m in members:
                # The process of rank m that averaged with the same members at step s.
                peers = [w for w, ls in traces.items() for x in ls
                         if x["rank"] == m and x["step"] == s and x["action"] == "AVERAGE"
                         and sorted(x["members"]) == members]
                if not peers:
                    raise AssertionError(
                        f"{who}: step {s} averaged with {members}, but no process of rank {m} "
                        "printed that average")
                if m in joining:
                    continue
                before = befores[peers[0]][s]
                if before is None:
                    raise AssertionError(f"{who}: rank {m} contributed at step {s} yet was "
                                         "admitted there")
                contributions.append(before)
            if not contributions:
                raise AssertionError(f"{who}: step {s}: every member was joining")
            mean = sum(contributions) / len(contributions)
            if not _close(line["value"], mean):
                raise AssertionError(
                    f"{who}: step {s} with members {members}: value {line['value']}, the "
                    f"members' mean is {mean} (their values before: {contributions})")
    return checked
