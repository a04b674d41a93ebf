"""A running job's period changed from Python (modelavg.update_job; one CTest test).

Starts a coordinator and a PERIODIC job (world 2, period 4), then two worker processes (the
explicit API: modelavg.connect + PeriodicModelAverager, CPU float64 tensors, Gloo on 127.0.0.1)
that run STEPS steps of about 10 ms, writing one JSON line per step (decision, parameters before
and after). Once both are past step MIN_STEP, ``update_job(JOB, period=8)`` changes the period; the
test then asserts that

  * the answer's switch step E is past every step the members had reported when it was given,
    its plan_version is 1, and its job's pending_plan is the new plan from E;
  * get_job, once every member passed E: plan_history [version 0 from step 0 with period 4,
    version 1 from E with period 8], plan_version 1, spec period 8, no pending plan;
  * every rank's decision at every step follows the plan in force at that step (period 4 before
    E, 8 from E on: a naive restatement of PyTorch's rule), and every averaging result is the
    mean of both ranks' values before the step, on both ranks (float64);
  * refused updates (a mode change; nothing to change) raise InvalidArgumentError naming the
    field and leave the plan history as it was.

  pytest tests/python/plan_update_test.py      (conftest.py: which build)
"""

import json
import os
import sys
import textwrap
import time

import modelavg_testing as mt

JOB = "update-py"
WORLD = 2
PERIOD, NEW_PERIOD = 4, 8
MIN_STEP = 10       # both ranks past it before the update
AFTER = 3 * NEW_PERIOD  # get_job is read once every rank is this far past the switch step
STEPS = 600         # each worker's steps: the update comes at about step MIN_STEP

WORKER = """
    import json, os, sys, time
    import torch
    import modelavg

    torch.set_num_threads(1)
    out = open(os.environ["OUT"], "w")

    def emit(**kv):
        out.write(json.dumps(kv) + "\\n")
        out.flush()

    client = modelavg.connect(os.environ["ADDR"], os.environ["JOB"], rank=int(os.environ["RANK"]),
                              collective_timeout=30)
    averager = modelavg.PeriodicModelAverager(client)
    p = torch.nn.Parameter(torch.arange(8, dtype=torch.float64) * 0.5 + client.rank)
    p.grad = torch.zeros_like(p)  # PyTorch's averagers average the parameters that have a grad
    for _ in range(int(os.environ["STEPS"])):
        with torch.no_grad():
            p.add_((client.rank + 1) * 0.25)  # this rank's "training"
        pre = p.detach().tolist()
        d = averager.average_parameters([p])
        emit(step=d.step, average=d.average, period=d.period, pre=pre, post=p.detach().tolist())
        time.sleep(0.01)
    emit(event="done", step=averager.step)
    time.sleep(0.5)  # let the last round settle everywhere before the membership changes
    client.leave()
"""


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tail(path, n=40):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run(args):
    import modelavg
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin)
        addr = coordinator.address
        modelavg.create_job(JOB, WORLD, "PERIODIC", period=PERIOD, heartbeat_timeout_ms=3000,
                            coordinator=addr)
        work = group.temp_dir("modelavg-update-py-")
        env_base = dict(os.environ, PYTHONPATH=args.python_dir, ADDR=addr, JOB=JOB,
                        STEPS=str(STEPS))
        code = textwrap.dedent(WORKER)
        outs, logs, procs = {}, {}, {}
        for r in range(WORLD):
            name = f"rank{r}"
            outs[name] = os.path.join(work, f"{name}.jsonl")
            logs[name] = os.path.join(work, f"{name}.log")
            log = open(logs[name], "w")
            procs[name] = group.start([sys.executable, "-c", code], name,
                                      env=dict(env_base, OUT=outs[name], RANK=str(r)),
                                      stdout=log, stderr=log)

        def failure(message):
            detail = "".join(f"\n--- {n} log:\n{tail(logs[n])}" for n in procs)
            mt.fail(f"{message}{detail}\n--- coordinator log:\n{coordinator.log_tail(40)}")

        deadline = time.monotonic() + args.timeout_s

        def poll(what, predicate):
            while time.monotonic() < deadline:
                for n, p in procs.items():
                    if p.poll() not in (None, 0):
                        failure(f"{n} exited {p.returncode} while waiting for {what}")
                job = mt.poll_job(modelavg, JOB, addr, deadline)
                if predicate(job):
                    return job
                time.sleep(0.05)
            failure(f"timed out waiting for {what}")

        poll(f"both ranks past step {MIN_STEP}",
             lambda j: j.state == "RUNNING" and j.min_step >= MIN_STEP)

        # Refused: nothing changes.
        for kwargs, field in (({"mode": "HIERARCHICAL"}, "mode"), ({}, "nothing to change")):
            try:
                modelavg.update_job(JOB, coordinator=addr, **kwargs)
                failure(f"update_job({kwargs}) was accepted")
            except modelavg.InvalidArgumentError as e:
                if field not in str(e):
                    failure(f"update_job({kwargs}) raised {e!r}, which does not name {field}")
        if len(modelavg.get_job(JOB, coordinator=addr).plan_history) != 1:
            failure("a refused update changed the plan history")

        update = modelavg.update_job(JOB, period=NEW_PERIOD, coordinator=addr)
        e = update.switch_step
        reported = [m.last_step for m in update.job.members]
        if update.plan_version != 1 or not all(e > s for s in reported):
            failure(f"update_job answered {update}: expected version 1 and a switch step past "
                    f"the members' steps {reported}")
        pending = update.job.pending_plan
        if pending is None or pending.version != 1 or pending.switch_step != e \
                or pending.spec.levels != [(NEW_PERIOD, WORLD)]:
            failure(f"the answer's pending plan: {pending}")

        if e + AFTER > STEPS:
            failure(f"switch step {e}: too late for the {STEPS} steps of the workers")
        switched = poll(f"both ranks past the switch step {e} + {AFTER}",
                        lambda j: j.min_step >= e + AFTER)
        history = [(c.version, c.switch_step, c.spec.levels) for c in switched.plan_history]
        if history != [(0, 0, [(PERIOD, WORLD)]), (1, e, [(NEW_PERIOD, WORLD)])] \
                or switched.plan_version != 1 or switched.pending_plan is not None \
                or switched.spec.levels != [(NEW_PERIOD, WORLD)]:
            failure(f"get_job after the switch: history {history}, plan_version "
                    f"{switched.plan_version}, pending {switched.pending_plan}, spec "
                    f"{switched.spec}")
        for n, p in procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired
                failure(f"{n} did not finish within {args.timeout_s} s")
            if p.returncode != 0:
                failure(f"{n} exited {p.returncode}")
        steps = {n: {l["step"]: l for l in read_lines(outs[n]) if "event" not in l}
                 for n in procs}
        checked = check(steps, e, STEPS, failure)
        if coordinator.stop() != 0:
            failure("the coordinator did not stop cleanly")
    print(f"PASS plan update: period {PERIOD} -> {NEW_PERIOD} from step {e}; {checked} "
          f"decisions checked on {WORLD} ranks")


def check(steps, e, end, failure):
    """Every rank ran steps 0..end-1; each decision is the plan's in force at its step; each
    averaging result is the mean of the ranks' values before it."""
    for n, s in steps.items():
        if sorted(s) != list(range(end)):
            failure(f"{n} ran steps {min(s, default=None)}..{max(s, default=None)} "
                    f"({len(s)} of them), not 0..{end - 1}")
    checked = 0
    for step in range(end):
        period = PERIOD if step < e else NEW_PERIOD
        average = step % period == 0
        ds = {n: s[step] for n, s in steps.items()}
        for n, d in ds.items():
            if d["average"] != average or (average and d["period"] != period):
                failure(f"step {step} (switch at {e}): {n} decided average={d['average']} "
                        f"period={d['period']}; the plan in force says average={average} "
                        f"period={period}")
            checked += 1
        if not average:
            continue
        for i in range(len(ds["rank0"]["pre"])):
            mean = sum(d["pre"][i] for d in ds.values()) / len(ds)
            for n, d in ds.items():
                if abs(d["post"][i] - mean) > 1e-12 * max(1.0, abs(mean)):
                    failure(f"step {step}: {n}'s element {i} is {d['post'][i]}, the mean of "
                            f"the ranks' values is {mean}")
    return checked


def test_plan_update(suite_args):
    if "MODELAVG_TEST_TIMEOUT_S" not in os.environ:
        suite_args.timeout_s = 90
    run(suite_args)
