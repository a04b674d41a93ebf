"""The modelavg package's API and errors against a real coordinator (one check per CTest test).

  pytest tests/python/errors_test.py ["-k NAME"]      (conftest.py: which build)

Checks:
  no_such_job       connect / the drop-in on a job that does not exist: NotFoundError naming it
  spec_mismatch     the drop-in on an existing job with another plan (or min_world_size): a
                    ValueError naming both; a process group other than the default: a clear error
  dead_peer         a peer is killed (SIGKILL) mid-training: the survivor's next averaging step
                    raises PeerFailureError naming rank 1 (its rank attribute, from the typed
                    error, and its message)
  elastic_below_min an elastic job of 3 (min_world_size 2): the survivors go on after one
                    SIGKILL (decisions list [0, 1]); after a second one the last survivor gets
                    PeerFailureError saying the job fell below min_world_size
  unreachable       nothing listens at the address: UnavailableError (a ConnectionError) within
                    join_timeout
  environment       the connection from the environment, as every modelavg program reads it:
                    $MODELAVG_COORDINATOR and $MODELAVG_AUTH_TOKEN_FILE reach a coordinator
                    that needs a token; the old $MODELAVG_TOKEN_FILE works, reported once on
                    stderr; a token passed as a keyword wins over the environment's
  interrupt         SIGINT while connect waits for a world that never completes: KeyboardInterrupt
                    at once (not after join_timeout), the Join is cancelled (the rank is free
                    again), and the process returns from main and exits cleanly; SIGINT in
                    average_parameters: KeyboardInterrupt at once, the averager refuses new calls
  streaming_spec    Level(fragments=, sync_delay=, mix=, payload=): round trips, bad fields named
                    by the package and the coordinator, the drop-in's Level, fragment state
  nonfinite         4 workers, pairs every 2 steps and all four every 4; rank 2's parameter
                    becomes NaN before step 28: every worker's call raises NonFiniteError (rank 2,
                    step 28, level 1, tensor 0, "NaN"), and no worker's parameters changed in it
  jobs_and_client   create/get/list/delete_job, duplicate and invalid specs, min_world_size,
                    unknown options, the client's properties (a strict job's elastic fields:
                    admission_step -1, no vacancy) and context manager, the wrong averager for the
                    job's mode, and two ranks in one process on two threads (only possible when
                    the GIL is released during connect and averaging)
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import modelavg_testing as mt


def expect_raises(what, cls, fn, *contains):
    try:
        fn()
    except cls as e:
        text = str(e)
        for piece in contains:
            if piece not in text:
                mt.fail(f"{what}: {type(e).__name__} does not mention {piece!r}: {text}")
        return e
    except Exception as e:  # the wrong kind
        mt.fail(f"{what}: expected {cls.__name__}, got {type(e).__name__}: {e}")
    mt.fail(f"{what}: expected {cls.__name__}, nothing was raised")


def child(code, env_extra=None, group=None, name="child"):
    """A Python process running `code` with the package importable (conftest.py)."""
    env = dict(os.environ, **(env_extra or {}))
    return group.start([sys.executable, "-c", textwrap.dedent(code)], name, env=env)


def check_no_such_job(modelavg, coordinator, group):
    e = expect_raises("connect to a missing job", modelavg.NotFoundError,
                      lambda: modelavg.connect(coordinator.address, "no-such-job", rank=0,
                                               join_timeout=10),
                      "no-such-job")
    if e.code != "NOT_FOUND" or not isinstance(e, LookupError):
        mt.fail(f"NotFoundError has code {e.code} / is not a LookupError")
    expect_raises("get_job of a missing job", modelavg.NotFoundError,
                  lambda: modelavg.get_job("no-such-job", coordinator=coordinator.address))
    # The drop-in cannot create a job without WORLD_SIZE: it says so.
    os.environ.update(MODELAVG_COORDINATOR=coordinator.address, MODELAVG_JOB="dropin-missing")
    os.environ.pop("WORLD_SIZE", None)
    import modelavg.torch
    expect_raises("drop-in without WORLD_SIZE", modelavg.NotFoundError,
                  lambda: modelavg.torch.PeriodicModelAverager(period=2),
                  "dropin-missing", "WORLD_SIZE")


def check_spec_mismatch(modelavg, coordinator, group):
    modelavg.create_job("mismatch", 2, "PERIODIC", period=4, warmup_steps=1,
                        coordinator=coordinator.address)
    os.environ.update(MODELAVG_COORDINATOR=coordinator.address, MODELAVG_JOB="mismatch",
                      WORLD_SIZE="2", RANK="0")
    import modelavg.torch
    e = expect_raises("drop-in with another period", ValueError,
                      lambda: modelavg.torch.PeriodicModelAverager(period=2, warmup_steps=1),
                      "mismatch", "[(4, 2)]", "[(2, 2)]")
    if not isinstance(e, modelavg.InvalidArgumentError):
        mt.fail(f"the mismatch is a {type(e).__name__}, not a modelavg.InvalidArgumentError")
    expect_raises("drop-in with another warm-up", ValueError,
                  lambda: modelavg.torch.PeriodicModelAverager(period=4, warmup_steps=0),
                  "warmup_steps=1", "warmup_steps=0")
    expect_raises("hierarchical drop-in on a periodic job", ValueError,
                  lambda: modelavg.torch.HierarchicalModelAverager({4: 2}, warmup_steps=1),
                  "PERIODIC", "HIERARCHICAL")
    # An elastic min_world_size asked of the strict job (join_timeout: were the check missing,
    # the connect would fail after 5 s instead of passing).
    modelavg.torch.set_options(min_world_size=1, join_timeout=5)
    expect_raises("drop-in asking a strict job for min_world_size 1", ValueError,
                  lambda: modelavg.torch.PeriodicModelAverager(period=4, warmup_steps=1),
                  "min_world_size=0", "min_world_size=1")
    modelavg.torch._options.clear()
    os.environ["WORLD_SIZE"] = "4"
    expect_raises("drop-in with another world size", ValueError,
                  lambda: modelavg.torch.PeriodicModelAverager(period=4, warmup_steps=1),
                  "world_size=2", "world_size=4")
    # PyTorch's own argument checks come first, with PyTorch's messages.
    expect_raises("period 0", ValueError, lambda: modelavg.torch.PeriodicModelAverager(period=0),
                  "period")
    expect_raises("empty dict", ValueError,
                  lambda: modelavg.torch.HierarchicalModelAverager({}), "must not be empty")
    # A process group other than the default one.
    import torch.distributed as dist
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sub = dist.new_group(ranks=[0], backend="gloo")
    expect_raises("a non-default process group", ValueError,
                  lambda: modelavg.torch.PeriodicModelAverager(period=4, warmup_steps=1,
                                                               process_group=sub),
                  "process_group", "default")
    dist.destroy_process_group()


def check_dead_peer(modelavg, coordinator, group):
    modelavg.create_job("dead-peer", 2, "PERIODIC", period=1, heartbeat_timeout_ms=1000,
                        coordinator=coordinator.address)
    code = """
        import json, os, signal, sys, time, warnings
        import torch, modelavg
        rank = int(os.environ["RANK"])
        client = modelavg.connect(os.environ["ADDR"], "dead-peer", collective_timeout=20)
        averager = modelavg.PeriodicModelAverager(client)
        p = torch.nn.Parameter(torch.full((1000,), float(rank)))
        p.grad = torch.zeros_like(p)
        for step in range(200):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                averager.average_parameters([p])
            except modelavg.PeerFailureError as e:
                print(json.dumps({"step": step, "code": e.code, "rank": e.rank,
                                  "message": e.message}))
                sys.exit(0)
            time.sleep(0.05)
        print(json.dumps({"error": "no PeerFailureError after 200 steps"}))
        sys.exit(1)
    """
    procs = [child(code, {"RANK": str(r), "ADDR": coordinator.address}, group, f"rank {r}")
             for r in range(2)]
    results = mt.wait_all(procs, timeout_s=60)
    rc, out, err = results["rank 0"]
    if rc != 0:
        mt.fail(f"the survivor exited {rc}:\n{out}\n{err[-2000:]}")
    if results["rank 1"][0] != -signal.SIGKILL:
        mt.fail(f"rank 1 was to be killed, exit status {results['rank 1'][0]}")
    lines = [l for l in out.splitlines() if l.startswith("{")]  # the library logs to stdout too
    if not lines:
        mt.fail(f"the survivor printed no result:\n{out}\n{err[-2000:]}")
    got = json.loads(lines[-1])
    if got["rank"] != 1 or "rank 1" not in got["message"]:
        mt.fail(f"the PeerFailureError does not name rank 1: {got}")
    if got["step"] < 3:
        mt.fail(f"the survivor failed at step {got['step']}, before its peer died: {got}")
    print(f"survivor: {got['code']} at step {got['step']}: {got['message']}")


def check_elastic_below_min(modelavg, coordinator, group):
    modelavg.create_job("below-min", 3, "PERIODIC", period=1, min_world_size=2,
                        heartbeat_timeout_ms=1000, coordinator=coordinator.address)
    code = """
        import json, os, signal, sys, time
        import torch, modelavg
        rank = int(os.environ["RANK"])
        client = modelavg.connect(os.environ["ADDR"], "below-min", rank=rank,
                                  collective_timeout=20)
        averager = modelavg.PeriodicModelAverager(client)
        p = torch.nn.Parameter(torch.full((100,), float(rank)))
        p.grad = torch.zeros_like(p)
        ranks = {}
        for step in range(400):
            if (rank, step) in ((2, 3), (1, 30)):
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                ranks[step] = averager.average_parameters([p]).ranks
            except modelavg.PeerFailureError as e:
                print(json.dumps({"step": step, "code": e.code, "message": e.message,
                                  "ranks": ranks}))
                sys.exit(0)
            time.sleep(0.02)
        print(json.dumps({"error": "no PeerFailureError after 400 steps", "ranks": ranks}))
        sys.exit(1)
    """
    procs = [child(code, {"RANK": str(r), "ADDR": coordinator.address}, group, f"rank {r}")
             for r in range(3)]
    results = mt.wait_all(procs, timeout_s=60)
    rc, out, err = results["rank 0"]
    if rc != 0:
        mt.fail(f"rank 0 exited {rc}:\n{out[-3000:]}\n{err[-2000:]}")
    for r in (1, 2):
        if results[f"rank {r}"][0] != -signal.SIGKILL:
            mt.fail(f"rank {r} was to be killed, exit status {results[f'rank {r}'][0]}")
    got = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    ranks = {int(k): v for k, v in got["ranks"].items()}
    # Steps 0-2 with all three, 3 (the call in flight when rank 2 died) to 29 with the
    # survivors [0, 1], then the job fell below min_world_size: a clear error, no hang.
    expected = {s: [0, 1, 2] if s < 3 else [0, 1] for s in range(30)}
    if got["step"] != 30 or ranks != expected:
        mt.fail(f"rank 0 averaged {ranks} and failed at step {got['step']}; expected steps "
                "0-2 with [0, 1, 2], 3-29 with [0, 1], a failure at step 30")
    if "min_world_size" not in got["message"]:
        mt.fail(f"the error below min_world_size does not say so: {got['code']}: "
                f"{got['message']}")
    print(f"rank 0: {got['code']} at step 30: {got['message']}")


def check_unreachable(modelavg, coordinator, group):
    with socket.socket() as s:  # a port nobody listens on (bound here, never listening)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        e = expect_raises("connect to nothing", modelavg.UnavailableError,
                          lambda: modelavg.connect(address, "job", rank=0, join_timeout=1.5),
                          address)
        took = time.monotonic() - start
    if not isinstance(e, ConnectionError) or e.code != "UNAVAILABLE":
        mt.fail(f"{type(e).__name__} {e.code} is not an UNAVAILABLE ConnectionError")
    if took > 15:
        mt.fail(f"the unreachable coordinator took {took:.1f} s to report (join_timeout 1.5 s)")
    expect_raises("list_jobs on nothing", modelavg.UnavailableError,
                  lambda: modelavg.list_jobs(coordinator=address, rpc_timeout=2))
    os.environ.pop("MODELAVG_COORDINATOR", None)
    expect_raises("no coordinator anywhere", modelavg.InvalidArgumentError,
                  lambda: modelavg.connect(job_id="x"), "MODELAVG_COORDINATOR")


def check_environment(modelavg, coordinator, group):
    work = group.temp_dir("modelavg-env-")
    token = os.path.join(work, "token")
    with open(token, "w") as f:
        f.write("py-operator-token\n")
    authed = mt.Coordinator(group, coordinator.binary,
                            extra_flags=[f"--auth_token_file={token}"])
    for var in ("MODELAVG_AUTH_TOKEN_FILE", "MODELAVG_TOKEN_FILE", "MODELAVG_AUTH_TOKEN",
                "MODELAVG_COORDINATOR"):
        os.environ.pop(var, None)
    expect_raises("no token", modelavg.PermissionDeniedError,
                  lambda: modelavg.list_jobs(coordinator=authed.address), "UNAUTHENTICATED")
    os.environ.update(MODELAVG_COORDINATOR=authed.address, MODELAVG_AUTH_TOKEN_FILE=token)
    modelavg.create_job("from-env", 1, "PERIODIC", period=2)  # coordinator and token: env
    if [j.spec.job_id for j in modelavg.list_jobs()] != ["from-env"]:
        mt.fail(f"list_jobs through the environment: {modelavg.list_jobs()}")
    expect_raises("a keyword token over the environment's", modelavg.PermissionDeniedError,
                  lambda: modelavg.list_jobs(auth_token="wrong"))
    # The old name, in a process of its own (the warning is once per process).
    code = """
        import modelavg
        modelavg.get_job("from-env")
        modelavg.get_job("from-env")
        print("ok")
    """
    env = {"MODELAVG_TOKEN_FILE": token, "MODELAVG_AUTH_TOKEN_FILE": ""}
    out, err = child(code, env, group, "old token variable").communicate(timeout=60)
    warned = [l for l in err.splitlines() if "MODELAVG_TOKEN_FILE is deprecated" in l]
    if out.strip() != "ok" or len(warned) != 1 or "MODELAVG_AUTH_TOKEN_FILE" not in warned[0]:
        mt.fail(f"$MODELAVG_TOKEN_FILE: stdout {out!r}, stderr {err[-2000:]!r}")
    if authed.stop() != 0:
        mt.fail(f"the coordinator with a token did not stop cleanly:\n{authed.log_tail()}")


def interrupt(proc, what, timeout_s):
    """SIGINT to `proc`; (stdout, stderr, seconds it took to end). Fails when it does not end
    within `timeout_s` or its stderr shows a crash, a sanitizer report or a call left running."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        mt.fail(f"Ctrl-C did not interrupt {what}, or the process did not exit, within "
                f"{timeout_s} s")
    took = time.monotonic() - sent
    for bad in ("ThreadSanitizer", "Segmentation", "Aborted", "Traceback", "still running",
                "terminate called"):
        if bad in err:
            mt.fail(f"the process interrupted in {what} has {bad!r} on stderr: {err[-3000:]}")
    return out, err, took


def check_interrupt(modelavg, coordinator, group):
    modelavg.create_job("never-complete", 2, "PERIODIC", period=2,
                        coordinator=coordinator.address)
    # Ctrl-C in connect: KeyboardInterrupt at once, and the abandoned Join is cancelled (the
    # coordinator frees the rank long before join_timeout). Then main returns: the interpreter's
    # exit waits for the cancelled call and ends cleanly (no crash, no report, no warning). With
    # WAIT_FOR_CANCEL=0 the process returns at once, while the cancelled call may still be ending.
    code = """
        import os, sys, time
        import modelavg

        def main():
            addr = os.environ["ADDR"]
            print("connecting", flush=True)
            start = time.monotonic()
            try:
                modelavg.connect(addr, "never-complete", rank=0, join_timeout=120)
                print("connect returned", flush=True)
                return 1
            except KeyboardInterrupt:
                print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
            if os.environ["WAIT_FOR_CANCEL"] == "1":
                interrupted = time.monotonic()
                while time.monotonic() - interrupted < 20:
                    job = modelavg.get_job("never-complete", coordinator=addr)
                    if not job.members and modelavg._core._background_calls_running() == 0:
                        print(f"join cancelled {time.monotonic() - interrupted:.2f} s after "
                              "the interrupt", flush=True)
                        return 0
                    time.sleep(0.05)
                print(f"the interrupted join is still pending: {job.members}", flush=True)
                return 3
            return 0

        if main() != 0:
            sys.exit(1)
    """
    for wait in ("1", "0"):
        proc = child(code, {"ADDR": coordinator.address, "WAIT_FOR_CANCEL": wait}, group,
                     f"waiter (wait for cancel {wait})")
        if not any(proc.stdout.readline().strip() == "connecting" for _ in range(20)):
            mt.fail("the child did not start connecting")
        time.sleep(1.0)  # inside connect's wait by now
        out, err, took = interrupt(proc, "connect", timeout_s=30)
        if proc.returncode != 0 or "interrupted after" not in out \
                or (wait == "1" and "join cancelled" not in out):
            mt.fail(f"exit {proc.returncode}, stdout {out!r}, stderr {err[-2000:]}")
        if took > 10:
            mt.fail(f"the interrupted process took {took:.1f} s to end")
        print(f"{' '.join(out.split())}; process ended {took:.2f} s after SIGINT")
        # The job is as before: the rank is free again (a later worker may take it).
        job = modelavg.get_job("never-complete", coordinator=coordinator.address)
        if job.members:
            mt.fail(f"the interrupted worker is still a member after its exit: {job.members}")

    # Ctrl-C in an averaging step whose peer never comes: KeyboardInterrupt at once; the averager
    # then refuses new calls while the interrupted collective may still write the tensors. That
    # call runs on (to collective_timeout, past the exit's bounded wait), so the process ends
    # with os._exit, as docs/python.md says for that case.
    modelavg.create_job("stuck-average", 2, "PERIODIC", period=1,
                        coordinator=coordinator.address)
    code = """
        import os, sys, time
        import torch, modelavg
        rank = int(os.environ["RANK"])
        client = modelavg.connect(os.environ["ADDR"], "stuck-average", rank=rank,
                                  collective_timeout=60)
        if rank == 1:
            time.sleep(60)  # never averages
            sys.exit(0)
        averager = modelavg.PeriodicModelAverager(client)
        p = torch.nn.Parameter(torch.ones(8))
        p.grad = torch.zeros(8)
        print("averaging", flush=True)
        start = time.monotonic()
        try:
            averager.average_parameters([p])
            print("average returned", flush=True)
            sys.exit(1)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
        try:
            averager.average_parameters([p])
        except modelavg.FailedPreconditionError as e:
            print(f"refused: {e}", flush=True)
            os._exit(0)
        sys.exit(2)
    """
    peer = child(code, {"ADDR": coordinator.address, "RANK": "1"}, group, "idle peer")
    proc = child(code, {"ADDR": coordinator.address, "RANK": "0"}, group, "averager")
    if not any(proc.stdout.readline().strip() == "averaging" for _ in range(50)):
        mt.fail("rank 0 did not start averaging")
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        mt.fail("Ctrl-C did not interrupt average_parameters within 20 s")
    took = time.monotonic() - sent
    peer.kill()
    if proc.returncode != 0 or "interrupted after" not in out or "refused:" not in out \
            or "interrupted average_parameters call" not in out:
        mt.fail(f"averaging: exit {proc.returncode}, stdout {out!r}, stderr {err[-2000:]}")
    for bad in ("ThreadSanitizer", "Segmentation", "Aborted", "still running",
                "terminate called"):
        if bad in err:
            mt.fail(f"the interrupted averaging process's stderr has {bad!r}: {err[-3000:]}")
    if took > 15:
        mt.fail(f"the interrupted averaging process took {took:.1f} s to end")
    print(f"averaging interrupted; process ended {took:.2f} s after SIGINT")

    # Ctrl-C in a leave that retries through a coordinator outage (leave_timeout 30 s): the
    # abandoned Leave is cancelled, so no call is left running and the exit is clean.
    gone = mt.Coordinator(group, coordinator.binary)
    modelavg.create_job("leave-outage", 1, "PERIODIC", period=1, coordinator=gone.address)
    flag = os.path.join(group.temp_dir("modelavg-leave-"), "coordinator-killed")
    code = """
        import os, sys, time
        import modelavg

        def main():
            client = modelavg.connect(os.environ["ADDR"], "leave-outage", rank=0,
                                      leave_timeout=30)
            print("connected", flush=True)
            while not os.path.exists(os.environ["FLAG"]):
                time.sleep(0.02)
            print("leaving", flush=True)
            start = time.monotonic()
            try:
                client.leave("done")
                print("leave returned", flush=True)
                return 1
            except KeyboardInterrupt:
                print(f"interrupted after {time.monotonic() - start:.2f} s", flush=True)
            interrupted = time.monotonic()
            while modelavg._core._background_calls_running() != 0:
                if time.monotonic() - interrupted > 5:
                    print("the interrupted leave is still running", flush=True)
                    return 3
                time.sleep(0.02)
            print(f"leave cancelled {time.monotonic() - interrupted:.2f} s after the interrupt",
                  flush=True)
            return 0

        sys.exit(main())
    """
    proc = child(code, {"ADDR": gone.address, "FLAG": flag}, group, "leaver")
    if not any(proc.stdout.readline().strip() == "connected" for _ in range(50)):
        mt.fail("the leaver did not connect")
    gone.proc.kill()
    gone.proc.wait()
    open(flag, "w").close()
    if not any(proc.stdout.readline().strip() == "leaving" for _ in range(50)):
        mt.fail("the leaver did not start leaving")
    time.sleep(1.0)  # retrying against the dead coordinator by now
    out, err, took = interrupt(proc, "leave", timeout_s=20)
    if proc.returncode != 0 or "interrupted after" not in out or "leave cancelled" not in out:
        mt.fail(f"leave: exit {proc.returncode}, stdout {out!r}, stderr {err[-2000:]}")
    print(f"{' '.join(out.split())}; process ended {took:.2f} s after SIGINT")


def check_jobs_and_client(modelavg, coordinator, group):
    addr = coordinator.address
    job = modelavg.create_job("jobs-1", 4, "hierarchical", {2: 2, 4: 4}, warmup_steps=3,
                              coordinator=addr)
    if (job.spec.mode, job.spec.levels, job.spec.warmup_steps, job.state) != \
            ("HIERARCHICAL", [(2, 2), (4, 4)], 3, "PENDING"):
        mt.fail(f"create_job returned {job}")
    got = modelavg.get_job("jobs-1", coordinator=addr)
    if got.spec != job.spec or got.generation != 1:
        mt.fail(f"get_job: {got} after creating {job}")
    modelavg.create_job("jobs-2", 1, "PERIODIC", period=1, coordinator=addr)
    names = [j.spec.job_id for j in modelavg.list_jobs(coordinator=addr)]
    if names != ["jobs-1", "jobs-2"]:
        mt.fail(f"list_jobs: {names}")
    expect_raises("duplicate job", modelavg.AlreadyExistsError,
                  lambda: modelavg.create_job("jobs-1", 4, "PERIODIC", period=2,
                                              coordinator=addr), "jobs-1")
    expect_raises("group size not dividing the world", ValueError,
                  lambda: modelavg.create_job("bad", 4, "HIERARCHICAL", [(2, 3), (4, 4)],
                                              coordinator=addr), "group_size", "3")
    expect_raises("min_world_size above the world", ValueError,
                  lambda: modelavg.create_job("bad", 4, "PERIODIC", period=2, min_world_size=5,
                                              coordinator=addr), "min_world_size", "5")
    elastic = modelavg.create_job("jobs-elastic", 4, "PERIODIC", period=2, min_world_size=3,
                                  coordinator=addr)
    if elastic.spec.min_world_size != 3 or \
            modelavg.get_job("jobs-elastic", coordinator=addr).spec.min_world_size != 3:
        mt.fail(f"min_world_size did not round-trip: {elastic}")
    modelavg.delete_job("jobs-elastic", coordinator=addr)
    expect_raises("unknown mode", ValueError,
                  lambda: modelavg.create_job("bad", 4, "SOMETIMES", period=2,
                                              coordinator=addr), "SOMETIMES")
    expect_raises("unknown option", TypeError,
                  lambda: modelavg.connect(addr, "jobs-2", join_timout=3), "join_timout")
    expect_raises("negative timeout", ValueError,
                  lambda: modelavg.connect(addr, "jobs-2", join_timeout=-1), "join_timeout")
    modelavg.delete_job("jobs-1", coordinator=addr)
    expect_raises("deleted job", modelavg.NotFoundError,
                  lambda: modelavg.get_job("jobs-1", coordinator=addr))

    # A world of one: the client's properties, decisions, the wrong averager, leaving.
    import torch
    with modelavg.connect(addr, "jobs-2", rank=0) as client:
        if (client.rank, client.world_size, client.generation, client.job_id,
                client.admission_step, client.elastic) != (0, 1, 1, "jobs-2", -1, False):
            mt.fail(f"client: {client!r}, admission_step {client.admission_step}")
        running = modelavg.get_job("jobs-2", coordinator=addr)
        if (running.live_world_size, running.vacant_ranks, running.deaths, running.admissions,
                running.spec.min_world_size, [m.admitted_step for m in running.members]) != \
                (1, [], 0, 0, 0, [-1]):
            mt.fail(f"a running strict job of one: {running}")
        expect_raises("hierarchical averager on a periodic job",
                      modelavg.FailedPreconditionError,
                      lambda: modelavg.HierarchicalModelAverager(client), "PERIODIC")
        averager = modelavg.PeriodicModelAverager(client)
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.zeros(3)
        d = averager.average_parameters([p])
        if (d.step, d.action, d.average, d.level, d.ranks, d.members, d.joining,
                d.generation) != (0, "AVERAGE", True, 0, [0], [0], [], 1):
            mt.fail(f"decision {d!r}")
        expect_raises("a plain tensor (PyTorch refuses it too)", NotImplementedError,
                      lambda: averager.average_parameters([torch.ones(3)]), "not supported")
        if averager.step != 1:
            mt.fail(f"step {averager.step}: an input PyTorch refuses must not use up a step")
        expect_raises("negative step", ValueError, lambda: setattr(averager, "step", -1),
                      "negative")
    state = modelavg.get_job("jobs-2", coordinator=addr).state
    if state != "FINISHED":
        mt.fail(f"after the with-block the job is {state}, not FINISHED (the client left)")

    # Two ranks on two threads of one process: each connect and each averaging step waits for
    # the other thread's, which can only run if the waiting thread released the GIL.
    modelavg.create_job("threads", 2, "PERIODIC", period=1, coordinator=addr)
    results, errors = {}, []

    def rank_thread(rank):
        try:
            client = modelavg.connect(addr, "threads", rank=rank, join_timeout=30)
            averager = modelavg.PeriodicModelAverager(client)
            p = torch.nn.Parameter(torch.full((4,), float(rank * 2)))
            p.grad = torch.zeros(4)
            for _ in range(3):
                averager.average_parameters([p])
            results[rank] = p.detach().tolist()
            client.leave()
        except Exception as e:  # reported below
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors or any(t.is_alive() for t in threads):
        mt.fail(f"two ranks on two threads: {errors or 'still running after 60 s'}")
    if results != {0: [1.0] * 4, 1: [1.0] * 4}:
        mt.fail(f"two ranks on two threads averaged to {results}")


def check_outer_spec(modelavg, coordinator, group):
    """DiLoCo levels: modelavg.Level / OuterSGD beside plain pairs, round-tripped by get_job and
    Client.spec; a bad rule is an InvalidArgumentError naming the field."""
    addr = coordinator.address
    outer = modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)
    levels = [(2, 2), modelavg.Level(8, 4, outer=outer)]
    job = modelavg.create_job("outer-1", 4, "HIERARCHICAL", levels, coordinator=addr)
    if job.spec.levels != levels:
        mt.fail(f"create_job returned levels {job.spec.levels}, asked for {levels}")
    if modelavg.get_job("outer-1", coordinator=addr).spec.levels != levels:
        mt.fail("get_job did not return the outer level")
    # A Level without outer is a plain level.
    plain = modelavg.create_job("outer-2", 2, "PERIODIC", [modelavg.Level(4, 2)],
                                coordinator=addr)
    if plain.spec.levels != [(4, 2)]:
        mt.fail(f"Level(4, 2) came back as {plain.spec.levels}")
    bad = [(modelavg.OuterSGD(0.0), "levels[0].outer.lr"),
           (modelavg.OuterSGD(float("nan")), "levels[0].outer.lr"),
           (modelavg.OuterSGD(0.7, momentum=1.0), "levels[0].outer.momentum"),
           (modelavg.OuterSGD(0.7, nesterov=True), "levels[0].outer.nesterov")]
    for sgd, field in bad:
        expect_raises(f"outer {sgd}", modelavg.InvalidArgumentError,
                      lambda: modelavg.create_job("outer-bad", 2, "PERIODIC",
                                                  [modelavg.Level(4, 2, outer=sgd)],
                                                  coordinator=addr), field)
    expect_raises("outer not an OuterSGD", ValueError,
                  lambda: modelavg.create_job("outer-bad", 2, "PERIODIC",
                                              [modelavg.Level(4, 2, outer=(0.7, 0.9))],
                                              coordinator=addr), "OuterSGD")
    # The client sees the rule too, and the averager's state starts empty.
    proc = child(f"""
        import modelavg
        c = modelavg.connect({addr!r}, "outer-2", rank=1, join_timeout=30)
        a = modelavg.PeriodicModelAverager(c)
        assert a.state_dict() == {{"step": 0, "anchors": {{}}, "momenta": {{}}}}, a.state_dict()
        c.leave()
    """, group=group, name="outer-rank1")
    client = modelavg.connect(addr, "outer-2", rank=0, join_timeout=30)
    averager = modelavg.PeriodicModelAverager(client)
    expect_raises("load_state_dict for a plain level", modelavg.InvalidArgumentError,
                  lambda: averager.load_state_dict({"step": 3, "anchors": {0: []},
                                                    "momenta": {}}), "no outer optimizer")
    client.leave()
    if proc.wait(timeout=60) != 0:
        mt.fail(f"outer-rank1 failed: {proc.stderr.read()}")
    with_outer = modelavg.create_job("outer-3", 1, "PERIODIC",
                                     [modelavg.Level(2, 1, outer=outer)], coordinator=addr)
    client = modelavg.connect(addr, "outer-3", rank=0, join_timeout=30)
    if client.spec.levels != with_outer.spec.levels:
        mt.fail(f"Client.spec levels {client.spec.levels}")
    client.leave()


def check_streaming_spec(modelavg, coordinator, group):
    """Streaming levels: Level(fragments=, sync_delay=, mix=, payload=) round-tripped by
    create_job, get_job and Client.spec; a bad field is an InvalidArgumentError naming it, from
    the package and (for a Level that skipped its own checks) from the coordinator; the
    drop-in's Level must describe its level; a streaming state for another job's level is
    refused."""
    addr = coordinator.address
    sgd = modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)
    level = modelavg.Level(8, 4, outer=sgd, fragments=4, sync_delay=1, mix=0.25, payload="int8")
    if level.payload != "INT8" or not level.streaming:
        mt.fail(f"Level did not normalize its payload: {level}")
    levels = [modelavg.Level(2, 2, fragments=2), level]
    job = modelavg.create_job("streaming-1", 4, "HIERARCHICAL", levels, coordinator=addr)
    if job.spec.levels != levels:
        mt.fail(f"create_job returned levels {job.spec.levels}, asked for {levels}")
    if modelavg.get_job("streaming-1", coordinator=addr).spec.levels != levels:
        mt.fail("get_job did not return the streaming fields")
    # Error feedback and the 4-bit and top-k payloads round-trip too.
    for i, fb in enumerate([modelavg.Level(8, 4, outer=sgd, payload="INT4", error_feedback=0.9),
                            modelavg.Level(8, 4, outer=sgd, payload="TOPK", topk_density=0.02,
                                           error_feedback=1.0),
                            modelavg.Level(8, 4, outer=sgd, payload="topk_int2",
                                           topk_density=0.02, error_feedback=1.0)]):
        got = modelavg.create_job(f"feedback-{i}", 4, "PERIODIC", [fb], coordinator=addr)
        if got.spec.levels != [fb]:
            mt.fail(f"create_job returned levels {got.spec.levels}, asked for {[fb]}")
    # Defaults are a plain (period, group_size) pair or a DiLoCo Level, as before.
    same = modelavg.create_job("streaming-2", 1, "PERIODIC",
                               [modelavg.Level(4, 1, fragments=1, payload="FP32")],
                               coordinator=addr)
    if same.spec.levels != [(4, 1)]:
        mt.fail(f"a Level with default streaming fields came back as {same.spec.levels}")
    bad = [(dict(fragments=3), "fragments=3 does not divide the period 8"),
           (dict(fragments=0), "fragments=0"),
           (dict(fragments=2.0), "fragments=2.0"),
           (dict(sync_delay=-1), "sync_delay=-1"),
           (dict(fragments=4, sync_delay=2), "sync_delay=2 must be below period / fragments = 2"),
           (dict(mix=1.5), "mix=1.5"),
           (dict(mix=True), "mix=True"),
           (dict(payload="FP8"), "payload='FP8': expected one of FP32, BF16, INT8"),
           (dict(payload="INT4", error_feedback=1.5), "error_feedback=1.5"),
           (dict(payload="INT4", error_feedback=-0.5), "error_feedback=-0.5"),
           (dict(error_feedback=1.0), "error_feedback=1.0 needs a compressed payload"),
           (dict(payload="TOPK"), "topk_density=0.0"),
           (dict(payload="TOPK", topk_density=1.0), "topk_density=1.0"),
           (dict(payload="INT8", topk_density=0.1), "topk_density=0.1 needs payload TOPK"),
           # TOPK_INT2's fields, as the binding's table says (not a copy in the package).
           (dict(payload="TOPK_INT2"),
            "topk_density=0.0 must be in (0, 1) with payload TOPK_INT2"),
           (dict(payload="TOPK_INT2", topk_density=1.5), "topk_density=1.5"),
           (dict(payload="BF16", topk_density=0.1), "needs payload TOPK or TOPK_INT2"),
           (dict(error_feedback=1.0), "(BF16, INT8, INT4, TOPK or TOPK_INT2)"),
           (dict(payload="INT2"), "expected one of FP32, BF16, INT8, INT4, TOPK or TOPK_INT2")]
    for fields, text in bad:
        expect_raises(f"Level(8, 4, outer, **{fields})", modelavg.InvalidArgumentError,
                      lambda: modelavg.Level(8, 4, outer=sgd, **fields), text)
    for fields in (dict(payload="BF16"), dict(sync_delay=1), dict(mix=0.5),
                   dict(payload="INT4", error_feedback=1.0)):
        expect_raises(f"plain Level(8, 4, **{fields})", ValueError,
                      lambda: modelavg.Level(8, 4, **fields), "outer=modelavg.OuterSGD(1.0)")
    # The coordinator checks the spec again (a Level whose fields were changed after its own
    # checks): INVALID_ARGUMENT naming the field.
    sneaky = modelavg.Level(8, 2, outer=sgd)
    object.__setattr__(sneaky, "fragments", 3)
    expect_raises("a Level past its own checks", modelavg.InvalidArgumentError,
                  lambda: modelavg.create_job("streaming-bad", 2, "PERIODIC", [sneaky],
                                              coordinator=addr), "levels[0].fragments")
    plain = modelavg.Level(8, 2)
    object.__setattr__(plain, "payload", "BF16")
    expect_raises("a compressed payload on a plain level", modelavg.InvalidArgumentError,
                  lambda: modelavg.create_job("streaming-bad", 2, "PERIODIC", [plain],
                                              coordinator=addr), "levels[0].payload")
    beyond = modelavg.Level(8, 2, outer=sgd, payload="INT4")
    object.__setattr__(beyond, "error_feedback", 2.0)
    expect_raises("error_feedback past its own checks", modelavg.InvalidArgumentError,
                  lambda: modelavg.create_job("streaming-bad", 2, "PERIODIC", [beyond],
                                              coordinator=addr), "levels[0].error_feedback")
    # Every streaming field runs in an elastic job, sync_delay included.
    modelavg.create_job("streaming-elastic-delay", 4, "PERIODIC",
                        [modelavg.Level(8, 4, outer=sgd, fragments=2, sync_delay=1)],
                        min_world_size=2, coordinator=addr)
    modelavg.create_job("streaming-elastic", 4, "PERIODIC",
                        [modelavg.Level(8, 4, outer=sgd, fragments=2, payload="INT8")],
                        min_world_size=2, coordinator=addr)
    # The drop-in: a Level in `outer` must describe its level.
    import modelavg.torch
    os.environ.update({"MODELAVG_COORDINATOR": addr, "MODELAVG_JOB": "streaming-dropin",
                       "RANK": "0", "WORLD_SIZE": "1"})
    expect_raises("drop-in Level of another group size", ValueError,
                  lambda: modelavg.torch.PeriodicModelAverager(
                      period=8, outer=modelavg.Level(8, 2, outer=sgd, fragments=2)),
                  "group_size 1")
    dropin = modelavg.torch.PeriodicModelAverager(
        period=8, outer=modelavg.Level(8, 1, outer=sgd, fragments=2, sync_delay=1))
    want = [modelavg.Level(8, 1, outer=sgd, fragments=2, sync_delay=1)]
    if dropin.client.spec.levels != want:
        mt.fail(f"the drop-in's job has levels {dropin.client.spec.levels}, expected {want}")
    if [t.level for t in dropin.traffic()] != [0] or dropin.traffic()[0].bytes_sent != 0:
        mt.fail(f"traffic() before any step: {dropin.traffic()}")
    expect_raises("fragment state for a level that has none", modelavg.InvalidArgumentError,
                  lambda: dropin.load_state_dict({"step": 3, "anchors": {}, "momenta": {},
                                                  "fragments": {0: {5: {"anchor": []}}}}),
                  "fragment 5 of level 0, which has 2 fragments")
    expect_raises("whole-level anchors for a streaming level", modelavg.InvalidArgumentError,
                  lambda: dropin.load_state_dict({"step": 3, "anchors": {0: []}, "momenta": {}}),
                  "per fragment")
    import torch
    x = torch.nn.Parameter(torch.ones(4))
    x.grad = torch.zeros(4)
    d = dropin.average_parameters([x])
    if (d.level, d.fragment, d.fragments) != (0, 0, 2):
        mt.fail(f"step 0 decided {d}, expected level 0, fragment 0 of 2")
    state = dropin.state_dict()
    if len(state.get("pending", [])) != 1 or state["pending"][0]["first"] is not True:
        mt.fail(f"state_dict after a delayed first sync: {state}")
    bad_state = dict(state, pending=[dict(state["pending"][0], error="UNAVAILABLE: gone")])
    expect_raises("a failed pending sync", modelavg.FailedPreconditionError,
                  lambda: dropin.load_state_dict(bad_state), "had failed", "earlier checkpoint")
    dropin.load_state_dict(state)  # its own state fits
    dropin.average_parameters([x])
    if dropin.traffic()[0].bytes_sent < 0:
        mt.fail(f"traffic after a step: {dropin.traffic()}")
    dropin.client.leave()


def check_nonfinite(modelavg, coordinator, group):
    modelavg.create_job("nonfinite", 4, "HIERARCHICAL", [(2, 2), (4, 4)],
                        coordinator=coordinator.address)
    code = """
        import json, math, os, sys
        import torch, modelavg
        rank = int(os.environ["RANK"])
        client = modelavg.connect(os.environ["ADDR"], "nonfinite", rank=rank)
        averager = modelavg.HierarchicalModelAverager(client)
        p = torch.nn.Parameter(torch.full((1000,), float(rank)))
        p.grad = torch.zeros_like(p)
        for step in range(40):
            with torch.no_grad():
                p += 1.0
                if rank == 2 and step == 28:
                    p[5] = float("nan")
            before = p.detach().clone()
            try:
                averager.average_parameters([p])
            except modelavg.NonFiniteError as e:
                after = p.detach()
                print(json.dumps({"step": step, "rank": e.rank, "e_step": e.step,
                                  "level": e.level, "tensor": e.tensor, "value": e.value,
                                  "unchanged": bool(torch.equal(before.nan_to_num(7.0),
                                                                after.nan_to_num(7.0))),
                                  "message": e.message}))
                sys.exit(0)
        print(json.dumps({"error": "no NonFiniteError"}))
        sys.exit(1)
    """
    procs = [child(code, {"RANK": str(r), "ADDR": coordinator.address}, group, f"rank {r}")
             for r in range(4)]
    results = mt.wait_all(procs, timeout_s=90)
    for r in range(4):
        rc, out, err = results[f"rank {r}"]
        lines = [l for l in out.splitlines() if l.startswith("{")]
        if rc != 0 or not lines:
            mt.fail(f"rank {r} exited {rc}:\n{out}\n{err[-2000:]}")
        got = json.loads(lines[-1])
        want = {"step": 28, "rank": 2, "e_step": 28, "level": 1, "tensor": 0, "value": "NaN",
                "unchanged": True}
        if {k: got.get(k) for k in want} != want or "non-finite" not in got["message"]:
            mt.fail(f"rank {r}: {got}, expected {want}")


CHECKS = {
    "outer_spec": check_outer_spec,
    "streaming_spec": check_streaming_spec,
    "no_such_job": check_no_such_job,
    "spec_mismatch": check_spec_mismatch,
    "dead_peer": check_dead_peer,
    "elastic_below_min": check_elastic_below_min,
    "unreachable": check_unreachable,
    "environment": check_environment,
    "interrupt": check_interrupt,
    "jobs_and_client": check_jobs_and_client,
    "nonfinite": check_nonfinite,
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_api(name, suite_args):
    import modelavg
    environ = dict(os.environ)  # the checks set MODELAVG_COORDINATOR, RANK, ...
    try:
        with mt.ProcessGroup() as group:
            coordinator = mt.Coordinator(group, suite_args.coordinator_bin)
            CHECKS[name](modelavg, coordinator, group)
            if coordinator.stop() != 0:
                mt.fail(f"{name}: the coordinator did not stop cleanly:\n"
                        f"{coordinator.log_tail()}")
    finally:
        os.environ.clear()
        os.environ.update(environ)
