#!/usr/bin/python3
"""Chaos soak: many faults at once while a job trains, then a check of every averaging result.

An elastic job of 8 modelavg-trace-worker processes across the two sites of a namespace cluster
(tests/cluster/netcluster.py: w0-w3 in site a, w4-w7 in site b, 50 Mbit/s uplinks), a
coordinator pair (ca, cb) on a 3-member etcd (e0-e2), all on the core. For --seconds a driver
injects faults at random times and places:

  kill_worker   kill -9 of a worker; a replacement is started for its rank
  stop_worker   SIGSTOP of a worker for 0.5-4 s, then SIGCONT (past the heartbeat timeout it
                is evicted: it exits saying so, and a replacement is started)
  kill_leader   kill -9 of the coordinator that leads on etcd; started again 2-6 s later (a
                standby then)
  stop_etcd     SIGSTOP of the whole etcd cluster past the coordinators' lease TTL, then SIGCONT
  cut_site      a site's uplink cut for 1-4 s, then restored (the cross-site link)
  nan           a worker's parameters become NaN, +Inf or -Inf before one of its calls
                (--testing_nonfinite_at_step): one of the first 8 workers at a random step,
                and a replacement with probability 0.2 at a random step after its start; it
                must be excluded and retired, and the others go on
  strict_kill   a strict job of 4 workers on a host of its own (period 1, heartbeat timeout 3 s)
                and kill -9 of one: every survivor must fail, within the heartbeat timeout + 5 s

Then every worker is stopped with SIGTERM (each leaves the job), and the checker (check.py),
independent of the library, verifies from the workers' printed values and the rule alone
(tests/cluster/trace_rule.py) every averaging result of every member at every step, that each
fault was survived, and that nothing acknowledged was lost (check.py says how). It prints the
faults injected by kind, the faults survived, the averages checked and the first violation.

  sudo bench/chaos/run.py [--seconds=180] [--seed=N] [--build_dir=build] [--out_dir=DIR]
                          [--faults=kill_worker,stop_worker,...] [--seed_violation]
  bench/chaos/run.py --check_only=DIR [--seed_violation]    # check a kept run again

Needs root, iproute2, etcd (Debian's etcd-server) and the build's coordinator, trace worker,
modelavg-rpc and modelavg-health. Without root, namespaces or etcd it exits 77 saying why
(MODELAVG_REQUIRE_CLUSTER=1: exit 1 instead). The run's folder (kept with --out_dir, and on a
failure) holds every process's output, the fault log and run.json.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
sys.path.insert(0, HERE)
import netcluster as nc  # noqa: E402
import check as chaos_check  # noqa: E402

SKIP = 77
FAULTS = ["kill_worker", "stop_worker", "kill_leader", "stop_etcd", "cut_site", "nan",
          "strict_kill"]
# Relative frequency of each fault the driver injects at its ticks ("nan" comes from the
# workers started with a NaN step instead).
WEIGHTS = {"kill_worker": 4, "stop_worker": 3, "kill_leader": 2, "stop_etcd": 1, "cut_site": 2,
           "strict_kill": 2}
WORLD = 8
MIN_WORLD = 2
HEARTBEAT_MS = 2000
LEADER_TTL_MS = 2000
STRICT_HEARTBEAT_MS = 3000
# A strict job's survivors must have failed within this after the kill (the 3.5 s,
# with room for a loaded machine; a hang is much longer).
STRICT_BOUND_S = STRICT_HEARTBEAT_MS / 1000 + 5
COORD_PORT = 7000
STEP_DELAY_MS = 50
LEVELS = [(2, 4), (6, 8)]
JOB = "chaos"


def log(msg):
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def now_ms():
    return int(time.time() * 1000)


def averaging_step(step):
    """The first step at or after `step` where every live member averages (a multiple of the
    smallest period): a NaN set before a step that only skips would be printed, not averaged."""
    period = min(p for p, _ in LEVELS)
    return -(-step // period) * period


class Worker:
    """One trace worker process: its name, rank, host and files."""

    def __init__(self, run, name, job, rank, host, argv, nan_step=None):
        self.name, self.job, self.rank, self.host = name, job, rank, host
        self.nan_step = nan_step
        self.out_path = os.path.join(run.dir, f"{name}.out")
        self.err_path = os.path.join(run.dir, f"{name}.err")
        self.started_ms = now_ms()
        self.exited_ms = None
        self.returncode = None
        self.stopped = False
        self.killed_by = None  # the fault that killed it (its index in the log), if any
        self.terminated = False  # sent SIGTERM at the end of the run
        self.proc = run.cluster.popen(host, argv, stdout=open(self.out_path, "w"),
                                      stderr=open(self.err_path, "w"))

    def lines(self):
        try:
            with open(self.out_path) as f:
                return f.read().count("\n")
        except OSError:
            return 0

    def last_line(self):
        try:
            with open(self.out_path) as f:
                text = f.read()
        except OSError:
            return None
        rows = [r for r in text.split("\n")[:-1] if r.strip()]
        try:
            return json.loads(rows[-1]) if rows else None
        except json.JSONDecodeError:
            return None  # not a trace line: the checker reports it

    def poll(self):
        if self.returncode is None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            self.exited_ms = now_ms()
        return self.returncode

    def signal(self, sig):
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def record(self):
        return {"name": self.name, "job": self.job, "rank": self.rank, "host": self.host,
                "pid": self.proc.pid,
                "nan_step": self.nan_step, "started_ms": self.started_ms,
                "exited_ms": self.exited_ms, "returncode": self.returncode,
                "killed_by": self.killed_by, "terminated": self.terminated,
                "out": os.path.basename(self.out_path), "err": os.path.basename(self.err_path)}


class Run:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.dir = args.out_dir or tempfile.mkdtemp(prefix="modelavg-chaos-")
        os.makedirs(self.dir, exist_ok=True)
        self.bin = {name: os.path.join(args.build_dir, path) for name, path in (
            ("coordinator", "server/modelavg-coordinator"),
            ("trace_worker", "tools/modelavg-trace-worker"),
            ("rpc", "tools/modelavg-rpc"), ("health", "tools/modelavg-health"))}
        for name, path in self.bin.items():
            if not os.access(path, os.X_OK):
                raise SystemExit(f"FAIL: {path} is not built (cmake --build {args.build_dir} "
                                 f"--target modelavg-coordinator modelavg-trace-worker "
                                 f"modelavg-rpc modelavg-health)")
        hosts = [nc.Host(h, None) for h in ("e0", "e1", "e2", "ca", "cb", "st")]
        hosts += [nc.Host(f"w{r}", "a" if r < 4 else "b") for r in range(WORLD)]
        self.cluster = nc.Cluster(hosts, site_rate_mbit=args.rate_mbit)
        self.ip = {h: self.cluster.hosts[h].address for h in self.cluster.hosts}
        self.coordinators = ["ca", "cb"]
        self.addresses = ",".join(f"{self.ip[c]}:{COORD_PORT}" for c in self.coordinators)
        self.lock = threading.Lock()
        self.faults = []  # the fault log: dicts, in the order injected
        self.workers = []  # every Worker ever started
        self.current = {}  # rank -> the Worker holding (or trying to take) it
        self.pending = {}  # rank -> when to start its replacement
        self.incarnation = {}  # rank -> how many processes it had
        self.etcd = {}
        self.coords = {}
        self.cut = set()  # sites cut now
        self.coord_fault = False  # a kill_leader or stop_etcd in progress
        self.heals = []  # (when, what, fault index)
        self.strict_thread = None
        self.strict_runs = 0
        self.final = False

    # ---- infrastructure

    def start_etcd(self):
        members = ["e0", "e1", "e2"]
        peers = ",".join(f"{m}=http://{self.ip[m]}:2380" for m in members)
        for m in members:
            data = os.path.join(self.dir, "etcd", m)
            os.makedirs(data, exist_ok=True)
            self.etcd[m] = self.cluster.popen(m, [
                self.args.etcd_bin, f"--name={m}", f"--data-dir={data}",
                f"--listen-client-urls=http://{self.ip[m]}:2379",
                f"--advertise-client-urls=http://{self.ip[m]}:2379",
                f"--listen-peer-urls=http://{self.ip[m]}:2380",
                f"--initial-advertise-peer-urls=http://{self.ip[m]}:2380",
                f"--initial-cluster={peers}", "--initial-cluster-state=new",
                "--initial-cluster-token=chaos", "--heartbeat-interval=100",
                "--election-timeout=1000", "--logger=zap", "--log-level=warn"],
                stdout=open(os.path.join(self.dir, f"etcd-{m}.log"), "w"),
                stderr=subprocess.STDOUT)

    def start_coordinator(self, c):
        log_file = open(os.path.join(self.dir, f"coordinator-{c}.log"), "a")
        endpoints = ",".join(f"{self.ip[m]}:2379" for m in ("e0", "e1", "e2"))
        self.coords[c] = self.cluster.popen(c, [
            self.bin["coordinator"], f"--listen={self.ip[c]}:{COORD_PORT}",
            f"--advertise={self.ip[c]}:{COORD_PORT}", f"--etcd_endpoints={endpoints}",
            f"--leader_ttl_ms={LEADER_TTL_MS}", f"--jobs_file={self.jobs_file}",
            "--log_level=info"], stdout=log_file, stderr=subprocess.STDOUT)

    def serving(self, c):
        """Whether coordinator `c` serves (the leader's health is SERVING)."""
        out = self.cluster.run(c, [self.bin["health"], f"--coordinator={self.ip[c]}:{COORD_PORT}",
                                   "--rpc_timeout_ms=1000"], check=False, timeout=10)
        return out.returncode == 0

    def leader(self):
        for c in self.coordinators:
            if self.coords.get(c) is not None and self.coords[c].poll() is None and \
                    self.serving(c):
                return c
        return None

    def wait_leader(self, timeout_s):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            c = self.leader()
            if c is not None:
                return c
            time.sleep(0.2)
        return None

    def rpc(self, method, request, timeout_s=20):
        """A Coordinator RPC to the leader (whichever serves), retried until `timeout_s`."""
        end = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < end:
            for c in self.coordinators:
                out = self.cluster.run(c, [self.bin["rpc"],
                                           f"--coordinator={self.ip[c]}:{COORD_PORT}",
                                           "--rpc_timeout_ms=3000", "call",
                                           f"modelavg.v1.Coordinator/{method}",
                                           json.dumps(request)], check=False, timeout=15)
                if out.returncode == 0:
                    return json.loads(out.stdout or "{}")
                last = out.stderr.strip()
            time.sleep(0.3)
        raise RuntimeError(f"{method} failed for {timeout_s} s: {last}")

    # ---- workers

    def worker_argv(self, job, rank, host, world, steps, extra=()):
        return [self.bin["trace_worker"], f"--coordinator={self.addresses}", f"--job={job}",
                f"--rank={rank}", f"--world_size={world}", f"--steps={steps}", "--numel=256",
                f"--gloo_hostname={self.ip[host]}", "--unix_ms", "--log_level=info",
                "--join_timeout_ms=120000", *extra]

    def current_step(self):
        steps = [w.last_line()["step"] for w in self.current.values()
                 if w.returncode is None and w.last_line() is not None]
        return max(steps) if steps else 0

    def start_elastic(self, rank, nan_step=None):
        self.incarnation[rank] = self.incarnation.get(rank, 0) + 1
        name = f"r{rank}.{self.incarnation[rank]}"
        extra = [f"--step_delay_ms={STEP_DELAY_MS}", "--collective_timeout_ms=20000"]
        if nan_step is not None:
            extra += [f"--testing_nonfinite_at_step={nan_step}",
                      f"--testing_nonfinite_value={self.rng.choice(['nan', 'inf', '-inf'])}"]
        host = f"w{rank}"
        w = Worker(self, name, JOB, rank, host,
                   self.worker_argv(JOB, rank, host, WORLD, 10**9, extra), nan_step)
        self.workers.append(w)
        self.current[rank] = w
        return w

    def healthy(self):
        """Workers that run, are not stopped, and whose site is not cut."""
        return [w for w in self.current.values()
                if w.returncode is None and not w.stopped and w.lines() > 0
                and ("a" if w.rank < 4 else "b") not in self.cut]

    def tend_workers(self):
        """Notes exits and starts the replacements that are due."""
        t = time.monotonic()
        for rank, w in list(self.current.items()):
            if w.returncode is None and w.poll() is not None and w.nan_step is not None:
                # It reached its NaN step (its last line is the step before) unless a fault
                # ended it first.
                last = w.last_line()
                if w.killed_by is None and last is not None and last["step"] == w.nan_step - 1:
                    self.record_fault("nan", worker=w.name, rank=rank, step=w.nan_step)
                    log(f"fault {len(self.faults)}: nan in {w.name} at step {w.nan_step}")
            if w.returncode is not None and rank not in self.pending and not self.final:
                self.pending[rank] = t + 0.5
        for rank, when in list(self.pending.items()):
            if t < when or self.final:
                continue
            del self.pending[rank]
            nan_step = None
            if "nan" in self.args.faults and self.rng.random() < 0.2:
                nan_step = averaging_step(self.current_step() + self.rng.randint(30, 150))
            self.start_elastic(rank, nan_step)

    # ---- faults

    def record_fault(self, kind, **details):
        with self.lock:
            self.faults.append({"kind": kind, "at_ms": now_ms(), **details})
            return len(self.faults) - 1

    def inject(self, kind):
        healthy = self.healthy()
        if kind in ("kill_worker", "stop_worker"):
            if len(healthy) - 1 < MIN_WORLD + 1:
                return False
            w = self.rng.choice(healthy)
            if kind == "kill_worker":
                i = self.record_fault(kind, worker=w.name, rank=w.rank,
                                      step=(w.last_line() or {}).get("step"))
                w.killed_by = i
                w.signal(signal.SIGKILL)
            else:
                d = self.rng.uniform(0.5, 4.0)
                i = self.record_fault(kind, worker=w.name, rank=w.rank, seconds=round(d, 2),
                                      step=(w.last_line() or {}).get("step"))
                w.stopped = True
                w.signal(signal.SIGSTOP)
                self.heals.append((time.monotonic() + d, ("cont", w), i))
            return True
        if kind == "cut_site":
            if self.cut:
                return False
            site = self.rng.choice(["a", "b"])
            other = [w for w in healthy if ("a" if w.rank < 4 else "b") != site]
            if len(other) < MIN_WORLD + 1:
                return False
            d = self.rng.uniform(1.0, 4.0)
            i = self.record_fault(kind, site=site, seconds=round(d, 2))
            self.cut.add(site)
            self.cluster.cut_site(site)
            self.heals.append((time.monotonic() + d, ("restore", site), i))
            return True
        if kind == "kill_leader":
            if self.coord_fault:
                return False
            c = self.leader()
            if c is None:
                return False
            d = self.rng.uniform(2.0, 6.0)
            i = self.record_fault(kind, coordinator=c, restart_after_s=round(d, 2))
            self.coord_fault = True
            self.coords[c].kill()
            self.coords[c].wait()
            self.heals.append((time.monotonic() + d, ("restart", c), i))
            return True
        if kind == "stop_etcd":
            if self.coord_fault:
                return False
            d = LEADER_TTL_MS / 1000 + self.rng.uniform(0.5, 2.0)
            i = self.record_fault(kind, seconds=round(d, 2))
            self.coord_fault = True
            for p in self.etcd.values():
                os.kill(p.pid, signal.SIGSTOP)
            self.heals.append((time.monotonic() + d, ("etcd_cont", None), i))
            return True
        if kind == "strict_kill":
            if self.strict_thread is not None and self.strict_thread.is_alive():
                return False
            i = self.record_fault(kind)
            self.strict_thread = threading.Thread(target=self.strict_kill, args=(i,),
                                                  daemon=True)
            self.strict_thread.start()
            return True
        raise ValueError(kind)

    def heal_due(self, force=False):
        t = time.monotonic()
        due = [h for h in self.heals if force or h[0] <= t]
        self.heals = [h for h in self.heals if h not in due]
        for _, (what, target), i in due:
            if what == "cont":
                target.stopped = False
                target.signal(signal.SIGCONT)
            elif what == "restore":
                self.cluster.restore_site(target)
                self.cut.discard(target)
            elif what == "restart":
                self.start_coordinator(target)
                self.coord_fault = False
            elif what == "etcd_cont":
                for p in self.etcd.values():
                    os.kill(p.pid, signal.SIGCONT)
                self.coord_fault = False
            self.faults[i]["healed_ms"] = now_ms()

    def strict_kill(self, i):
        """A strict job of 4 on host st; one worker killed once every worker printed k lines;
        the survivors must all fail within STRICT_BOUND_S."""
        self.strict_runs += 1
        job = f"strict{self.strict_runs}"
        fault = self.faults[i]
        fault["job"] = job
        try:
            self.rpc("CreateJob", {"spec": {
                "job_id": job, "world_size": 4, "mode": "PERIODIC",
                "levels": [{"period": 1, "group_size": 4}],
                "heartbeat_timeout_ms": STRICT_HEARTBEAT_MS, "join_timeout_ms": 60000}},
                timeout_s=60)
        except RuntimeError as e:
            fault["error"] = f"CreateJob: {e}"
            return
        ws = []
        for r in range(4):
            w = Worker(self, f"{job}.r{r}", job, r, "st",
                       self.worker_argv(job, r, "st", 4, 10**9, ["--collective_timeout_ms=60000"]))
            with self.lock:
                self.workers.append(w)
            ws.append(w)
        at = self.rng.randint(1, 60)
        end = time.monotonic() + 90
        while time.monotonic() < end and min(w.lines() for w in ws) < at:
            if any(w.poll() is not None for w in ws):
                break
            time.sleep(0.01)
        if any(w.poll() is not None for w in ws) or min(w.lines() for w in ws) < at:
            fault["error"] = "the strict job did not run (a worker ended or it was too slow)"
            for w in ws:
                w.signal(signal.SIGKILL)
            return
        victim = self.rng.choice(ws)
        fault.update(worker=victim.name, rank=victim.rank, after_lines=at, at_ms=now_ms())
        victim.killed_by = i
        victim.signal(signal.SIGKILL)
        end = time.monotonic() + STRICT_BOUND_S + 30
        while time.monotonic() < end and any(w.poll() is None for w in ws if w is not victim):
            time.sleep(0.01)
        for w in ws:
            if w.poll() is None:  # a hang: kept running past the bound
                w.signal(signal.SIGKILL)
                w.killed_by = i
                w.proc.wait()
                w.poll()

    # ---- the run

    def write_jobs_file(self):
        self.jobs_file = os.path.join(self.dir, "jobs.json")
        spec = {"job_id": JOB, "world_size": WORLD, "warmup_steps": 0, "mode": "HIERARCHICAL",
                "levels": [{"period": p, "group_size": g} for p, g in LEVELS],
                "min_world_size": MIN_WORLD, "heartbeat_timeout_ms": HEARTBEAT_MS,
                "join_timeout_ms": 120000}
        with open(self.jobs_file, "w") as f:
            json.dump({"jobs": [spec]}, f)
        return spec

    def main(self):
        args = self.args
        spec = self.write_jobs_file()
        log(f"seed {args.seed}; {args.seconds} s of faults {','.join(args.faults)}; "
            f"folder {self.dir}")
        self.start_etcd()
        for c in self.coordinators:
            self.start_coordinator(c)
        if self.wait_leader(60) is None:
            raise RuntimeError("no coordinator leads 60 s after the start")
        nan_rank = self.rng.randrange(WORLD) if "nan" in args.faults else None
        for r in range(WORLD):
            self.start_elastic(r, nan_step=averaging_step(self.rng.randint(100, 400))
                               if r == nan_rank else None)
        end = time.monotonic() + 120
        while time.monotonic() < end and min(w.lines() for w in self.current.values()) < 5:
            if any(w.poll() is not None for w in self.current.values()):
                raise RuntimeError("a worker ended before the job ran: " + open(
                    next(w for w in self.current.values() if w.returncode is not None)
                    .err_path).read()[-2000:])
            time.sleep(0.1)
        log("the job runs; injecting faults")
        start = time.monotonic()
        next_fault = start + self.rng.uniform(1, 3)
        kinds = [k for k in args.faults if k in WEIGHTS]
        weights = [WEIGHTS[k] for k in kinds]
        while time.monotonic() < start + args.seconds:
            self.tend_workers()
            self.heal_due()
            if kinds and time.monotonic() >= next_fault:
                kind = self.rng.choices(kinds, weights)[0]
                if self.inject(kind):
                    f = self.faults[-1]
                    log(f"fault {len(self.faults)}: {kind} " + json.dumps(
                        {k: v for k, v in f.items() if k not in ('kind', 'at_ms')}))
                    next_fault = time.monotonic() + self.rng.uniform(0.5, 1.5) * args.mean_gap_s
                else:
                    next_fault = time.monotonic() + 0.5
            time.sleep(0.05)
        log(f"{len(self.faults)} faults injected; healing and letting the job settle")
        self.heal_due(force=True)
        if self.strict_thread is not None:
            self.strict_thread.join(timeout=STRICT_BOUND_S + 120)
        self.settle()
        self.finish()

    def settle(self, timeout_s=120):
        """Until every rank has a live worker and a whole-world average of all 8 came after the
        last fault healed (or the timeout)."""
        healed_ms = now_ms()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.tend_workers()
            live = [w for w in self.current.values() if w.returncode is None]
            if len(live) == WORLD:
                lines = [w.last_line() for w in live]
                if all(ln is not None and ln.get("unix_ms", 0) > healed_ms for ln in lines):
                    full = any(ln["level"] == len(LEVELS) - 1 and len(ln["members"]) == WORLD
                               for w in live for ln in self.tail_lines(w, 20)
                               if ln.get("unix_ms", 0) > healed_ms)
                    if full:
                        return True
            time.sleep(0.2)
        log("the job did not get back to all 8 ranks in time; stopping it as it is")
        return False

    @staticmethod
    def tail_lines(w, n):
        try:
            with open(w.out_path) as f:
                rows = [r for r in f.read().split("\n")[:-1] if r.strip()]
        except OSError:
            return []
        return [json.loads(r) for r in rows[-n:]]

    def finish(self):
        self.final = True
        live = [w for w in self.current.values() if w.poll() is None]
        for w in live:
            w.terminated = True
            w.signal(signal.SIGTERM)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(w.poll() is None for w in live):
            time.sleep(0.05)
        for w in self.workers:
            if w.poll() is None:
                w.signal(signal.SIGKILL)
                w.proc.wait()
                w.poll()
        try:
            final = self.rpc("GetJob", {"job_id": JOB}, timeout_s=60)
        except RuntimeError as e:
            final = {"error": str(e)}
        for c, p in self.coords.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in self.etcd.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        with open(os.path.join(self.dir, "run.json"), "w") as f:
            json.dump({"seed": self.args.seed, "seconds": self.args.seconds,
                       "faults_enabled": self.args.faults, "world": WORLD,
                       "min_world": MIN_WORLD, "levels": LEVELS,
                       "heartbeat_ms": HEARTBEAT_MS, "leader_ttl_ms": LEADER_TTL_MS,
                       "strict_bound_s": STRICT_BOUND_S, "faults": self.faults,
                       "workers": [w.record() for w in self.workers], "final_job": final},
                      f, indent=1)

    def close(self):
        self.cluster.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--build_dir", default=os.path.join(REPO, "build"))
    p.add_argument("--out_dir", default=None, help="keep the run here (default: a temporary "
                                                    "folder, kept only on a failure)")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--mean_gap_s", type=float, default=5.0,
                   help="mean time between faults (each gap uniform in 0.5-1.5 times it)")
    p.add_argument("--rate_mbit", type=float, default=50)
    p.add_argument("--etcd_bin", default=os.environ.get("MODELAVG_ETCD_BIN", "/usr/bin/etcd"))
    p.add_argument("--check_only", default=None, help="check a kept run's folder again")
    p.add_argument("--seed_violation", action="store_true",
                   help="then perturb one average of the traces and require the checker to "
                        "find it (a checker that cannot fail proves nothing)")
    args = p.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown or not args.faults:
        p.error(f"--faults: unknown {unknown}; choose from {FAULTS}")
    if args.check_only:
        return chaos_check.report(args.check_only, seed_violation=args.seed_violation)
    reason = nc.unavailable_reason()
    if reason is None and not os.access(args.etcd_bin, os.X_OK):
        reason = f"no etcd at {args.etcd_bin} (install etcd-server: bash deploy/install_deps.sh)"
    if reason:
        if os.environ.get("MODELAVG_REQUIRE_CLUSTER") == "1":
            print(f"FAIL: MODELAVG_REQUIRE_CLUSTER=1 but {reason}", file=sys.stderr)
            return 1
        print(f"SKIP: {reason} (set MODELAVG_REQUIRE_CLUSTER=1 to fail instead)")
        return SKIP
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    keep = args.out_dir is not None
    run = Run(args)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)  # unwinds: the cluster is removed
    signal.signal(signal.SIGTERM, on_term)
    try:
        run.main()
    finally:
        run.close()
    code = chaos_check.report(run.dir, seed_violation=args.seed_violation)
    if code == 0 and not keep:
        shutil.rmtree(run.dir, ignore_errors=True)
    elif code != 0:
        print(f"the run is kept in {run.dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
