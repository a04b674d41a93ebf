#!/usr/bin/python3
"""Builds the container image and runs deploy/docker-compose.yml's job in containers.

Uses the engine and compose command that `deploy/container_setup.sh --check` reports (Docker with
`docker compose` or `docker-compose`, or podman with podman-compose); exits 77 (skipped, saying
why) when there is none. Under a project name of its own, with the host ports on free loopback
ports:
  1. builds the image through compose (the Dockerfile, as a user would): with --prebuilt_build,
     its `prebuilt` stage from that build directory's programs (deploy/collect_programs.sh into a
     temporary build context), so that the test compiles nothing again; without, its default
     stage, which compiles the programs inside the image (minutes on two cores);
  2. starts etcd and waits until its health check passes, then the two coordinators: exactly one
     (the leader) turns healthy; the other's health service says NOT_SERVING and its answers
     name the leader;
  3. starts the four workers;
  4. from a container on the compose network, lists the services and reads the demo job's
     schedule through server reflection (modelavg-rpc), and checks it against
     deploy/jobs/demo-jobs.json;
  5. when worker-0 is a tenth into the second (every-step) job, kills the leader's container
     (SIGKILL): the standby must turn healthy; every worker must ride through, re-attach to it
     (it loads the jobs from etcd), exit 0 and print its final losses; the killed container,
     started again, must be a standby;
  6. reads the Prometheus metrics over HTTP: before the kill every worker joined both jobs (on
     the first leader); after the job both jobs are FINISHED and the new leader saw every
     worker leave;
  7. stops both coordinators (exit 0 on SIGTERM), removes their containers and starts new ones,
     whose leader must continue the finished job from etcd (same state, generation, creation
     time and members);
  8. starts the workers again in another job of the jobs file (demo-diloco) and, in the middle
     of it, stops them as `podman stop` / `docker compose down` do (SIGTERM, through the init
     every service runs under): each must leave the job and exit with 143 well within the
     engine's 10 s grace (nobody killed), and the job must be FINISHED;
  9. takes everything down and checks that no container, network or volume of the project is
     left.

  e2e_container_test.py [--timeout_s=900] [--steps=1001] [--step_delay_ms=20]
                        [--prebuilt_build=BUILD_DIR]
"""

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

SKIP = 77
ROOT = mt.REPO_ROOT
COMPOSE_FILE = os.path.join(ROOT, "deploy", "docker-compose.yml")
IMAGE = "modelavg:latest"  # the tag the compose file builds and runs
JOBS_FILE = os.path.join(ROOT, "deploy", "jobs", "demo-jobs.json")
WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]
COORDINATORS = ["coordinator-a", "coordinator-b"]


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

    def inspect_service(self, service, *argv, check=True):
        """Runs modelavg-rpc against `service` in a one-off container of the `inspect` service
        (on the network)."""
        out = self.compose_cmd("run", "--rm", "-T", "--no-deps", "inspect", "modelavg-rpc",
                               f"--coordinator={service}:50051", "--rpc_timeout_ms=20000", *argv,
                               timeout_s=120, check=check)
        return out.stdout if check else out

    def serving(self, service):
        """(SERVING?, what the gRPC health probe said), probed inside the service's container."""
        out = self.run([self.engine, "exec", self.container(service), "modelavg-health",
                        "--coordinator=127.0.0.1:50051", "--rpc_timeout_ms=2000"], check=False,
                       quiet=True)
        return out.returncode == 0, (out.stdout + out.stderr).strip()

    def wait_leader(self, services, timeout_s):
        """Until exactly one of the coordinators is SERVING (the leader); every other one must
        say NOT_SERVING and answer a call with UNAVAILABLE naming the leader."""
        end = time.monotonic() + timeout_s
        states = {}
        while True:
            for service in services:
                cid = self.container(service)
                if self.inspect(cid, "{{.State.Status}}") in ("exited", "dead"):
                    mt.fail(f"{service} exited:\n{self.logs(cid)[-3000:]}")
            states = {s: self.serving(s) for s in services}
            leaders = [s for s, (ok, _) in states.items() if ok]
            if len(leaders) > 1:
                mt.fail(f"two coordinators serve at once: {states}")
            if leaders:
                break
            if time.monotonic() > end:
                mt.fail(f"no coordinator of {services} serves after {timeout_s} s: {states}\n" +
                        "\n".join(f"{s} log:\n{self.logs(self.container(s))[-2000:]}"
                                  for s in services))
            time.sleep(0.2)
        leader = leaders[0]
        for service in services:
            if service == leader:
                continue
            if "NOT_SERVING" not in states[service][1]:
                mt.fail(f"{service}, a standby, should be NOT_SERVING; its probe said "
                        f"{states[service][1]!r}")
            want = f"is a standby; the leader is at {leader}:50051"
            out = self.inspect_service(service, "call", "modelavg.v1.Coordinator/ListJobs",
                                       check=False)
            # (podman-compose 1.0.3's `run` exits 0 whatever the command's exit code.)
            if "code 14: " not in out.stdout + out.stderr or want not in out.stdout + out.stderr:
                mt.fail(f"{service}, a standby, answered ListJobs (exit {out.returncode}), "
                        f"not UNAVAILABLE (code 14) naming the leader ({want}):\n"
                        f"{(out.stdout + out.stderr)[-2000:]}")
        log(f"{leader} leads; standby: {[s for s in services if s != leader]} (NOT_SERVING, "
            "its answers name the leader)")
        return leader


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


def stop_running_job(project, engine, leader, deadline, job="demo-diloco", stop_at=40):
    """The workers, started again in `job`, stopped in the middle of it as `podman stop` stops
    them: each leaves the job and exits 143 (SIGTERM) well within the 10 s grace; the job is
    FINISHED."""
    for service in WORKERS:
        project.run([engine, "rm", project.container(service)])
    project.env = dict(project.env, MODELAVG_DEMO_JOB=job)
    project.compose_cmd("up", "-d", *WORKERS)
    step_line = re.compile(re.escape(job) + r" step +(\d+)/")
    while True:
        steps = [int(m.group(1)) for m in step_line.finditer(
            project.logs(project.container("worker-0")))]
        if steps and max(steps) >= stop_at:
            break
        exited = [s for s in WORKERS
                  if project.inspect(project.container(s), "{{.State.Status}}") != "running"]
        if exited:
            mt.fail(f"{exited} stopped before worker-0 reached step {stop_at} of {job}:\n"
                    f"{project.logs(project.container(exited[0]))[-2000:]}")
        deadline.left()
        time.sleep(0.5)
    ids = [project.container(s) for s in WORKERS]
    t = time.monotonic()
    project.run([engine, "stop", "-t", "10", *ids], timeout_s=60)
    took = time.monotonic() - t
    problems = []
    for service, cid in zip(WORKERS, ids):
        code = project.inspect(cid, "{{.State.ExitCode}}")
        output = project.logs(cid)
        if code != "143" or f"left job {job}" not in output:
            problems.append(f"{service}: exit code {code} (expected 143: stopped on SIGTERM), "
                            f"said it left: {f'left job {job}' in output}:\n{output[-2000:]}")
    if took > 5:
        problems.append(f"'{engine} stop' took {took:.1f} s: a worker waited for the grace period")
    if problems:
        mt.fail(f"the workers did not stop cleanly on '{engine} stop':\n" + "\n".join(problems))
    got = json_object(project.inspect_service(
        leader, "call", "modelavg.v1.Coordinator/GetJob", json.dumps({"job_id": job})))
    if got.get("state") != "FINISHED":
        mt.fail(f"after '{engine} stop' of every worker, job {job} is {got.get('state')}, not "
                f"FINISHED: {got}")
    log(f"[figures] '{engine} stop' of the 4 workers mid-job took {took:.2f} s; each exited 143 "
        f"having left job {job}, which is FINISHED")


def prebuilt_context(build_dir):
    """A temporary build context for the Dockerfile's `prebuilt` stage: the Dockerfile, what its
    runtime stages copy from deploy/, and prebuilt/ with the build's programs
    (deploy/collect_programs.sh; with the NCCL path built, CUDA's libraries go in too)."""
    context = tempfile.mkdtemp(prefix="modelavg-image-")
    shutil.copy(os.path.join(ROOT, "Dockerfile"), context)
    os.makedirs(os.path.join(context, "deploy"))
    shutil.copy(os.path.join(ROOT, "deploy", "install_runtime.sh"),
                os.path.join(context, "deploy"))
    shutil.copytree(os.path.join(ROOT, "deploy", "jobs"), os.path.join(context, "deploy", "jobs"))
    out = subprocess.run(["bash", os.path.join(ROOT, "deploy", "collect_programs.sh"), build_dir,
                          os.path.join(context, "prebuilt")],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        shutil.rmtree(context, ignore_errors=True)
        mt.fail(f"collecting the programs of {build_dir} for the image failed "
                f"(exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    log(f"image context {context}: the programs of {build_dir}")
    return context


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
    p.add_argument("--prebuilt_build", default="",
                   help="build the image's `prebuilt` stage from this build directory's programs "
                        "instead of compiling them in the image")
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
    ports = {"MODELAVG_GRPC_PORT": free_port(), "MODELAVG_METRICS_PORT": free_port(),
             "MODELAVG_GRPC_PORT_B": free_port(), "MODELAVG_METRICS_PORT_B": free_port()}
    metrics_port = {"coordinator-a": ports["MODELAVG_METRICS_PORT"],
                    "coordinator-b": ports["MODELAVG_METRICS_PORT_B"]}
    env = dict(os.environ, BUILDAH_FORMAT="docker",  # podman: keep the HEALTHCHECK
               MODELAVG_DEMO_STEPS=str(args.steps),
               MODELAVG_DEMO_STEP_DELAY_MS=str(args.step_delay_ms),
               **{k: str(v) for k, v in ports.items()})
    context = None
    if args.prebuilt_build:
        context = prebuilt_context(args.prebuilt_build)
        env.update(MODELAVG_IMAGE_CONTEXT=context, MODELAVG_IMAGE_TARGET="prebuilt")
    project = Project(engine, compose, name, env, deadline)
    log(f"engine {engine}, compose '{compose}', project {name}, host ports {ports}")

    volumes_before = set(project.all_volumes())
    started = time.monotonic()
    try:
        t = time.monotonic()
        build = project.compose_cmd("build", "coordinator-a", timeout_s=1800)
        # podman-compose 1.0.3 exits 0 when the build fails: the tag is the proof it built.
        if project.run([engine, "image", "inspect", IMAGE], check=False,
                       quiet=True).returncode != 0:
            mt.fail(f"the image build left no {IMAGE} (the build failed):\n"
                    f"{build.stdout[-4000:]}\n{build.stderr[-4000:]}")
        log(f"image built in {time.monotonic() - t:.0f} s")

        project.compose_cmd("up", "-d", "etcd")
        project.wait_healthy("etcd", timeout_s=90)
        project.compose_cmd("up", "-d", *COORDINATORS)
        leader = project.wait_leader(COORDINATORS, timeout_s=90)
        project.wait_healthy(leader, timeout_s=90)

        project.compose_cmd("up", "-d", *WORKERS)

        services = project.inspect_service(leader, "list").split()
        if "modelavg.v1.Coordinator" not in services:
            mt.fail(f"reflection lists {services}, not modelavg.v1.Coordinator")
        text = project.inspect_service(
            leader, "call", "modelavg.v1.Coordinator/GetSchedule",
            json.dumps({"job_id": "demo", "from_step": 0, "count": 24}))
        check_schedule(json_object(text).get("decisions", []), 0, 24)
        log("the schedule read through reflection matches deploy/jobs/demo-jobs.json")

        def read_metrics(service):
            url = f"http://127.0.0.1:{metrics_port[service]}/metrics"
            with urllib.request.urlopen(url, timeout=deadline.left(10)) as response:
                return response.read().decode()

        # The leader's container is killed while the workers are in the middle of the
        # every-step job: the standby takes over (loading the jobs from etcd), the workers ride
        # through the outage, re-attach to it and finish.
        kill_at = args.steps // 10
        end = time.monotonic() + args.worker_timeout_s
        step_line = re.compile(r"demo-every-step step +(\d+)/")
        while True:
            steps = [int(m.group(1)) for m in step_line.finditer(
                project.logs(project.container("worker-0")))]
            if steps and max(steps) >= kill_at:
                break
            exited = [s for s in WORKERS
                      if project.inspect(project.container(s), "{{.State.Status}}") != "running"]
            if exited or time.monotonic() > end:
                mt.fail(f"no leader kill: {exited or 'no worker'} stopped before worker-0 "
                        f"reached step {kill_at} of demo-every-step (last: {steps[-1:]})\n"
                        f"{project.logs(project.container('worker-0'))[-2000:]}")
            time.sleep(0.5)
        metrics = read_metrics(leader)
        joins = metric(metrics, "modelavg_rpcs_total", {"method": "Join", "code": "OK"})
        if joins is None or joins < 2 * len(WORKERS):
            mt.fail(f"metrics: expected >= {2 * len(WORKERS)} successful Joins (every worker, "
                    f"both jobs), got {joins}:\n{metrics[:3000]}")
        log(f"metrics over HTTP: {joins:.0f} successful Joins")
        killed = leader
        cid = project.container(killed)
        log(f"worker-0 is at step {max(steps)} of {args.steps} of demo-every-step: killing the "
            f"leader {killed} (SIGKILL)")
        t = time.monotonic()
        project.run([engine, "kill", cid], timeout_s=60)
        standby = [s for s in COORDINATORS if s != killed]
        leader = project.wait_leader(standby, timeout_s=60)
        log(f"[figures] the leader's container killed -> {leader} serving in "
            f"{time.monotonic() - t:.1f} s")
        project.run([engine, "start", cid], timeout_s=60)
        if project.wait_leader(COORDINATORS, timeout_s=60) != leader:
            mt.fail(f"{killed}, started again, took the leadership from {leader}")

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
                ("re-attached after the kill; " if reattached else "did not re-attach; ") +
                (" | ".join(lines) or "no final loss"))
            if state != "exited" or code != "0" or not lines or not reattached:
                problems.append(f"{service}: {state}, exit code {code}, final losses {lines}, "
                                f"re-attached after the kill: {reattached}:\n"
                                f"{output[-2000:]}")
        if problems:
            mt.fail("the demo job did not finish:\n" + "\n".join(problems) + "\n" +
                    "\n".join(f"{s} log:\n{project.logs(project.container(s))[-3000:]}"
                              for s in COORDINATORS))

        metrics = read_metrics(leader)
        finished = metric(metrics, "modelavg_jobs", {"state": "FINISHED"})
        leaves = metric(metrics, "modelavg_rpcs_total", {"method": "Leave", "code": "OK"})
        if finished != 2 or leaves is None or leaves < len(WORKERS):
            mt.fail(f"metrics after the job: expected 2 FINISHED jobs and >= {len(WORKERS)} "
                    f"successful Leaves (of the every-step job, from the new leader), "
                    f"got {finished} and {leaves}:\n{metrics[:3000]}")
        log(f"metrics over HTTP after the job: {finished:.0f} jobs FINISHED, the new leader "
            f"saw {leaves:.0f} successful Leaves")

        # New coordinator containers continue the jobs from etcd (the volume `etcd`): the
        # finished job comes back finished, not fresh from the jobs file.
        def get_job(service):
            return json_object(project.inspect_service(
                service, "call", "modelavg.v1.Coordinator/GetJob", json.dumps({"job_id": "demo"})))

        def summary(job):
            return {k: job.get(k) for k in ("state", "generation", "created_unix_ms")} | {
                "members": sorted((m.get("rank", 0), m.get("worker_id"), m.get("state"))
                                  for m in job.get("members", []))}

        before = summary(get_job(leader))
        if before["state"] != "FINISHED" or len(before["members"]) != len(WORKERS):
            mt.fail(f"after the demo, job demo is {before}; expected FINISHED with "
                    f"{len(WORKERS)} members")
        old = {}
        for service in [leader] + [s for s in COORDINATORS if s != leader]:
            cid = old[service] = project.container(service)
            project.run([engine, "stop", "-t", "30", cid], timeout_s=60)
            code = project.inspect(cid, "{{.State.ExitCode}}")
            if code != "0":
                mt.fail(f"{service} exited with {code} on SIGTERM:\n{project.logs(cid)[-3000:]}")
            project.run([engine, "rm", cid])
        project.compose_cmd("up", "-d", *COORDINATORS)
        for service in COORDINATORS:
            if project.container(service) == old[service]:
                mt.fail(f"compose did not make a new {service} container")
        leader = project.wait_leader(COORDINATORS, timeout_s=90)
        after = summary(get_job(leader))
        if after != before:
            mt.fail(f"new coordinator containers did not continue job demo from etcd:\n"
                    f"  before: {before}\n  after:  {after}")
        log(f"new coordinator containers ({leader} leads) continued job demo from etcd: {after}")

        stop_running_job(project, engine, leader, deadline)
    finally:
        if context:
            shutil.rmtree(context, ignore_errors=True)
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
    log(f"PASS: image, etcd, {len(COORDINATORS)} coordinators (the leader killed mid-job) and "
        f"{len(WORKERS)} workers in {engine} containers "
        f"({time.monotonic() - started:.0f} s), nothing left behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
