#!/usr/bin/python3
"""modelavg against PyTorch's own averagers, value by value.

For one named configuration (or all): creates the job on a coordinator started here, runs
`world_size` modelavg-trace-worker processes on it, runs the same synthetic update through
PyTorch's PeriodicModelAverager / HierarchicalModelAverager (torch_reference.py), and checks that
every (step, rank) has the same action, the same level when averaging, and the same parameter
value within float32 tolerance.

  conformance_test.py --coordinator_bin=B --trace_bin=T --config=NAME
  conformance_test.py --list
"""

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (mode, world_size, warmup_steps, levels [(period, group_size)] in the user's order, steps)
CONFIGS = {
    # Periodic: the phase is relative to warm-up.
    "periodic_w2_p2_wu0": ("periodic", 2, 0, [(2, 2)], 9),
    "periodic_w4_p3_wu5": ("periodic", 4, 5, [(3, 4)], 15),
    "periodic_w8_p4_wu13": ("periodic", 8, 13, [(4, 8)], 22),
    # A largest period of 1 (PyTorch only warns): averaging at every step after warm-up.
    "periodic_w2_p1_wu1": ("periodic", 2, 1, [(1, 2)], 6),
    "hierarchical_w4_p1_wu3": ("hierarchical", 4, 3, [(1, 4)], 7),
    # Hierarchical: the phase is absolute; warm-up only masks.
    "hierarchical_w2_p4_wu13": ("hierarchical", 2, 13, [(4, 2)], 22),
    "hierarchical_w4_2x2_4x4_wu0": ("hierarchical", 4, 0, [(2, 2), (4, 4)], 13),
    "hierarchical_w8_2x2_4x4_8x8_wu1": ("hierarchical", 8, 1, [(2, 2), (4, 4), (8, 8)], 17),
    # Levels in non-ascending order: the last level whose period divides the step wins.
    "hierarchical_w4_desc_4x2_2x4_wu3": ("hierarchical", 4, 3, [(4, 2), (2, 4)], 13),
    "hierarchical_w8_mixed_6x4_3x2_4x8_wu7": ("hierarchical", 8, 7, [(6, 4), (3, 2), (4, 8)], 25),
    # Levels whose group is the whole world twice (both map to the world group).
    "hierarchical_w4_3x4_2x4_wu0": ("hierarchical", 4, 0, [(3, 4), (2, 4)], 13),
}

NUMEL = 3
REL_TOL = 1e-5
ABS_TOL = 1e-4


def parse_lines(text, who):
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            mt.fail(f"{who} printed a line that is not JSON: {line!r}")
        key = (row["step"], row["rank"])
        if key in rows:
            mt.fail(f"{who} printed step {key[0]} rank {key[1]} twice")
        rows[key] = row
    return rows


def run_reference(name, mode, world, warmup, levels, steps):
    argv = [sys.executable, os.path.join(HERE, "torch_reference.py"), f"--mode={mode}",
            f"--world_size={world}", f"--steps={steps}", f"--numel={NUMEL}",
            f"--warmup_steps={warmup}", "--levels=" + ",".join(f"{p}:{g}" for p, g in levels),
            "--timeout_s=90"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        mt.fail(f"{name}: torch_reference.py failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return parse_lines(out.stdout, "torch_reference.py")


def run_modelavg(name, args, mode, world, warmup, levels, steps):
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin)
        job_id = name.replace("_", "-")
        mt.create_job(coordinator.address, job_id, mode, world, warmup, levels)
        workers = [group.start([args.trace_bin, f"--coordinator={coordinator.address}",
                                f"--job={job_id}", f"--rank={r}", f"--world_size={world}",
                                f"--steps={steps}", f"--numel={NUMEL}", "--backend=gloo",
                                "--join_timeout_ms=60000", "--collective_timeout_ms=60000"],
                               f"rank {r}") for r in range(world)]
        results = mt.wait_all(workers, timeout_s=120)
        failed = {n: r for n, r in results.items() if r[0] != 0}
        if failed:
            details = "\n".join(f"  {n}: exit {rc}: {err.strip()[-800:]}"
                                for n, (rc, _, err) in sorted(failed.items()))
            mt.fail(f"{name}: trace workers failed:\n{details}\n"
                    f"coordinator log:\n{coordinator.log_tail()}")
        rc = coordinator.stop()
        if rc != 0:
            mt.fail(f"{name}: the coordinator exited with {rc} after SIGTERM:\n"
                    f"{coordinator.log_tail()}")
    rows = {}
    for _, (_, out, _) in results.items():
        for key, row in parse_lines(out, "modelavg-trace-worker").items():
            rows[key] = row
    return rows


def compare(name, expected, got):
    if set(expected) != set(got):
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        mt.fail(f"{name}: (step, rank) sets differ; missing {missing}, unexpected {extra}")
    mismatches = []
    for key in sorted(expected):
        e, g = expected[key], got[key]
        if e["action"] != g["action"]:
            mismatches.append(f"step {key[0]} rank {key[1]}: action {g['action']}, "
                              f"PyTorch {e['action']}")
        elif e["action"] == "AVERAGE" and e["level"] != g["level"]:
            mismatches.append(f"step {key[0]} rank {key[1]}: level {g['level']}, "
                              f"PyTorch {e['level']}")
        elif not math.isclose(e["value"], g["value"], rel_tol=REL_TOL, abs_tol=ABS_TOL):
            mismatches.append(f"step {key[0]} rank {key[1]}: value {g['value']}, "
                              f"PyTorch {e['value']}")
    if mismatches:
        mt.fail(f"{name}: {len(mismatches)} of {len(expected)} (step, rank) pairs differ "
                f"from PyTorch:\n  " + "\n  ".join(mismatches[:20]))
    averages = sum(1 for r in expected.values() if r["action"] == "AVERAGE")
    print(f"PASS {name}: {len(expected)} (step, rank) values match PyTorch "
          f"({averages} averaging)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator_bin")
    p.add_argument("--trace_bin")
    p.add_argument("--config", action="append", help="configuration name (repeatable); "
                   "default: all")
    p.add_argument("--list", action="store_true", help="print the configuration names")
    args = p.parse_args()
    if args.list:
        print("\n".join(CONFIGS))
        return 0
    if not args.coordinator_bin or not args.trace_bin:
        p.error("--coordinator_bin and --trace_bin are required")
    names = args.config or list(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            mt.fail(f"unknown --config={name}; known: {', '.join(CONFIGS)}")
        mode, world, warmup, levels, steps = CONFIGS[name]
        expected = run_reference(name, mode, world, warmup, levels, steps)
        got = run_modelavg(name, args, mode, world, warmup, levels, steps)
        compare(name, expected, got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
