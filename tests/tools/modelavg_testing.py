"""Helpers for the Python end-to-end tests: start a coordinator, talk to it, run processes.

Every process a test starts runs in a session (and process group) of its own, is tracked by a
ProcessGroup and is killed as a group when the group is closed, so a failing test leaves nothing
running. Temporary folders made here are removed when the group closes (the generated gRPC stubs
at once, once imported).
"""

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class Failure(AssertionError):
    """A check of a test failed (the message says which and how)."""


def fail(message):
    """Ends the test saying what went wrong: under pytest (tests/python) its failure; in a test
    script, one line on stderr and exit status 1."""
    if "PYTEST_CURRENT_TEST" in os.environ:
        raise Failure(message)
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def accepted_flags(binary):
    """The flag names an absl-flags binary accepts, from its --helpfull."""
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+)", text, re.MULTILINE))
    if not flags:
        raise RuntimeError(f"{binary} --helpfull listed no flags:\n{text[:2000]}")
    return flags


class ProcessGroup:
    """Processes started by one test; close() stops whatever is still running."""

    def __init__(self):
        self.procs = []
        self.dirs = []
        # SIGTERM (a ctest timeout, Ctrl-C's cousin) unwinds like an exception, so that close()
        # still runs; the default action would end the interpreter on the spot.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def start(self, argv, name, env=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, env=env,
                                start_new_session=True)
        proc.name = name
        self.procs.append(proc)
        return proc

    def temp_dir(self, prefix, parent=None):
        """A fresh temporary folder (in `parent`, else TMPDIR), removed by close()."""
        path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        self.dirs.append(path)
        return path

    def close(self):
        for proc in self.procs:
            _kill_group(proc)
        for proc in self.procs:
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        self.dirs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _kill_group(proc):
    """SIGKILL to the process group that `proc` leads (started with start_new_session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


class Coordinator:
    """A modelavg-coordinator on 127.0.0.1, port chosen by the kernel."""

    def __init__(self, group, binary, extra_flags=(), workdir=None):
        self.binary = binary
        self.workdir = workdir or group.temp_dir("modelavg-coord-")
        self.port_file = os.path.join(self.workdir, "coordinator.port")
        self.log_path = os.path.join(self.workdir, "coordinator.log")
        self.log = open(self.log_path, "w")
        argv = [binary, "--listen=127.0.0.1:0", f"--port_file={self.port_file}",
                "--log_level=info", *extra_flags]
        self.proc = group.start(argv, "coordinator", stdout=self.log, stderr=subprocess.STDOUT)
        self.address = self._wait_for_address(timeout_s=30)

    def _wait_for_address(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if os.path.exists(self.port_file):
                text = open(self.port_file).read().strip()
                if text:
                    return text
            time.sleep(0.05)
        raise RuntimeError(f"the coordinator wrote no --port_file within {timeout_s} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines=30):
        self.log.flush()
        try:
            return "".join(open(self.log_path).readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s=10):
        """SIGTERM, then the exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


_stubs = None


def coordinator_stubs():
    """(coordinator_pb2, coordinator_pb2_grpc), generated from the repository's .proto."""
    global _stubs
    if _stubs is None:
        # Debian's protoc (3.21) knows proto3 `optional`; grpc_tools' bundled one does not.
        out = tempfile.mkdtemp(prefix="modelavg-pb-")
        proto_dir = os.path.join(REPO_ROOT, "proto")
        gen = subprocess.run(
            ["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
             "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin",
             os.path.join(proto_dir, "modelavg", "v1", "coordinator.proto")],
            capture_output=True, text=True, timeout=60)
        try:
            if gen.returncode != 0:
                raise RuntimeError(f"protoc failed on coordinator.proto: {gen.stderr}")
            sys.path.insert(0, out)
            sys.dont_write_bytecode = True
            from modelavg.v1 import coordinator_pb2, coordinator_pb2_grpc
            _stubs = (coordinator_pb2, coordinator_pb2_grpc)
        finally:
            # Imported (or failed): the generated files are no longer needed.
            if out in sys.path:
                sys.path.remove(out)
            shutil.rmtree(out, ignore_errors=True)
    return _stubs


def create_job(address, job_id, mode, world_size, warmup_steps, levels, timeout_s=10):
    """CreateJob over gRPC. levels: [(period, group_size), ...] in the user's order."""
    import grpc
    pb, pb_grpc = coordinator_stubs()
    spec = pb.JobSpec(job_id=job_id, world_size=world_size, warmup_steps=warmup_steps,
                      mode=pb.PERIODIC if mode == "periodic" else pb.HIERARCHICAL,
                      levels=[pb.Level(period=p, group_size=g) for p, g in levels])
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CoordinatorStub(channel).CreateJob(pb.CreateJobRequest(spec=spec),
                                                          timeout=timeout_s)


def get_job(address, job_id, timeout_s=10):
    import grpc
    pb, pb_grpc = coordinator_stubs()
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.CoordinatorStub(channel).GetJob(pb.GetJobRequest(job_id=job_id),
                                                       timeout=timeout_s)


def list_jobs(address, timeout_s=10):
    import grpc
    pb, pb_grpc = coordinator_stubs()
    jobs = []
    with grpc.insecure_channel(address) as channel:
        request = pb.ListJobsRequest(page_size=1000)
        while True:  # every page
            page = pb_grpc.CoordinatorStub(channel).ListJobs(request, timeout=timeout_s)
            jobs.extend(page.jobs)
            if not page.next_page_token:
                return jobs
            request.page_token = page.next_page_token


def wait_all(procs, timeout_s):
    """Waits for every process; returns {name: (returncode, stdout, stderr)}. Kills on timeout."""
    deadline = time.monotonic() + timeout_s
    results = {}
    for proc in procs:
        remaining = max(0.1, deadline - time.monotonic())
        try:
            out, err = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            err = (err or "") + f"\n[killed after the {timeout_s} s deadline]"
        results[proc.name] = (proc.returncode, out or "", err or "")
    return results


def join_rank_group(torch, dist, store_port, rank, world):
    """What every rank of a Python test does first: one compute thread, PyTorch's warnings off
    (a period of 1 warns, in PyTorch's averagers and the drop-in alike), and the gloo group of
    the test's TCPStore, whose server the parent holds (world + 1 clients)."""
    import warnings
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    store = dist.TCPStore("127.0.0.1", store_port, world + 1, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def rank_context():
    """The multiprocessing context the tests start ranks with: "forkserver", whose server
    imports torch once and forks each rank from a process that never started gRPC (the test's
    own process may have: a fork of it could hang in the child), or
    MODELAVG_TEST_START_METHOD: tests/sanitize.sh sets "spawn", since ThreadSanitizer cannot
    follow a fork of a process that already runs threads."""
    import multiprocessing
    method = os.environ.get("MODELAVG_TEST_START_METHOD", "forkserver")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def start_ranks(ctx, world, target, args_for, timeout_s):
    """Runs `target(*args_for(rank, results))` in one process per rank (multiprocessing context
    `ctx`); each puts (rank, value, error) on `results`. Returns ({rank: value}, [errors]): the
    first error, a timeout after `timeout_s`, or ranks that exited non-zero."""
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_for(r, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    errors, done = [], {}
    try:
        for _ in procs:
            rank, value, error = results.get(timeout=timeout_s)
            if error:
                errors.append(error)
                break
            done[rank] = value
    except queue.Empty:
        errors.append(f"timed out after {timeout_s} s (finished ranks: {sorted(done)})")
    for p in procs:
        p.join(timeout=10 if not errors else 1)
        if p.is_alive():
            p.kill()
    bad_exit = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if not errors and bad_exit:
        errors.append(f"ranks exited non-zero: {bad_exit}")
    return done, errors


def run_world(ctx, world, target, name, config, coordinator, python_dir, timeout_s,
              stop_coordinator=True):
    """A job's ranks against `coordinator`: a TCPStore for their Gloo group (its server here),
    then `target(rank, name, config, address, store_port, python_dir, results)` in `world`
    processes (start_ranks), then the coordinator stopped. Fails the test, with the
    coordinator's log, on a rank's error or an unclean stop. Returns {rank: value}."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    done, errors = start_ranks(
        ctx, world, target,
        lambda r, q: (r, name, config, coordinator.address, store.port, python_dir, q),
        timeout_s)
    if errors:
        fail(f"{name}: {errors[0]}\ncoordinator log:\n{coordinator.log_tail()}")
    if stop_coordinator and coordinator.stop() != 0:
        fail(f"{name}: the coordinator did not stop cleanly:\n{coordinator.log_tail()}")
    return done


def as_parameters(torch, params):
    """The tensors of dict `params` as torch Parameters with zero gradients."""
    out = []
    for t in params.values():
        p = torch.nn.Parameter(t)
        p.grad = torch.zeros_like(p)  # PyTorch's averagers skip parameters without .grad
        out.append(p)
    return out


def local_update(torch, params, rank, step):
    """A deterministic local 'training' step on dict `params`, different per rank and step: each
    tensor gets 0.1 * N(0, 1) noise drawn (in float64, then cast) from a seed of (rank, step,
    tensor index), so that a test's two copies of the parameters see the same update."""
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            g = torch.Generator().manual_seed(rank * 100003 + step * 101 + i)
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.1)


DROPIN_STEPS = 6

_DROPIN_WORKER = r"""
import json, os, sys
import torch
import modelavg, modelavg.torch
from modelavg.torch import PeriodicModelAverager
rank = int(os.environ["RANK"])
@CHECKS@
p = torch.nn.Parameter(torch.full((4,), float(rank)))
p.grad = torch.zeros_like(p)  # PyTorch's averagers leave out parameters without a gradient
averager = PeriodicModelAverager(period=2, warmup_steps=1)
for step in range(@STEPS@):
    with torch.no_grad():
        p.add_((rank + 1) * (step + 1) * 0.5)
    averager.average_parameters([p])
@EMIT@
"""


def dropin_worker(emit, checks=""):
    """The script of one rank (RANK from the environment) of a drop-in job launched like
    PyTorch's: a parameter x_r = rank gets (rank + 1) * (step + 1) * 0.5 before each of
    DROPIN_STEPS calls of modelavg.torch's PeriodicModelAverager(period=2, warmup_steps=1).
    `checks` run first; `emit` (indented by four spaces) after every call, with rank, step and p
    in scope: it prints the step's line."""
    return (_DROPIN_WORKER.replace("@CHECKS@", checks).replace("@STEPS@", str(DROPIN_STEPS))
            .replace("@EMIT@", emit))


def dropin_expected(world):
    """values[rank][step] of dropin_worker's ranks: PyTorch's periodic rule (period 2, warm-up
    1) restated naively."""
    x = [float(r) for r in range(world)]
    out = [[] for _ in range(world)]
    for s in range(DROPIN_STEPS):
        x = [x[r] + (r + 1) * (s + 1) * 0.5 for r in range(world)]
        if s >= 1 and (s - 1) % 2 == 0:
            x = [sum(x) / world] * world
        for r in range(world):
            out[r].append(x[r])
    return out


def poll_job(modelavg, job_id, address, deadline):
    """modelavg.get_job for a loop that polls the job until `deadline` (time.monotonic()): a
    call that finds the coordinator busy (UNAVAILABLE: no SETTINGS frame in time while every
    core runs a rank; DEADLINE_EXCEEDED) is retried, not taken for a failed test, until the
    deadline has passed."""
    while True:
        try:
            return modelavg.get_job(job_id, coordinator=address)
        except (modelavg.UnavailableError, modelavg.DeadlineExceededError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def connect_rank(modelavg, address, job_id, rank, timeout_s=60):
    """modelavg.connect(...) for `rank`, retried while the job does not exist yet (rank 0 makes
    it, and may not have made it when another rank connects) up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return modelavg.connect(address, job_id, rank=rank, join_timeout=timeout_s)
        except modelavg.NotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
