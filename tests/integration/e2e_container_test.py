#!/usr/bin/python3
"""Builds the container image and runs deploy/docker-compose.yml's job in containers.

Uses the engine and compose command that `deploy/container_setup.sh --check` reports (Docker with
`docker compose` or `docker-compose`, or podman with podman-compose); exits 77 (skipped, saying
why) when there is none. Under a project name of its own, with the host ports on free loopback
ports:
  1. builds the image through compose (the Dockerfile, as a user would);
  2. starts the coordinator and waits until its health check passes;
  3. starts the four workers;
  4. from a container on the compose network, lists the services and reads the demo job's
     schedule through server reflection (modelavg-rpc), and checks it against
     deploy/jobs/demo-jobs.json;
  5. when worker-0 is a tenth into the second (every-step) job, restarts the coordinator's
     container; every worker must ride through, re-attach to the restarted coordinator (which
     continues the job from the `state` volume), exit 0 and print its final losses;
  6. reads the Prometheus metrics over HTTP: before the restart every worker joined both jobs;
     after the job both jobs are FINISHED and the restarted coordinator saw every worker leave;
  7. stops the coordinator (exit 0 on SIGTERM), removes its container and starts a new one, which
     must continue the finished job from the `state` volume (same state, generation, creation
     time and members);
  8. takes everything down and checks that no container, network or volume of the project is
     left.

  e2e_container_test.py [--timeout_s=900] [--steps=1001] [--step_delay_ms=20]
"""

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

SKIP = 77
ROOT = mt.REPO_ROOT
COMPOSE_FILE = os.path.join(ROOT, "deploy", "docker-compose.yml")
JOBS_FILE = os.path.join(ROOT, "deploy", "jobs", "demo-jobs.json")
WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]


def log(message):
    print(f"[container] {message}", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, at_most=None):
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the test's deadline passed")
        return left if at_most is None else min(left, at_most)


class Project:
    """One compose project: the engine, the compose command and the project's name."""

    def __init__(self, engine, compose, name, env, deadline):
        self.engine = engine
        self.compose = shlex.split(compose)
        self.name = name
        self.env = env
        self.deadline = deadline

    def run(self, argv, timeout_s=120, check=True, quiet=False):
        if not quiet:
            log("$ " + " ".join(shlex.quote(a) for a in argv))
        out = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=ROOT,
                             timeout=self.deadline.left(timeout_s), stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            mt.fail(f"{' '.join(argv)} exited with {out.returncode}:\n{out.stdout[-3000:]}\n"
                    f"{out.stderr[-3000:]}")
        return out

    def compose_cmd(self, *args, **kw):
        return self.run(self.compose + ["-p", self.name, "-f", COMPOSE_FILE, *args], **kw)

    def containers(self, service=None, running_only=False):
        argv = [self.engine, "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}"]
        if not running_only:
            argv.insert(2, "-a")
        if service:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        return self.run(argv, quiet=True).stdout.split()

    def container(self, service):
        ids = self.containers(service)
        if len(ids) != 1:
            mt.fail(f"expected one container of service {service}, found {ids}")
        return ids[0]

    def inspect(self, cid, template):
        return self.run([self.engine, "inspect", "-f", template, cid], quiet=True).stdout.strip()

    def logs(self, cid):
        out = self.run([self.engine, "logs", cid], check=False, quiet=True)
        return out.stdout + out.stderr

    def networks(self):
        names = self.run([self.engine, "network", "ls", "--format", "{{.Name}}"],
                         quiet=True).stdout.split()
        return [n for n in names if n.startswith(self.name + "_") or n.startswith(self.name + "-")]

    def all_volumes(self):
        return self.run([self.engine, "volume", "ls", "--format", "{{.Name}}"],
                        quiet=True).stdout.split()

    def volumes(self):
        return [n for n in self.all_volumes()
                if n.startswith(self.name + "_") or n.startswith(self.name + "-")]

    def wait_healthy(self, service, timeout_s):
        """Until the service's health check passes (podman without systemd runs checks only when
        asked: `podman healthcheck run`; Docker runs them itself)."""
        cid = self.container(service)
        end = time.monotonic() + timeout_s
        status = ""
        while time.monotonic() < end:
            state = self.inspect(cid, "{{.State.Status}}")
            if state in ("exited", "dead"):
                mt.fail(f"{service} exited before becoming healthy:\n{self.logs(cid)[-3000:]}")
            if self.engine == "podman":
                self.run(["podman", "healthcheck", "run", cid], check=False, quiet=True)
            status = self.inspect(cid, "{{.State.Health.Status}}")
            if status == "healthy":
                log(f"{service} is healthy")
                return cid
            time.sleep(1)
        mt.fail(f"{service} not healthy after {timeout_s} s (health status '{status}'):\n"
                f"{self.logs(cid)[-3000:]}")

    def inspect_service(self, *argv):
        """Runs modelavg-rpc in a one-off container of the `inspect` service (on the network)."""
        out = self.compose_cmd("run", "--rm", "-T", "--no-deps", "inspect", "modelavg-rpc",
                               "--address=coordinator:50051", "--timeout_ms=20000", *argv,
                               timeout_s=120)
        return out.stdout


def check_schedule(decisions, from_step, count):
    """The demo job's schedule against deploy/jobs/demo-jobs.json: at step s the level with the
    largest period dividing s averages, in subgroups of its group size that split the world."""
    spec = next(j for j in json.load(open(JOBS_FILE))["jobs"] if j["job_id"] == "demo")
    world = spec["world_size"]
    by_step = {}
    for d in decisions:
        by_step.setdefault(int(d.get("step", 0)), []).append(d)
    problems = []
    for step in range(from_step, from_step + count):
        got = by_step.get(step, [])
        levels = [lv for lv in spec["levels"] if step % lv["period"] == 0]
        if not levels:
            if [d.get("action") for d in got] != ["SKIP"]:
                problems.append(f"step {step}: expected one SKIP, got {got}")
            continue
        level = max(levels, key=lambda lv: lv["period"])
        groups = sorted(tuple(d.get("ranks", [])) for d in got)
        ok = (all(d.get("action") == "AVERAGE" and int(d.get("period", 0)) == level["period"]
                  for d in got) and
              len(groups) == world // level["group_size"] and
              all(len(g) == level["group_size"] for g in groups) and
              sorted(r for g in groups for r in g) == list(range(world)))
        if not ok:
            problems.append(f"step {step}: expected period {level['period']} in groups of "
                            f"{level['group_size']}, got {got}")
    if problems:
        mt.fail("the schedule read through reflection is wrong:\n  " + "\n  ".join(problems))


def json_object(text):
    """The JSON object modelavg-rpc printed (podman-compose prints its own lines around it)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "{":
            try:
                return json.JSONDecoder().raw_decode("\n".join(lines[i:]))[0]
            except json.JSONDecodeError:
                continue
    mt.fail(f"no JSON object in modelavg-rpc's output:\n{text[-3000:]}")


def metric(text, name, labels):
    """The value of one Prometheus sample, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.index("}") + 1]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--timeout_s", type=float, default=900,
                   help="deadline of the whole test, image build included")
    p.add_argument("--worker_timeout_s", type=float, default=300,
                   help="how long the workers may take to finish the demo")
    p.add_argument("--steps", type=int, default=1001,
                   help="the workers' --steps (MODELAVG_DEMO_STEPS)")
    p.add_argument("--step_delay_ms", type=int, default=20,
                   help="the workers' --step_delay_ms (MODELAVG_DEMO_STEP_DELAY_MS): with --steps, "
                        "long enough for the coordinator to restart in the middle of a job")
    args = p.parse_args()
    deadline = Deadline(args.timeout_s)

    check = subprocess.run(["bash", os.path.join(ROOT, "deploy", "container_setup.sh"), "--check"],
                           capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        print(f"SKIP: no usable container engine: {check.stdout.strip()} {check.stderr.strip()}")
        return SKIP
    found = dict(line.split("=", 1) for line in check.stdout.splitlines() if "=" in line)
    engine, compose = found["engine"], found["compose"]
    name = f"modelavg-e2e-{os.getpid()}"
    ports = {"MODELAVG_GRPC_PORT": free_port(), "MODELAVG_METRICS_PORT": free_port()}
    env = dict(os.environ, BUILDAH_FORMAT="docker",  # podman: keep the HEALTHCHECK
               MODELAVG_DEMO_STEPS=str(args.steps),
               MODELAVG_DEMO_STEP_DELAY_MS=str(args.step_delay_ms),
               **{k: str(v) for k, v in ports.items()})
    project = Project(engine, compose, name, env, deadline)
    log(f"engine {engine}, compose '{compose}', project {name}, host ports {ports}")

    volumes_before = set(project.all_volumes())
    started = time.monotonic()
    try:
        t = time.monotonic()
        project.compose_cmd("build", "coordinator", timeout_s=1800)
        log(f"image built in {time.monotonic() - t:.0f} s")

        project.compose_cmd("up", "-d", "coordinator")
        project.wait_healthy("coordinator", timeout_s=90)

        project.compose_cmd("up", "-d", *WORKERS)

        services = project.inspect_service("list").split()
        if "modelavg.v1.Coordinator" not in services:
            mt.fail(f"reflection lists {services}, not modelavg.v1.Coordinator")
        text = project.inspect_service(
            "call", "modelavg.v1.Coordinator/GetSchedule",
            json.dumps({"job_id": "demo", "from_step": 0, "count": 24}))
        check_schedule(json_object(text).get("decisions", []), 0, 24)
        log("the schedule read through reflection matches deploy/jobs/demo-jobs.json")

        def read_metrics():
            url = f"http://127.0.0.1:{ports['MODELAVG_METRICS_PORT']}/metrics"
            with urllib.request.urlopen(url, timeout=deadline.left(10)) as response:
                return response.read().decode()

        # The coordinator container restarts while the workers are in the middle of the
        # every-step job: they ride through the outage, re-attach to the restarted coordinator
        # (which continues the job from the state volume) and finish.
        restart_at = args.steps // 10
        end = time.monotonic() + args.worker_timeout_s
        step_line = re.compile(r"demo-every-step step +(\d+)/")
        while True:
            steps = [int(m.group(1)) for m in step_line.finditer(
                project.logs(project.container("worker-0")))]
            if steps and max(steps) >= restart_at:
                break
            exited = [s for s in WORKERS
                      if project.inspect(project.container(s), "{{.State.Status}}") != "running"]
            if exited or time.monotonic() > end:
                mt.fail(f"no restart: {exited or 'no worker'} stopped before worker-0 reached "
                        f"step {restart_at} of demo-every-step (last: {steps[-1:]})\n"
                        f"{project.logs(project.container('worker-0'))[-2000:]}")
            time.sleep(0.5)
        metrics = read_metrics()
        joins = metric(metrics, "modelavg_rpcs_total", {"method": "Join", "code": "OK"})
        if joins is None or joins < 2 * len(WORKERS):
            mt.fail(f"metrics: expected >= {2 * len(WORKERS)} successful Joins (every worker, "
                    f"both jobs), got {joins}:\n{metrics[:3000]}")
        log(f"metrics over HTTP: {joins:.0f} successful Joins")
        cid = project.container("coordinator")
        log(f"worker-0 is at step {max(steps)} of {args.steps} of demo-every-step: restarting the "
            "coordinator")
        project.run([engine, "restart", "-t", "30", cid], timeout_s=90)
        project.wait_healthy("coordinator", timeout_s=90)

        end = time.monotonic() + args.worker_timeout_s
        while project.containers(running_only=True) and time.monotonic() < end:
            running = [s for s in WORKERS
                       if project.inspect(project.container(s), "{{.State.Status}}") == "running"]
            if not running:
                break
            time.sleep(2)
        problems = []
        for service in WORKERS:
            cid = project.container(service)
            state = project.inspect(cid, "{{.State.Status}}")
            output = project.logs(cid)
            code = project.inspect(cid, "{{.State.ExitCode}}")
            lines = [l for l in output.splitlines() if "final loss" in l]
            reattached = "re-attached to job demo-every-step" in output
            log(f"{service}: {state}, exit {code}, " +
                ("re-attached after the restart; " if reattached else "did not re-attach; ") +
                (" | ".join(lines) or "no final loss"))
            if state != "exited" or code != "0" or not lines or not reattached:
                problems.append(f"{service}: {state}, exit code {code}, final losses {lines}, "
                                f"re-attached after the restart: {reattached}:\n"
                                f"{output[-2000:]}")
        if problems:
            coordinator_log = project.logs(project.container("coordinator"))
            mt.fail("the demo job did not finish:\n" + "\n".join(problems) +
                    f"\ncoordinator log:\n{coordinator_log[-3000:]}")

        metrics = read_metrics()
        finished = metric(metrics, "modelavg_jobs", {"state": "FINISHED"})
        leaves = metric(metrics, "modelavg_rpcs_total", {"method": "Leave", "code": "OK"})
        if finished != 2 or leaves is None or leaves < len(WORKERS):
            mt.fail(f"metrics after the job: expected 2 FINISHED jobs and >= {len(WORKERS)} "
                    f"successful Leaves (of the every-step job, from the restarted coordinator), "
                    f"got {finished} and {leaves}:\n{metrics[:3000]}")
        log(f"metrics over HTTP after the job: {finished:.0f} jobs FINISHED, the restarted "
            f"coordinator saw {leaves:.0f} successful Leaves")

        # A new coordinator container continues the jobs from the volume `state` (--state_dir):
        # the finished job comes back finished, not fresh from the jobs file.
        def get_job():
            return json_object(project.inspect_service(
                "call", "modelavg.v1.Coordinator/GetJob", json.dumps({"job_id": "demo"})))

        def summary(job):
            return {k: job.get(k) for k in ("state", "generation", "created_unix_ms")} | {
                "members": sorted((m.get("rank", 0), m.get("worker_id"), m.get("state"))
                                  for m in job.get("members", []))}

        before = summary(get_job())
        if before["state"] != "FINISHED" or len(before["members"]) != len(WORKERS):
            mt.fail(f"after the demo, job demo is {before}; expected FINISHED with "
                    f"{len(WORKERS)} members")
        cid = project.container("coordinator")
        project.run([engine, "stop", "-t", "30", cid], timeout_s=60)
        code = project.inspect(cid, "{{.State.ExitCode}}")
        if code != "0":
            mt.fail(f"the coordinator exited with {code} on SIGTERM:\n{project.logs(cid)[-3000:]}")
        project.run([engine, "rm", cid])
        project.compose_cmd("up", "-d", "coordinator")
        if project.container("coordinator") == cid:
            mt.fail("compose did not make a new coordinator container")
        project.wait_healthy("coordinator", timeout_s=90)
        after = summary(get_job())
        if after != before:
            mt.fail(f"a new coordinator container did not continue job demo from the volume:\n"
                    f"  before: {before}\n  after:  {after}")
        log(f"a new coordinator container continued job demo from the state volume: {after}")
    finally:
        project.compose_cmd("down", "-v", check=False, timeout_s=180)
        if compose == "podman-compose":
            # podman-compose (1.0.3) leaves the project's networks: remove them as a user must.
            for net in project.networks():
                project.run([engine, "network", "rm", net], check=False)
        # The project's volumes by name, and any other volume that appeared meanwhile (an
        # anonymous one of a container of the project).
        left = {"containers": project.containers(), "networks": project.networks(),
                "volumes": sorted(set(project.volumes()) |
                                  (set(project.all_volumes()) - volumes_before))}
        if any(left.values()):
            # Clean up by name, then fail: `down -v` should have removed them.
            for cid in left["containers"]:
                project.run([engine, "rm", "-f", "-v", cid], check=False)
            for net in left["networks"]:
                project.run([engine, "network", "rm", net], check=False)
            for vol in project.volumes():  # not the unnamed ones: they may be someone else's
                project.run([engine, "volume", "rm", "-f", vol], check=False)
            mt.fail(f"'down -v' left {left}")
    log(f"PASS: image, coordinator and {len(WORKERS)} workers in {engine} containers "
        f"({time.monotonic() - started:.0f} s), nothing left behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
