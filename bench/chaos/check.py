"""The chaos soak's checker: a run's folder (bench/chaos/run.py) against the averaging rule and
what each fault must leave behind. It reads only what the processes printed and the driver
recorded, and restates the rule itself (tests/cluster/trace_rule.py): nothing of the library.

* Every line of every process of the elastic job, and of each strict job: the averaging rule
  (each average the mean of that step's members' values before the call, every member agreeing,
  every value finite, consecutive steps, one process per rank and step, generations that never
  go down).
* Every worker's end is one a fault explains: killed by the driver; stopped by it at the end
  (exit 143 having said it left the job); evicted after a stop or a cut ("declared this rank
  dead"); a NaN worker failing at its NaN step naming the non-finite values; a replacement
  refused because its rank was not vacant yet (before it printed anything). Anything else —
  an uneven tensor, an internal error, a timeout — is a violation.
* Each fault was survived:
  kill_worker, stop_worker, cut_site, kill_leader, stop_etcd: the job averaged over the whole
    world (its last level) again after the fault healed; a killed rank was taken by a
    replacement (admitted) unless the run ended within 30 s;
  nan: the worker failed naming the non-finite values at that step, no value anywhere is NaN
    or Inf, and the others averaged on at that step or later without it;
  strict_kill: every survivor of the strict job failed within the bound (no hang).
* Nothing acknowledged was lost: the job is FINISHED at the end; every worker stopped at the end
  holds its rank as LEFT in the coordinator's final record (its Join, an admission perhaps, and
  its Leave were kept through every coordinator and etcd fault); no worker printed a generation
  beyond the coordinator's final one.

report(run_dir) prints the figures and the first violation and returns 0 (all held) or 1.
"""

import copy
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "cluster"))
import trace_rule  # noqa: E402

# A killed rank must have been taken again unless the run ended within this.
REPLACEMENT_GRACE_MS = 30000


def load(run_dir):
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    traces, errors = {}, {}
    for w in run["workers"]:
        with open(os.path.join(run_dir, w["out"])) as f:
            traces[w["name"]] = trace_rule.parse(f.read(), w["name"])
        with open(os.path.join(run_dir, w["err"])) as f:
            errors[w["name"]] = f.read()
    return run, traces, errors


def last_error(text):
    rows = [r for r in text.strip().splitlines() if r.strip()]
    return rows[-1] if rows else "(nothing on stderr)"


def check_run(run, traces, errors):
    """(violations, figures) of a loaded run."""
    violations = []
    workers = {w["name"]: w for w in run["workers"]}
    top = len(run["levels"]) - 1
    elastic = {n: traces[n] for n, w in workers.items() if w["job"] == "chaos"}
    strict_jobs = sorted({w["job"] for w in workers.values() if w["job"] != "chaos"})

    # 1. The rule, per job.
    rule, figures = trace_rule.check_all(elastic)
    violations += [f"averaging rule (job chaos): {v}" for v in rule]
    strict_averages = 0
    for job in strict_jobs:
        v, f = trace_rule.check_all({n: traces[n] for n, w in workers.items() if w["job"] == job})
        violations += [f"averaging rule (job {job}): {x}" for x in v]
        strict_averages += f["averages"]

    faults = run["faults"]
    touched = {}  # worker name -> faults that may explain its eviction
    for f in faults:
        if f["kind"] == "stop_worker":
            touched.setdefault(f["worker"], []).append(f)
        if f["kind"] == "cut_site":
            for n, w in workers.items():
                if w["job"] == "chaos" and ("a" if w["rank"] < 4 else "b") == f["site"] \
                        and w["started_ms"] <= f["at_ms"]:
                    touched.setdefault(n, []).append(f)

    # 2. Every end explained.
    for n, w in workers.items():
        rc, err = w["returncode"], last_error(errors[n])
        lines = traces[n]
        if w["killed_by"] is not None:
            continue
        if w["job"] != "chaos":
            if rc == 0:
                violations.append(f"{n} (strict job) exited 0 though it ran forever")
            continue  # a strict survivor: its exit is judged with its fault below
        if rc == 128 + 15 and w["terminated"]:
            if "left job chaos" not in err:
                violations.append(f"{n}: stopped at the end but did not say it left: {err}")
            continue
        if rc == 1 and w["nan_step"] is not None and lines and \
                lines[-1]["step"] == w["nan_step"] - 1:
            continue  # judged with its nan fault
        if rc == 1 and "declared this rank dead" in err and n in touched:
            continue
        if rc == 1 and not lines and any(s in err for s in (
                "ALREADY_EXISTS", "is full", "is not vacant", "already taken")):
            continue
        # A replacement admitted into a subgroup (a site) whose every other live member was
        # killed or retired for a NaN before it could hand the parameters over: it must fail
        # saying so (the library's documented answer), before averaging anything.
        if rc == 1 and not lines and \
                "no live member of its subgroup can give it the parameters" in err and any(
                    f["kind"] in ("nan", "kill_worker") and f["rank"] // 4 == w["rank"] // 4
                    and w["started_ms"] - REPLACEMENT_GRACE_MS <= f["at_ms"] <= w["exited_ms"]
                    for f in faults):
            continue
        violations.append(f"{n} (rank {w['rank']}) ended with {rc} that no fault explains: {err}")

    # 3. Each fault survived.
    def top_average_after(ms, without=None):
        for name, ls in elastic.items():
            if name == without:
                continue
            for ln in ls:
                if ln["action"] == "AVERAGE" and ln["level"] == top and ln.get("unix_ms", 0) > ms:
                    return ln
        return None

    end_ms = max((w["exited_ms"] or 0) for w in workers.values())
    survived = {}
    strict_times = []
    for i, f in enumerate(faults):
        kind, why = f["kind"], None
        after = f.get("healed_ms", f["at_ms"])
        if kind in ("kill_worker", "stop_worker", "cut_site", "kill_leader", "stop_etcd"):
            if top_average_after(after, without=f.get("worker")) is None:
                why = "the job never averaged over the whole world again after it"
            if kind == "kill_worker" and why is None and end_ms - f["at_ms"] > \
                    REPLACEMENT_GRACE_MS:
                taken = [n for n, w in workers.items() if w["job"] == "chaos" and
                         w["rank"] == f["rank"] and w["started_ms"] > f["at_ms"] and
                         traces[n] and traces[n][0].get("admitted")]
                if not taken:
                    why = f"rank {f['rank']} was never taken again by a replacement"
        elif kind == "nan":
            err = errors[f["worker"]]
            if "non-finite" not in err or f"step {f['step']}" not in err:
                why = f"{f['worker']} did not fail naming its non-finite values at step " \
                      f"{f['step']}: {last_error(err)}"
            elif not any(ln["action"] == "AVERAGE" and ln["step"] >= f["step"]
                         for n, ls in elastic.items() if n != f["worker"] for ln in ls):
                why = "nobody averaged at or after the NaN step"
        elif kind == "strict_kill":
            if "error" in f:
                why = f["error"]
            else:
                victims = [n for n, w in workers.items() if w["job"] == f["job"]]
                slow = []
                for n in victims:
                    w = workers[n]
                    if n == f["worker"]:
                        continue
                    if w["killed_by"] is not None or w["returncode"] in (None, 0):
                        slow.append(f"{n} still ran {run['strict_bound_s'] + 30:.0f} s after "
                                    "the kill (a hang)")
                        continue
                    took = (w["exited_ms"] - f["at_ms"]) / 1000
                    strict_times.append(took)
                    if took > run["strict_bound_s"]:
                        slow.append(f"{n} failed {took:.1f} s after the kill (bound "
                                    f"{run['strict_bound_s']} s): {last_error(errors[n])}")
                if slow:
                    why = "; ".join(slow)
        if why is None:
            survived[i] = True
        else:
            violations.append(f"fault {i + 1} ({kind} {json.dumps({k: v for k, v in f.items() if k not in ('kind',)})}) "
                              f"not survived: {why}")

    # 4. Nothing acknowledged lost.
    final = run.get("final_job", {})
    if "error" in final:
        violations.append(f"the final GetJob failed: {final['error']}")
    else:
        if final.get("state") != "FINISHED":
            violations.append(f"job chaos is {final.get('state')} at the end, not FINISHED")
        members = {m.get("rank", 0): m for m in final.get("members", [])}
        final_gen = int(final.get("generation", 0))
        for n, w in workers.items():
            if w["job"] != "chaos":
                continue
            gens = [ln.get("generation", 0) for ln in traces[n]]
            if gens and max(gens) > final_gen:
                violations.append(f"{n} printed generation {max(gens)}, beyond the "
                                  f"coordinator's final {final_gen}: a change was lost")
            if w["terminated"] and w["returncode"] == 128 + 15:
                m = members.get(w["rank"])
                if m is None or m.get("state") != "LEFT" or \
                        not str(m.get("worker_id", "")).endswith(f":{w.get('pid')}"):
                    violations.append(f"{n} left at the end, but the coordinator's record of "
                                      f"rank {w['rank']} is {m}")

    counts = {}
    for f in faults:
        counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    figures.update({"faults": len(faults), "by_kind": counts, "survived": len(survived),
                    "strict_averages": strict_averages, "strict_jobs": len(strict_jobs),
                    "strict_fail_s": (min(strict_times), max(strict_times)) if strict_times
                    else None})
    return violations, figures


def seeded(traces, run, rng):
    """The traces with one average of the elastic job perturbed: (traces, what was changed)."""
    elastic = [n for n, w in ((w["name"], w) for w in run["workers"]) if w["job"] == "chaos"]
    candidates = [(n, i) for n in elastic for i, ln in enumerate(traces[n])
                  if ln["action"] == "AVERAGE"]
    n, i = rng.choice(candidates)
    bad = copy.deepcopy(traces)
    # Well past float32 rounding of the mean (trace_rule's tolerance), yet small.
    bad[n][i]["value"] += 1e-3 * abs(bad[n][i]["value"]) + 0.01
    return bad, f"{n} step {bad[n][i]['step']}: value * (1 + 1e-3) + 0.01"


def report(run_dir, seed_violation=False):
    run, traces, errors = load(run_dir)
    violations, fig = check_run(run, traces, errors)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(fig["by_kind"].items(), key=lambda kv: -kv[1]))
    print(f"chaos soak: seed {run['seed']}, {run['seconds']:.0f} s of faults")
    print(f"faults injected: {fig['faults']} ({kinds})")
    print(f"faults survived: {fig['survived']} of {fig['faults']}")
    print(f"averages checked: {fig['averages']} of job chaos ({fig['lines']} lines of "
          f"{fig['processes']} processes: every member, every step), {fig['strict_averages']} "
          f"of {fig['strict_jobs']} strict jobs" +
          (f" (their survivors failed {fig['strict_fail_s'][0]:.1f}-"
           f"{fig['strict_fail_s'][1]:.1f} s after the kill)" if fig["strict_fail_s"] else ""))
    print(f"first violation: {violations[0] if violations else 'none'}" +
          (f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""))
    for v in violations[1:20]:
        print(f"  also: {v}")
    code = 1 if violations else 0
    if seed_violation:
        bad, what = seeded(traces, run, random.Random(run["seed"]))
        found, _ = check_run(run, bad, errors)
        if found:
            print(f"seeded violation ({what}) found: {found[0]}")
        else:
            print(f"FAIL: the seeded violation ({what}) was not found: the checker cannot fail")
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(report(sys.argv[1], seed_violation="--seed_violation" in sys.argv))
