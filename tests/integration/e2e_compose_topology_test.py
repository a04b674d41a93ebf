#!/usr/bin/python3
"""Runs deploy/docker-compose.yml's topology as plain processes on loopback.

No container engine is needed: the services of the default profile that run modelavg's image are
started from this build's binaries (and Debian's etcd) with exactly the compose file's commands,
flags and environment, with these substitutions only:
  * a service's host name (its name or `hostname:`) -> 127.0.0.1, as the value of a --*host or
    --*hostname flag and in HOST:PORT, also inside URLs
    (http://etcd:2379) and comma-separated lists (--coordinator=A:P,B:P);
  * a port a service listens on (--flag=0.0.0.0:PORT) -> 127.0.0.1:0, the port the service
    reports in its port file (--port_file for --listen, --metrics_port_file for --metrics_listen)
    used everywhere that service's PORT is named (SERVICE:PORT, or 127.0.0.1:PORT inside the
    service itself). Where the test must know the port before the service starts (a service that
    names its own address, --advertise=coordinator-a:50051; a URL, --listen-client-urls=
    http://0.0.0.0:2379, which has no port file), a free loopback port picked by the test;
  * a path under a bind mount's mount point -> the mounted file in the repository; under a named
    volume's -> a folder of its own in the test's temporary folder.
${VARIABLE:-default} is replaced as compose does. `depends_on: {condition: service_healthy}` is
honoured by running the service's healthcheck command until it passes.

Coordinators on etcd (--etcd_endpoints) are started together: exactly one must turn healthy (the
leader) while the health of the others says NOT_SERVING and their answers name the leader. When
worker-0 is a tenth into the second (every-step) job, the leader is killed (SIGKILL): a standby
must turn healthy, every worker must re-attach to it, finish (exit 0, final losses printed); the
killed coordinator, started again, must be a standby. Every coordinator left must shut down
cleanly on SIGTERM.

With --stop_mid_run the leader is not killed: when worker-0 is a tenth into the first job, every
worker is sent SIGTERM, as `docker compose down` and `podman stop` send it (through the init that
the compose file runs each service under: `init: true`, checked here for every service): each
must leave the job and exit within 2 s with 128 + SIGTERM (143: it stopped on the signal, nobody
killed it), saying that it left, and the job must be FINISHED (every rank LEFT).

Without an etcd binary (/usr/bin/etcd, Debian's etcd-server, or $MODELAVG_ETCD_BIN), or with a
coordinator built without etcd support, the test is skipped (77), saying why; with
MODELAVG_REQUIRE_ETCD=1 (CI) it fails instead.

  e2e_compose_topology_test.py --binary=modelavg-coordinator=PATH --binary=modelavg-demo=PATH ...
"""

import argparse
import atexit
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

COMPOSE = os.path.join(mt.REPO_ROOT, "deploy", "docker-compose.yml")
HOSTPORT = re.compile(r"^([A-Za-z0-9_.-]+):(\d+)$")
# HOST:PORT inside a value, optionally after a URL scheme: "http://etcd:2379", "a:1,b:2".
EMBEDDED = re.compile(r"(^|[,=])((?:[a-z]+://)?)([A-Za-z0-9_.-]+):(\d+)")
SKIP = 77


# The flag through which a listening flag's bound address is reported (port 0 + port file).
PORT_FILE_FLAG = {"--listen": "--port_file", "--metrics_listen": "--metrics_port_file"}


def interpolate(text):
    """Compose's ${NAME} and ${NAME:-default}, from this process's environment."""
    def value(m):
        name, default = m.group(1), m.group(3)
        got = os.environ.get(name)
        if got is None or (got == "" and m.group(2) == ":-"):
            return default or ""
        return got
    return re.sub(r"\$\{(\w+)(:?-([^}]*))?\}", value, text)


def as_argv(command):
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def health_test(svc):
    """The service's healthcheck command, or None (none, `disable: true` or `test: ["NONE"]`)."""
    health = svc.get("healthcheck") or {}
    test = health.get("test")
    if not test or health.get("disable") or test in (["NONE"], "NONE"):
        return None
    return test


def parse_duration(text, default):
    if text is None:
        return default
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", str(text))
    if not m:
        return default
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value * 60 if m.group(2) == "m" else value


class Topology:
    def __init__(self, compose, binaries, volumes_dir):
        self.binaries = binaries
        self.volumes_dir = volumes_dir
        services = compose["services"]
        # The default profile, modelavg's image only (e.g. the grpcurl service has a profile).
        self.services = {n: s for n, s in services.items()
                         if not s.get("profiles") and str(s.get("image", "")).startswith(
                             "modelavg")}
        self.hosts = {}
        for name, svc in self.services.items():
            self.hosts[name] = name
            if svc.get("hostname"):
                self.hosts[svc["hostname"]] = name
        self.ports = {}  # (service, container port) -> loopback port, once the service reports it
        self.port_files = {}  # service -> [(container port, port file)] to read once started
        self.work_dir = None  # where the port files go (set before the first rewrite)

    def own_hosts(self, service):
        return {h for h, owner in self.hosts.items() if owner == service}

    def plan_ports(self, free_port):
        """Picks the ports the test must know before a service starts: those of URLs it listens
        on (no port file reports them) and those of its listening flags that it names itself
        (--advertise=coordinator-a:50051)."""
        for service, svc in self.services.items():
            args = [a.split("=", 1) for a in as_argv(svc.get("command"))[1:]
                    if a.startswith("--") and "=" in a]
            listens = set()
            for flag, value in args:
                m = HOSTPORT.match(value)
                if m and m.group(1) in ("0.0.0.0", "[::]"):
                    listens.add(int(m.group(2)))
                    continue
                for _, _, host, port in EMBEDDED.findall(value):
                    if host in ("0.0.0.0", "[::]"):
                        self.ports.setdefault((service, int(port)), free_port())
            for flag, value in args:
                for _, _, host, port in EMBEDDED.findall(value):
                    if host in self.own_hosts(service) and int(port) in listens:
                        self.ports.setdefault((service, int(port)), free_port())

    def map_addresses(self, service, value):
        """Every HOST:PORT (bare, in a URL or in a comma-separated list) of a service ->
        127.0.0.1:its port."""
        def one(m):
            scheme, host, port = m.group(2), m.group(3), int(m.group(4))
            owner = service if host in ("0.0.0.0", "[::]", "127.0.0.1", "localhost") \
                else self.hosts.get(host)
            if owner is None:
                return m.group(0)
            if (owner, port) not in self.ports:
                mt.fail(f"{service} names {host}:{port}, a port of {owner} that is not known yet "
                        f"(is {owner} started after {service}?)")
            return f"{m.group(1)}{scheme}127.0.0.1:{self.ports[(owner, port)]}"
        return EMBEDDED.sub(one, value)

    def rewrite(self, service, argv):
        svc = self.services[service]
        mounts = []
        for vol in svc.get("volumes", []):
            parts = vol.split(":")
            source, target = parts[0], parts[1]
            if source.startswith((".", "/")):
                mounts.append((target, os.path.normpath(os.path.join(os.path.dirname(COMPOSE),
                                                                     source))))
            else:  # a named volume
                path = os.path.join(self.volumes_dir, source)
                os.makedirs(path, exist_ok=True)
                mounts.append((target, path))
        out = [self.binaries[argv[0]]]
        for arg in argv[1:]:
            if not (arg.startswith("--") and "=" in arg):
                out.append(arg)
                continue
            flag, value = arg.split("=", 1)
            m = HOSTPORT.match(value)
            if m and m.group(1) in ("0.0.0.0", "[::]"):
                if flag not in PORT_FILE_FLAG:
                    mt.fail(f"{service}: {flag} listens on {value}, but this test knows no port "
                            f"file flag that reports its bound port")
                port = int(m.group(2))
                path = os.path.join(self.work_dir, f"{service}{flag[1:]}.port")
                if (port, path) not in self.port_files.setdefault(service, []):
                    self.port_files[service].append((port, path))
                out.append(f"{flag}=127.0.0.1:{self.ports.get((service, port), 0)}")
                out.append(f"{PORT_FILE_FLAG[flag]}={path}")
                continue
            mapped = self.map_addresses(service, value)
            if mapped != value:
                value = mapped
            elif value in self.hosts and flag.endswith(("host", "hostname")):
                value = "127.0.0.1"
            else:
                for target, source in mounts:
                    if value == target or value.startswith(target.rstrip("/") + "/"):
                        value = source + value[len(target):]
            out.append(f"{flag}={value}")
        return out

    def read_ports(self, service, proc, timeout_s=30):
        """Waits for the port files of a service just started; records its bound ports."""
        for container_port, path in self.port_files.get(service, []):
            deadline = time.monotonic() + timeout_s
            text = ""
            while not text.endswith("\n"):
                if proc.poll() is not None:
                    mt.fail(f"{service} exited with {proc.returncode} before writing {path}")
                if time.monotonic() > deadline:
                    mt.fail(f"{service} wrote no {os.path.basename(path)} within {timeout_s} s")
                time.sleep(0.05)
                text = open(path).read() if os.path.exists(path) else ""
            m = HOSTPORT.match(text.strip())
            if not m:
                mt.fail(f"{service}: {path} says {text.strip()!r}, not HOST:PORT")
            picked = self.ports.get((service, container_port))
            if picked is not None and picked != int(m.group(2)):
                mt.fail(f"{service} listens on {m.group(2)}, not on the port it was given, {picked}")
            self.ports[(service, container_port)] = int(m.group(2))

    def environment(self, service):
        env = dict(os.environ)
        declared = self.services[service].get("environment") or {}
        if isinstance(declared, list):
            declared = dict(item.split("=", 1) for item in declared)
        env.update({k: str(v) for k, v in declared.items()})
        return env

    def start_order(self):
        order, seen = [], set()

        def visit(name, path=()):
            if name in seen:
                return
            if name in path:
                mt.fail(f"docker-compose.yml: dependency cycle through {name}")
            for dep in (self.services[name].get("depends_on") or {}):
                if dep in self.services:
                    visit(dep, path + (name,))
            seen.add(name)
            order.append(name)

        for name in self.services:
            visit(name)
        return order

    def health_once(self, service):
        """Runs the service's healthcheck once: (passed, what it printed)."""
        test = health_test(self.services[service])
        if test[0] == "CMD-SHELL":
            mt.fail(f"{service}: CMD-SHELL healthchecks are not supported by this test")
        argv = self.rewrite(service, test[1:])
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                             env=self.environment(service))
        return out.returncode == 0, (out.stdout + out.stderr).strip()

    def health_deadline(self, service):
        health = self.services[service].get("healthcheck") or {}
        interval = parse_duration(health.get("interval"), 2.0)
        retries = int(health.get("retries", 3))
        start_period = parse_duration(health.get("start_period"), 0.0)
        return time.monotonic() + start_period + interval * (retries + 1) + 5, interval

    def wait_healthy(self, service, proc):
        if not health_test(self.services[service]):
            return
        deadline, interval = self.health_deadline(service)
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                mt.fail(f"{service} exited with {proc.returncode} before becoming healthy")
            ok, last = self.health_once(service)
            if ok:
                print(f"[{service}] healthy: {last}", flush=True)
                return
            time.sleep(min(interval, 0.5))
        mt.fail(f"{service} never became healthy; last healthcheck: {last}")

    def advertised(self, service):
        """The address a coordinator on etcd advertises (as rewritten), or its --listen."""
        argv = self.rewrite(service, as_argv(self.services[service]["command"]))
        value = next((a.split("=", 1)[1] for a in argv if a.startswith("--advertise=")), None)
        return value or f"127.0.0.1:{self.ports[(service, 50051)]}"

    def wait_one_leader(self, group, procs, timeout_s=None):
        """Exactly one of the coordinators on etcd turns healthy; the others' health says
        NOT_SERVING and their answers name the leader. Returns the leader."""
        deadline, interval = self.health_deadline(group[0])
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
        states = {}
        while time.monotonic() < deadline:
            for name in group:
                if procs[name].poll() is not None:
                    mt.fail(f"{name} exited with {procs[name].returncode}")
            states = {name: self.health_once(name) for name in group}
            leaders = [n for n, (ok, _) in states.items() if ok]
            if len(leaders) > 1:
                mt.fail(f"two coordinators are SERVING at once: {states}")
            if leaders:
                leader = leaders[0]
                break
            time.sleep(min(interval, 0.2))
        else:
            mt.fail(f"no coordinator of {group} became healthy (the leader): {states}")
        import grpc
        want = f"is a standby; the leader is at {self.advertised(leader)}"
        for name in group:
            if name == leader:
                continue
            ok, text = states[name]
            if "NOT_SERVING" not in text:
                mt.fail(f"{name}, a standby, should report NOT_SERVING; its health check said "
                        f"{text!r}")
            end = time.monotonic() + 20
            while True:  # (until the standby has read the leader key)
                try:
                    mt.list_jobs(self.advertised(name), timeout_s=5)
                    mt.fail(f"{name}, a standby, answered ListJobs")
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and want in (e.details() or ""):
                        break
                    if time.monotonic() > end:
                        mt.fail(f"{name}, a standby, answered ListJobs with {e.code()} "
                                f"{e.details()!r}, not UNAVAILABLE naming the leader ({want})")
                time.sleep(0.2)
        jobs = sorted(j.spec.job_id for j in mt.list_jobs(self.advertised(leader)))
        print(f"[{leader}] leads (jobs {jobs}); standby: {[n for n in group if n != leader]} "
              f"(NOT_SERVING, names the leader)", flush=True)
        return leader


def stop_mid_run(args, topo, procs, logs, workers, leader, steps, deadline):
    """SIGTERM to every worker a tenth into the first job, as `docker compose down` and `podman
    stop` send it: each leaves the job and exits with 143 within args.stop_bound_s; the job is
    FINISHED. Returns the figures."""
    job = next(a.split("=", 1)[1] for a in as_argv(topo.services[workers[0]]["command"])
               if a.startswith("--job="))
    stop_at = max(2, steps // 10)
    step_line = re.compile(re.escape(job) + r" step +(\d+)/")
    while True:
        seen = [int(m.group(1)) for m in step_line.finditer(open(logs[workers[0]]).read())]
        if seen and max(seen) >= stop_at:
            break
        done = [n for n in workers if procs[n].poll() is not None]
        if done or time.monotonic() > deadline:
            mt.fail(f"no stop: {done or 'no worker'} ended before {workers[0]} reached step "
                    f"{stop_at} of {job}:\n{open(logs[workers[0]]).read()[-2000:]}")
        time.sleep(0.05)
    print(f"{workers[0]} is at step {max(seen)} of {steps} of {job}: SIGTERM to every worker",
          flush=True)
    sent = time.monotonic()
    for name in workers:
        procs[name].send_signal(signal.SIGTERM)
    took, problems = {}, []
    for name in workers:
        try:
            procs[name].wait(timeout=max(0.1, sent + args.stop_bound_s - time.monotonic()))
            took[name] = time.monotonic() - sent
        except subprocess.TimeoutExpired:
            procs[name].kill()
            procs[name].wait()
            problems.append(f"{name} still ran {args.stop_bound_s} s after SIGTERM (killed)")
            continue
        text = open(logs[name]).read()
        if procs[name].returncode != 128 + signal.SIGTERM:
            problems.append(f"{name} exited with {procs[name].returncode}, not 143 (stopped on "
                            f"SIGTERM):\n{text[-2000:]}")
        elif f"stopped by SIGTERM" not in text or f"left job {job}" not in text:
            problems.append(f"{name} did not say that it left job {job}:\n{text[-2000:]}")
    if problems:
        mt.fail("the workers did not stop cleanly on SIGTERM:\n" + "\n".join(problems))
    state = None
    end = time.monotonic() + 10
    while time.monotonic() < end:
        got = mt.get_job(topo.advertised(leader), job)
        pb, _ = mt.coordinator_stubs()
        state = pb.JobState.Name(got.state)
        members = {m.rank: pb.MemberState.Name(m.state) for m in got.members}
        if state == "FINISHED":
            break
        time.sleep(0.1)
    if state != "FINISHED":
        mt.fail(f"after every worker left, job {job} is {state} (members {members}), "
                "not FINISHED")
    figures = {"slowest exit (s)": max(took.values())}
    print(f"[figures] exits after SIGTERM: " +
          ", ".join(f"{n} {t:.2f} s" for n, t in took.items()) + f"; job {job} {state}",
          flush=True)
    return figures


def etcd_binary():
    path = os.environ.get("MODELAVG_ETCD_BIN") or "/usr/bin/etcd"
    return path if os.access(path, os.X_OK) else None


def skip_or_fail(why):
    if os.environ.get("MODELAVG_REQUIRE_ETCD") == "1":
        mt.fail(f"MODELAVG_REQUIRE_ETCD=1 but {why}")
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", action="append", default=[], help="NAME=PATH of a built program")
    p.add_argument("--timeout_s", type=float, default=400)
    p.add_argument("--steps", type=int, default=601,
                   help="the workers' --steps (MODELAVG_DEMO_STEPS, unless set)")
    p.add_argument("--step_delay_ms", type=int, default=10,
                   help="the workers' --step_delay_ms (MODELAVG_DEMO_STEP_DELAY_MS, unless set): "
                        "long enough for the leader to be killed in the middle of a job")
    p.add_argument("--stop_mid_run", action="store_true",
                   help="instead of killing the leader, stop every worker with SIGTERM in the "
                        "middle of the first job")
    p.add_argument("--stop_bound_s", type=float, default=2.0,
                   help="--stop_mid_run: how soon after SIGTERM every worker must have exited")
    args = p.parse_args()
    binaries = dict(pair.split("=", 1) for pair in args.binary)
    os.environ.setdefault("MODELAVG_DEMO_STEPS", str(args.steps))
    os.environ.setdefault("MODELAVG_DEMO_STEP_DELAY_MS", str(args.step_delay_ms))
    steps = int(os.environ["MODELAVG_DEMO_STEPS"])
    with open(COMPOSE) as f:
        compose = yaml.safe_load(interpolate(f.read()))
    if any(as_argv(s.get("command"))[:1] == ["etcd"] for s in compose["services"].values()):
        etcd = etcd_binary()
        if etcd is None:
            skip_or_fail("docker-compose.yml runs etcd and there is no etcd binary (/usr/bin/etcd "
                         "or $MODELAVG_ETCD_BIN): install etcd-server (bash deploy/install_deps.sh)")
        binaries["etcd"] = etcd
    # Every service's log, port files and named volumes, in a folder removed on any exit (failures
    # print the log tails first).
    logs_dir = tempfile.mkdtemp(prefix="modelavg-topology-")
    atexit.register(shutil.rmtree, logs_dir, True)
    topo = Topology(compose, binaries, os.path.join(logs_dir, "volumes"))
    workers = [n for n, s in topo.services.items() if not health_test(s)]
    servers = [n for n in topo.services if n not in workers]
    ha = [n for n in servers
          if any(a.startswith("--etcd_endpoints=") for a in as_argv(
              topo.services[n]["command"]))]
    if not servers or len(workers) < 2:
        mt.fail(f"unexpected topology: servers {servers}, workers {workers}")
    for name, svc in topo.services.items():
        program = as_argv(svc.get("command"))[:1]
        if not program or program[0] not in binaries:
            mt.fail(f"service {name} runs {program}, not a program of this build "
                    f"({', '.join(sorted(binaries))})")
    # Every program runs under an init (PID 1 forwards the stop signal and reaps).
    no_init = [n for n in topo.services if topo.services[n].get("init") is not True]
    if no_init:
        mt.fail(f"docker-compose.yml: services without `init: true`: {no_init}")
    if ha and len(ha) < 2:
        mt.fail(f"docker-compose.yml: one coordinator on etcd ({ha}); expected a leader and a "
                "standby")

    def free_port():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    topo.work_dir = logs_dir
    topo.plan_ports(free_port)
    procs = {}
    logs = {}
    killed = {}  # the killed leader's process
    figures = {}
    with mt.ProcessGroup() as group:
        def start(name):
            argv = topo.rewrite(name, as_argv(topo.services[name]["command"]))
            print(f"[{name}] {' '.join(argv)}", flush=True)
            log_path = os.path.join(logs_dir, f"{name}.log")
            logs[name] = log_path
            for _, path in topo.port_files.get(name, []):  # a restart's: written anew
                if os.path.exists(path):
                    os.remove(path)
            procs[name] = group.start(argv, name, env=topo.environment(name),
                                      stdout=open(log_path, "a"), stderr=subprocess.STDOUT)
            try:
                topo.read_ports(name, procs[name])
            except SystemExit:
                text = open(log_path).read()
                print(text[-3000:])
                if "built without etcd support" in text:
                    skip_or_fail(f"{name}: this modelavg-coordinator was built without etcd "
                                 "support")
                raise

        leader = None
        for name in topo.start_order():
            if ha and name not in ha and all(n in procs for n in ha) and leader is None:
                leader = topo.wait_one_leader(ha, procs)
            start(name)
            if name in servers and name not in ha:
                topo.wait_healthy(name, procs[name])
        if ha and leader is None:
            leader = topo.wait_one_leader(ha, procs)

        deadline = time.monotonic() + args.timeout_s
        if args.stop_mid_run:
            figures = stop_mid_run(args, topo, procs, logs, workers, leader, steps, deadline)
        elif ha:
            # The leader killed a tenth into the every-step job: a standby takes over, the workers
            # ride through and re-attach to it.
            kill_at = max(1, steps // 10)
            step_line = re.compile(r"demo-every-step step +(\d+)/")
            while True:
                seen = [int(m.group(1)) for m in step_line.finditer(open(logs[workers[0]]).read())]
                if seen and max(seen) >= kill_at:
                    break
                done = [n for n in workers if procs[n].poll() is not None]
                if done or time.monotonic() > deadline:
                    mt.fail(f"no leader kill: {done or 'no worker'} stopped before "
                            f"{workers[0]} reached step {kill_at} of demo-every-step "
                            f"(last: {seen[-1:]}):\n{open(logs[workers[0]]).read()[-2000:]}")
                time.sleep(0.05)
            print(f"{workers[0]} is at step {max(seen)} of {steps} of demo-every-step: killing "
                  f"the leader {leader} (SIGKILL)", flush=True)
            t0 = time.monotonic()
            procs[leader].kill()
            procs[leader].wait()
            killed[leader] = procs[leader]
            rest = [n for n in ha if n != leader]
            new_leader = topo.wait_one_leader(rest, procs, timeout_s=60)
            figures["kill -> standby serving"] = time.monotonic() - t0
            print(f"[figures] {leader} killed -> {new_leader} healthy in "
                  f"{figures['kill -> standby serving']:.2f} s", flush=True)
            # The killed coordinator, started again, is a standby of the new leader.
            start(leader)
            if topo.wait_one_leader(ha, procs, timeout_s=30) != new_leader:
                mt.fail(f"{leader}, started again, took the leadership from {new_leader}")

        failed = []
        for name in workers if not args.stop_mid_run else []:
            try:
                rc = procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs[name].kill()
                rc = "killed after the deadline"
            if rc != 0:
                failed.append((name, rc))
        for name in workers:
            tail = open(logs[name]).read().splitlines()
            print(f"---- {name} ({len(tail)} lines, last 4) ----")
            print("\n".join(tail[-4:]))
        stopped = {}
        for name in reversed(topo.start_order()):  # the coordinators before etcd
            proc = procs[name]
            if name not in servers:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            stopped[name] = proc.returncode
    problems = [f"{n} exited with {rc}:\n{open(logs[n]).read()[-2000:]}" for n, rc in failed]
    # (etcd ends itself with the signal it handled: -SIGTERM is its clean exit.)
    clean = {n: (0, -signal.SIGTERM) if as_argv(topo.services[n]["command"])[:1] == ["etcd"]
             else (0,) for n in stopped}
    problems += [f"{n} exited with {rc} after SIGTERM:\n{open(logs[n]).read()[-2000:]}"
                 for n, rc in stopped.items() if rc not in clean[n]]
    for name in workers if not args.stop_mid_run else []:
        text = open(logs[name]).read()
        if not any(n == name for n, _ in failed) and "final loss" not in text:
            problems.append(f"{name} exited 0 but printed no final loss")
        if killed and "re-attached to job demo-every-step" not in text:
            problems.append(f"{name} did not re-attach to job demo-every-step after the leader "
                            f"was killed:\n{text[-2000:]}")
    if problems:
        mt.fail("the compose topology did not run cleanly:\n" + "\n".join(problems))
    if args.stop_mid_run:
        print(f"PASS: the {len(workers)} workers of docker-compose.yml, sent SIGTERM mid-job, "
              f"left it and exited with 143 within {args.stop_bound_s} s (slowest "
              f"{figures['slowest exit (s)']:.2f} s); the job is FINISHED")
        return 0
    print(f"PASS: {len(servers)} server(s) and {len(workers)} workers of docker-compose.yml ran "
          "to completion on loopback" +
          (f"; the leader {list(killed)[0]} was killed mid-job and a standby took over"
           if killed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
