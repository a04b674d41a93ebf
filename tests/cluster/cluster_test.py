#!/usr/bin/python3
"""Jobs across hosts: modelavg in a two-site cluster of network namespaces (label `cluster`).

Each scenario (one CTest test each, `--scenario=NAME`) builds a cluster with tests/cluster/
netcluster.py (hosts w0, w1 in site a, w2, w3 in site b, the coordinator on a host of its own),
runs a coordinator and modelavg-trace-worker processes in the hosts, cuts links while they run,
and checks every value every worker printed against the averaging rule (trace_rule.py):

* hierarchical  -- a strict HIERARCHICAL job across the two sites, coordinator on the core:
                   every decision is the naive schedule's, every value the rule's.
* coordinator_cut -- the coordinator's host cut off for twice the heartbeat timeout mid-run:
                   the workers ride through (same generation, every step), values exact.
* worker_cut    -- an elastic job; w3's host cut off: the survivors average without rank 3
                   within heartbeat timeout + 1 s of the cut; once the link is back the cut-off
                   worker exits with an error that says it was removed, and a replacement is
                   admitted and ends with its peers' values.
* site_cut_strict, site_cut_elastic -- the coordinator in site a, site b's uplink cut for twice
                   the heartbeat timeout: what each side sees (docs/cluster.md).
* gray_failure  -- an elastic job on a separate control network; w3's data link cut while its
                   control link stays up (it still beats to the coordinator): the round fails at
                   the collective timeout, the survivors' peer failure reports against rank 3
                   are confirmed and the survivors average without it within collective
                   timeout + 1 s of the cut (the collective timeout is the heartbeat timeout
                   here); nobody else is evicted; rank 3 exits saying it was declared dead.

Without root or network namespaces a scenario prints why and exits 77 (CTest: skipped);
with MODELAVG_REQUIRE_CLUSTER=1 (.ci/run) that is a failure instead.

  cluster_test.py --coordinator_bin=B --trace_worker_bin=T --rpc_bin=R --scenario=NAME
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import netcluster as nc  # noqa: E402
import trace_rule  # noqa: E402

SKIP = 77
PORT = 7000  # the coordinator's port inside its own namespace
HEARTBEAT_MS = 1500
# The gray scenario's collective timeout: the heartbeat timeout, so that its bound
# (collective timeout + 1 s) is the heartbeat timeout + 1 s.
GRAY_TIMEOUT_MS = HEARTBEAT_MS
WORKERS = [("w0", "a"), ("w1", "a"), ("w2", "b"), ("w3", "b")]

SCENARIOS = ["hierarchical", "coordinator_cut", "worker_cut", "site_cut_strict",
             "site_cut_elastic", "gray_failure"]


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


class Run:
    """One scenario's cluster, coordinator, workers and temporary folder."""

    def __init__(self, args, coordinator_site=None, control=False, jobs=()):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="modelavg-cluster-")
        hosts = [nc.Host("coord", coordinator_site, control=control)]
        hosts += [nc.Host(name, site, control=control) for name, site in WORKERS]
        self.cluster = nc.Cluster(hosts, site_rate_mbit=args.rate_mbit, control=control)
        coord = self.cluster.hosts["coord"]
        self.coord_ip = coord.control_address if control else coord.address
        self.address = f"{self.coord_ip}:{PORT}"
        jobs_file = os.path.join(self.tmp, "jobs.json")
        with open(jobs_file, "w") as f:
            json.dump({"jobs": list(jobs)}, f)
        self.coord_log = open(os.path.join(self.tmp, "coordinator.log"), "w")
        self.coordinator = self.cluster.popen(
            "coord", [args.coordinator_bin, f"--listen={self.address}", f"--jobs_file={jobs_file}",
                      "--log_level=info"], stdout=self.coord_log, stderr=subprocess.STDOUT)
        self.workers = {}
        self._wait_serving()

    def _wait_serving(self, timeout_s=20):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.coordinator.poll() is not None:
                fail(f"the coordinator exited with {self.coordinator.returncode}:\n"
                     f"{self.coord_tail()}")
            if self.rpc("ListJobs", {}, check=False) is not None:
                return
            time.sleep(0.2)
        fail(f"the coordinator did not answer within {timeout_s} s:\n{self.coord_tail()}")

    def rpc(self, method, request, check=True):
        """A Coordinator RPC from the coordinator's own host (modelavg-rpc); the reply as JSON."""
        out = self.cluster.run("coord", [self.args.rpc_bin, f"--coordinator={self.address}",
                                         "--rpc_timeout_ms=5000", "call",
                                         f"modelavg.v1.Coordinator/{method}",
                                         json.dumps(request)], check=False)
        if out.returncode != 0:
            if check:
                fail(f"{method} failed: {out.stderr.strip()}")
            return None
        return json.loads(out.stdout or "{}")

    def coord_tail(self, lines=40):
        self.coord_log.flush()
        with open(self.coord_log.name) as f:
            return "".join(f.readlines()[-lines:])

    def start_worker(self, name, host, job, rank, steps, extra=()):
        """A trace worker on `host`; stdout and stderr to files."""
        h = self.cluster.hosts[host]
        out = open(os.path.join(self.tmp, f"{name}.out"), "w")
        err = open(os.path.join(self.tmp, f"{name}.err"), "w")
        argv = [self.args.trace_worker_bin, f"--coordinator={self.address}", f"--job={job}",
                f"--rank={rank}", "--world_size=4", f"--steps={steps}", "--numel=256",
                "--backend=gloo", f"--gloo_hostname={h.address}", "--unix_ms",
                "--log_level=info", *extra]
        proc = self.cluster.popen(host, argv, stdout=out, stderr=err)
        proc.name, proc.out_path, proc.err_path = name, out.name, err.name
        self.workers[name] = proc
        return proc

    def lines(self, name):
        with open(self.workers[name].out_path) as f:
            return trace_rule.parse(f.read(), name)

    def stderr(self, name):
        with open(self.workers[name].err_path) as f:
            return f.read()

    def wait_for_step(self, name, step, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ls = self.lines(name)
            if ls and ls[-1]["step"] >= step:
                return ls[-1]
            if self.workers[name].poll() is not None:
                fail(f"{name} exited ({self.workers[name].returncode}) before step {step}:\n"
                     f"{self.stderr(name)[-3000:]}")
            time.sleep(0.05)
        fail(f"{name} did not reach step {step} within {timeout_s} s:\n"
             f"{self.stderr(name)[-3000:]}")

    def wait(self, names, timeout_s):
        """{name: returncode}; a worker still running at the deadline fails the test."""
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name in names:
            try:
                codes[name] = self.workers[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                fail(f"{name} still runs after {timeout_s} s:\n{self.stderr(name)[-3000:]}\n"
                     f"coordinator:\n{self.coord_tail()}")
        return codes

    def expect_exit(self, names, code, timeout_s):
        for name, rc in self.wait(names, timeout_s).items():
            if (rc == 0) != (code == 0):
                fail(f"{name} exited with {rc}, expected {'0' if code == 0 else 'an error'}:\n"
                     f"{self.stderr(name)[-3000:]}\ncoordinator:\n{self.coord_tail()}")

    def check_traces(self, names):
        traces = {n: self.lines(n) for n in names}
        try:
            return trace_rule.check(traces)
        except AssertionError as e:
            fail(f"averaging rule: {e}")

    def close(self):
        self.cluster.close()
        self.coord_log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def job_spec(job_id, levels, mode="HIERARCHICAL", warmup=0, min_world=0):
    return {"job_id": job_id, "world_size": 4, "warmup_steps": warmup, "mode": mode,
            "levels": [{"period": p, "group_size": g} for p, g in levels],
            "heartbeat_timeout_ms": HEARTBEAT_MS, "join_timeout_ms": 60000,
            "min_world_size": min_world}


def first_average_without(lines, rank, after_ms, level=None):
    """The first AVERAGE line (at `level`, if given) that ended after `after_ms` and whose
    members lack `rank`."""
    for line in lines:
        if (line["action"] == "AVERAGE" and line["unix_ms"] > after_ms
                and rank not in line["members"] and level in (None, line["level"])):
            return line
    return None


def now_ms():
    return int(time.time() * 1000)


# ---- scenarios

def hierarchical(args):
    levels = [(2, 2), (6, 4)]
    run = Run(args, jobs=[job_spec("hier", levels, warmup=3)])
    try:
        steps = 30
        names = [f"rank{r}" for r in range(4)]
        for r, (host, _) in enumerate(WORKERS):
            run.start_worker(names[r], host, "hier", r, steps)
        before = run.cluster.site_bytes("b")
        run.expect_exit(names, 0, timeout_s=60)
        crossed = run.cluster.site_bytes("b") - before
        n = run.check_traces(names)
        for name in names:
            for line in run.lines(name):
                action, level = trace_rule.naive_decision(line["step"], 3, levels)
                if (line["action"], line["level"]) != (action, level):
                    fail(f"{name} step {line['step']}: {line['action']} level {line['level']}, "
                         f"the schedule says {action} level {level}")
                if action == "AVERAGE":
                    g = levels[level][1]
                    block = list(range(g * (line["rank"] // g), g * (line["rank"] // g) + g))
                    if sorted(line["members"]) != block:
                        fail(f"{name} step {line['step']}: members {line['members']}, "
                             f"expected {block}")
        if crossed <= 0:
            fail("no byte crossed site b's uplink, yet every 6th step averages across sites")
        print(f"hierarchical: {n} lines checked; {crossed} bytes crossed site b's uplink")
    finally:
        run.close()


def coordinator_cut(args):
    levels = [(2, 2), (4, 4)]
    run = Run(args, jobs=[job_spec("cut", levels)])
    try:
        steps = 100
        names = [f"rank{r}" for r in range(4)]
        for r, (host, _) in enumerate(WORKERS):
            run.start_worker(names[r], host, "cut", r, steps, ["--step_delay_ms=60"])
        run.wait_for_step("rank0", 8)
        cut_at = now_ms()
        run.cluster.cut_host("coord")
        time.sleep(2 * HEARTBEAT_MS / 1000)
        run.cluster.restore_host("coord")
        restored_at = now_ms()
        run.expect_exit(names, 0, timeout_s=60)
        n = run.check_traces(names)
        during = 0
        for name in names:
            lines = run.lines(name)
            if len(lines) != steps:
                fail(f"{name} printed {len(lines)} steps, expected {steps}")
            gens = {line["generation"] for line in lines}
            if len(gens) != 1:
                fail(f"{name}: the generation moved ({sorted(gens)}): the outage evicted someone"
                     f"\ncoordinator:\n{run.coord_tail()}")
            during += sum(1 for line in lines if cut_at < line["unix_ms"] < restored_at
                          and line["action"] == "AVERAGE")
        if during == 0:
            fail("no worker averaged while the coordinator was cut off: the cut did not fall "
                 "inside the run")
        print(f"coordinator_cut: {n} lines checked, {during} averages during the "
              f"{restored_at - cut_at} ms outage, one generation throughout")
    finally:
        run.close()


def worker_cut(args):
    run = Run(args, jobs=[job_spec("elastic", [(2, 4)], mode="PERIODIC", min_world=3)])
    try:
        steps = 200
        names = [f"rank{r}" for r in range(4)]
        for r, (host, _) in enumerate(WORKERS):
            run.start_worker(names[r], host, "elastic", r, steps,
                             ["--step_delay_ms=50", "--collective_timeout_ms=30000"])
        run.wait_for_step("rank0", 10)
        cut_at = now_ms()
        run.cluster.cut_host("w3")
        # The survivors go on without rank 3 within the heartbeat timeout + 1 s.
        deadline = time.monotonic() + 15
        first = None
        while first is None and time.monotonic() < deadline:
            first = first_average_without(run.lines("rank0"), 3, cut_at)
            time.sleep(0.05)
        if first is None:
            fail(f"rank 0 did not average without rank 3 within 15 s of the cut\n"
                 f"{run.coord_tail()}")
        took = first["unix_ms"] - cut_at
        if took > HEARTBEAT_MS + 1000:
            fail(f"the survivors' first average without rank 3 came {took} ms after the cut; "
                 f"the bound is the heartbeat timeout + 1 s = {HEARTBEAT_MS + 1000} ms")
        time.sleep(HEARTBEAT_MS / 1000)
        run.cluster.restore_host("w3")
        # The cut-off worker learns that it was removed and says so.
        rc = run.wait(["rank3"], timeout_s=40)["rank3"]
        err = run.stderr("rank3")
        if rc == 0:
            fail(f"the cut-off rank 3 exited 0; expected an error:\n{err[-2000:]}")
        last_err = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
        if not any(w in last_err.lower() for w in ("generation", "removed", "dead", "evicted",
                                                    "no longer")):
            fail(f"the cut-off rank 3's error does not say it was removed: {last_err}")
        # A replacement is admitted (the coordinator picks the vacant rank 3).
        run.start_worker("replacement", "w3", "elastic", -1, steps,
                         ["--step_delay_ms=50", "--collective_timeout_ms=30000"])
        run.expect_exit(names[:3] + ["replacement"], 0, timeout_s=60)
        rep = run.lines("replacement")
        if not rep or not rep[0].get("admitted") or rep[0]["rank"] != 3:
            fail(f"the replacement was not admitted as rank 3: {rep[:1]}")
        n = run.check_traces(names + ["replacement"])
        job = run.rpc("GetJob", {"job_id": "elastic"})
        print(f"worker_cut: survivors went on {took} ms after the cut; rank 3 said: {last_err}; "
              f"replacement admitted at step {rep[0]['step']}; {n} lines checked; "
              f"deaths {job.get('deaths')}, admissions {job.get('admissions')}")
    finally:
        run.close()


def site_cut(args, elastic):
    levels = [(2, 2), (4, 4)]
    spec = job_spec("site", levels, min_world=2 if elastic else 0)
    run = Run(args, coordinator_site="a", jobs=[spec])
    try:
        steps = 120
        names = [f"rank{r}" for r in range(4)]
        for r, (host, _) in enumerate(WORKERS):
            run.start_worker(names[r], host, "site", r, steps,
                             ["--step_delay_ms=50", "--collective_timeout_ms=20000"])
        run.wait_for_step("rank0", 8)
        cut_at = now_ms()
        run.cluster.cut_site("b")
        time.sleep(2 * HEARTBEAT_MS / 1000)
        run.cluster.restore_site("b")
        report = {}
        if elastic:
            # Site a (the coordinator's side) goes on as a job of two within hb + 1 s.
            first = None
            deadline = time.monotonic() + 15
            while first is None and time.monotonic() < deadline:
                # (level 1, the whole world's average: level 0 never included site b)
                first = first_average_without(run.lines("rank0"), 2, cut_at, level=1)
                time.sleep(0.05)
            if first is None:
                fail(f"site a did not average without site b after the cut\n{run.coord_tail()}")
            took = first["unix_ms"] - cut_at
            if took > HEARTBEAT_MS + 1000:
                fail(f"site a's first average without site b came {took} ms after the cut "
                     f"(bound {HEARTBEAT_MS + 1000} ms)")
            report["site a went on after (ms)"] = took
            run.expect_exit(names[:2], 0, timeout_s=60)
            run.expect_exit(names[2:], 1, timeout_s=60)
            run.check_traces(names)
            for name in names[:2]:
                tail = [ln for ln in run.lines(name) if ln["unix_ms"] > cut_at + HEARTBEAT_MS
                        + 1000 and ln["action"] == "AVERAGE"]
                if any(sorted(ln["members"]) != [0, 1] for ln in tail):
                    fail(f"{name} averaged with site b after it was removed")
        else:
            # Strict: the coordinator declares site b dead; every worker learns that the
            # generation moved and exits with an error; nothing is half-averaged before that.
            run.expect_exit(names, 1, timeout_s=60)
            run.check_traces(names)
        for name in names[2:] + (names[:2] if not elastic else []):
            err = [ln for ln in run.stderr(name).strip().splitlines() if ln.strip()]
            report[name] = err[-1] if err else "(nothing on stderr)"
            if not err or not any(w in err[-1].lower() for w in
                                  ("generation", "removed", "dead", "evicted", "no longer")):
                fail(f"{name}'s error does not say what happened: {report[name]}")
        for name in names:
            ls = run.lines(name)
            report[f"{name} last step"] = ls[-1]["step"] if ls else None
        print(f"site_cut_{'elastic' if elastic else 'strict'}: " + json.dumps(report, indent=1))
    finally:
        run.close()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds, so that the cluster is removed


def gray_failure(args):
    """Rank 3 reaches the coordinator but not its peers: its peers' reports evict it."""
    run = Run(args, control=True, jobs=[job_spec("gray", [(2, 4)], mode="PERIODIC",
                                                 min_world=3)])
    try:
        steps = 200
        names = [f"rank{r}" for r in range(4)]
        for r, (host, _) in enumerate(WORKERS):
            run.start_worker(names[r], host, "gray", r, steps,
                             ["--step_delay_ms=50", f"--collective_timeout_ms={GRAY_TIMEOUT_MS}"])
        run.wait_for_step("rank0", 10)
        cut_at = now_ms()
        run.cluster.cut_host("w3")  # the data path only: its control link stays up
        bound = GRAY_TIMEOUT_MS + 1000
        deadline = time.monotonic() + 20
        first = None
        while first is None and time.monotonic() < deadline:
            first = first_average_without(run.lines("rank0"), 3, cut_at)
            time.sleep(0.05)
        if first is None:
            fail(f"rank 0 did not average without the gray rank 3 within 20 s of the cut\n"
                 f"{run.coord_tail()}")
        took = first["unix_ms"] - cut_at
        if took > bound:
            fail(f"the survivors' first average without rank 3 came {took} ms after the cut; "
                 f"the bound is the collective timeout + 1 s = {bound} ms\n{run.coord_tail()}")
        if sorted(first["members"]) != [0, 1, 2]:
            fail(f"the survivors averaged with ranks {first['members']}, expected [0, 1, 2]: "
                 f"the reports evicted a healthy member\n{run.coord_tail()}")
        # Rank 3 beat to the coordinator throughout: only the confirmed reports evicted it.
        rc = run.wait(["rank3"], timeout_s=40)["rank3"]
        err = [ln for ln in run.stderr("rank3").strip().splitlines() if ln.strip()]
        last_err = err[-1] if err else "(nothing on stderr)"
        if rc == 0 or not any(w in last_err.lower() for w in ("dead", "removed", "no longer")):
            fail(f"the gray rank 3 exited with {rc}; expected an error saying it was removed: "
                 f"{last_err}")
        run.expect_exit(names[:3], 0, timeout_s=60)
        n = run.check_traces(names)
        job = run.rpc("GetJob", {"job_id": "gray"})
        if int(job.get("deaths", 0)) != 1:
            fail(f"deaths {job.get('deaths')}, expected 1 (rank 3 only)\n{run.coord_tail()}")
        with open(run.coord_log.name) as f:
            log = f.read()
        # The death came from the confirmed reports (a heartbeat timeout would mean the control
        # link was cut too), and it was the only generation change before the workers left.
        changes = [ln for ln in log.splitlines() if "generation 1 -> 2" in ln]
        if not changes or "rank 3 unreachable by its peers" not in changes[0]:
            fail(f"generation 1 -> 2 was not rank 3 unreachable by its peers: {changes}\n"
                 f"{run.coord_tail()}")
        reports = log.count("reports its round at step")
        print(f"gray_failure: survivors went on {took} ms after the cut (bound {bound} ms) with "
              f"ranks {sorted(first['members'])}; {reports} peer failure reports; rank 3 said: "
              f"{last_err}; {n} lines checked")
    finally:
        run.close()


def main():
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator_bin")
    parser.add_argument("--trace_worker_bin")
    parser.add_argument("--rpc_bin")
    parser.add_argument("--scenario", choices=SCENARIOS)
    parser.add_argument("--rate_mbit", type=float, default=50)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        print("\n".join(SCENARIOS))
        return
    reason = nc.unavailable_reason()
    if reason:
        if os.environ.get("MODELAVG_REQUIRE_CLUSTER") == "1":
            fail(f"MODELAVG_REQUIRE_CLUSTER=1 but {reason}")
        print(f"SKIP: {reason} (set MODELAVG_REQUIRE_CLUSTER=1 to fail instead)")
        sys.exit(SKIP)
    for flag in ("coordinator_bin", "trace_worker_bin", "rpc_bin"):
        if not getattr(args, flag):
            fail(f"--{flag} is required")
    {"hierarchical": hierarchical, "coordinator_cut": coordinator_cut, "worker_cut": worker_cut,
     "site_cut_strict": lambda a: site_cut(a, elastic=False),
     "site_cut_elastic": lambda a: site_cut(a, elastic=True),
     "gray_failure": gray_failure,
     }[args.scenario](args)


if __name__ == "__main__":
    main()
