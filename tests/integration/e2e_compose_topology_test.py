#!/usr/bin/python3
"""Runs deploy/docker-compose.yml's topology as plain processes on loopback.

No container engine is needed: the services of the default profile that run modelavg's image are
started from this build's binaries with exactly the compose file's commands, flags and
environment, with these substitutions only:
  * a service's host name (its name or `hostname:`) -> 127.0.0.1;
  * a port a service listens on (--flag=0.0.0.0:PORT) -> 127.0.0.1:0, the port the service
    reports in its port file (--port_file for --listen, --metrics_port_file for --metrics_listen)
    used everywhere that service's PORT is named (SERVICE:PORT, or 127.0.0.1:PORT inside the
    service itself); no port is picked by the test;
  * a path under a bind mount's mount point -> the mounted file in the repository; under a named
    volume's -> a folder of its own in the test's temporary folder.
${VARIABLE:-default} is replaced as compose does. `depends_on: {condition: service_healthy}` is
honoured by running the service's healthcheck command until it passes. The test passes when every worker exits 0 and the coordinator shuts
down cleanly on SIGTERM.

  e2e_compose_topology_test.py --binary=modelavg-coordinator=PATH --binary=modelavg-demo=PATH ...
"""

import argparse
import atexit
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

COMPOSE = os.path.join(mt.REPO_ROOT, "deploy", "docker-compose.yml")
HOSTPORT = re.compile(r"^([A-Za-z0-9_.-]+):(\d+)$")


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
                path = os.path.join(self.work_dir, f"{service}{flag[1:]}.port")
                self.port_files.setdefault(service, []).append((int(m.group(2)), path))
                out.append(f"{flag}=127.0.0.1:0")
                out.append(f"{PORT_FILE_FLAG[flag]}={path}")
                continue
            if m:
                host, port = m.group(1), int(m.group(2))
                owner = service if host in ("0.0.0.0", "[::]", "127.0.0.1", "localhost") \
                    else self.hosts.get(host)
                if owner is not None:
                    port = self.ports.get((owner, port), port)
                    value = f"127.0.0.1:{port}"
            elif value in self.hosts:
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

    def wait_healthy(self, service, proc):
        health = self.services[service].get("healthcheck") or {}
        test = health_test(self.services[service])
        if not test:
            return
        if test[0] == "CMD-SHELL":
            mt.fail(f"{service}: CMD-SHELL healthchecks are not supported by this test")
        argv = self.rewrite(service, test[1:])
        interval = parse_duration(health.get("interval"), 2.0)
        retries = int(health.get("retries", 3))
        start_period = parse_duration(health.get("start_period"), 0.0)
        deadline = time.monotonic() + start_period + interval * (retries + 1) + 5
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                mt.fail(f"{service} exited with {proc.returncode} before becoming healthy")
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                 env=self.environment(service))
            if out.returncode == 0:
                print(f"[{service}] healthy: {' '.join(argv[1:])}")
                return
            last = out.stderr.strip()
            time.sleep(min(interval, 0.5))
        mt.fail(f"{service} never became healthy; last healthcheck: {last}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", action="append", default=[], help="NAME=PATH of a built program")
    p.add_argument("--timeout_s", type=float, default=400)
    args = p.parse_args()
    binaries = dict(pair.split("=", 1) for pair in args.binary)
    with open(COMPOSE) as f:
        compose = yaml.safe_load(interpolate(f.read()))
    # Every service's log, port files and named volumes, in a folder removed on any exit (failures
    # print the log tails first).
    logs_dir = tempfile.mkdtemp(prefix="modelavg-topology-")
    atexit.register(shutil.rmtree, logs_dir, True)
    topo = Topology(compose, binaries, os.path.join(logs_dir, "volumes"))
    workers = [n for n, s in topo.services.items() if not health_test(s)]
    servers = [n for n in topo.services if n not in workers]
    if not servers or len(workers) < 2:
        mt.fail(f"unexpected topology: servers {servers}, workers {workers}")
    for name, svc in topo.services.items():
        program = as_argv(svc.get("command"))[:1]
        if not program or program[0] not in binaries:
            mt.fail(f"service {name} runs {program}, not a program of this build "
                    f"({', '.join(sorted(binaries))})")

    topo.work_dir = logs_dir
    procs = {}
    logs = {}
    with mt.ProcessGroup() as group:
        for name in topo.start_order():
            argv = topo.rewrite(name, as_argv(topo.services[name]["command"]))
            print(f"[{name}] {' '.join(argv)}", flush=True)
            log_path = os.path.join(logs_dir, f"{name}.log")
            logs[name] = log_path
            procs[name] = group.start(argv, name, env=topo.environment(name),
                                      stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            topo.read_ports(name, procs[name])
            if name in servers:
                topo.wait_healthy(name, procs[name])

        deadline = time.monotonic() + args.timeout_s
        failed = []
        for name in workers:
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
        for name in servers:
            proc = procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            stopped[name] = proc.returncode
    problems = [f"{n} exited with {rc}:\n{open(logs[n]).read()[-2000:]}" for n, rc in failed]
    problems += [f"{n} exited with {rc} after SIGTERM:\n{open(logs[n]).read()[-2000:]}"
                 for n, rc in stopped.items() if rc != 0]
    for name in workers:
        if not any(n == name for n, _ in failed) and "final loss" not in open(logs[name]).read():
            problems.append(f"{name} exited 0 but printed no final loss")
    if problems:
        mt.fail("the compose topology did not run cleanly:\n" + "\n".join(problems))
    print(f"PASS: {len(servers)} server(s) and {len(workers)} workers of docker-compose.yml ran "
          "to completion on loopback")
    return 0


if __name__ == "__main__":
    sys.exit(main())
