"""An elastic job from Python: a worker killed mid-run, then a replacement (one CTest test).

Starts a coordinator and an elastic PERIODIC job (world 4, min_world_size 3, period 2), then four
worker processes (the explicit API: modelavg.connect + PeriodicModelAverager, CPU tensors, Gloo
on 127.0.0.1). Rank 3 kills itself with SIGKILL right before its averaging call at step
KILL_STEP, while the others are entering theirs. Once the coordinator shows the shrink
(live_world_size 3, vacant_ranks [3]), a replacement process starts through the drop-in
(modelavg.torch.PeriodicModelAverager, no RANK: it takes the vacant rank). Every process writes
one JSON line per step (decision, parameters before and after); the test then asserts that

  * the survivors ran every step from 0 to the end without an exception and exit 0;
  * every averaging decision lists as ranks/members the ranks that averaged: all four before
    the kill, [0, 1, 2] from KILL_STEP (the call in flight is retried with the survivors) until
    the admission, all four again from then on; the generation moves at the kill and at the
    admission;
  * every averaging result is the same on every member and is the mean of the contributing
    members' values before the step (the joining replacement contributes nothing);
  * the replacement has admission_step > 0, its averager starts there, its first decision is
    at that step with joining == [3], and its parameters equal the others' after it;
  * get_job shows min_world_size, live_world_size, vacant_ranks, deaths, admissions and the
    replacement's admitted_step.

  pytest tests/python/elastic_test.py      (conftest.py: which build)
"""

import json
import os
import signal
import sys
import textwrap
import time

import modelavg_testing as mt

JOB = "elastic-py"
WORLD = 4
MIN_WORLD = 3
PERIOD = 2
KILL_RANK = 3
KILL_STEP = 10      # an averaging step: the survivors are in that call when rank 3 dies
TAIL = 6            # everyone stops at admission step + TAIL (the last step is a skip)
MAX_STEPS = 3000    # the survivors' bound if no replacement ever comes
HEARTBEAT_TIMEOUT_MS = 2000

WORKER = """
    import json, os, signal, sys, time
    import torch
    import modelavg

    torch.set_num_threads(1)
    role, addr = os.environ["ROLE"], os.environ["ADDR"]
    kill_rank, kill_step = int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"])
    tail, max_steps = int(os.environ["TAIL"]), int(os.environ["MAX_STEPS"])
    out = open(os.environ["OUT"], "w")

    def emit(**kv):
        out.write(json.dumps(kv) + "\\n")
        out.flush()

    p = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))
    p.grad = torch.zeros_like(p)
    if role == "member":
        client = modelavg.connect(addr, os.environ["JOB"], rank=int(os.environ["RANK"]),
                                  collective_timeout=30)
        averager = modelavg.PeriodicModelAverager(client)
        with torch.no_grad():
            p.copy_(torch.arange(16, dtype=torch.float64) * 0.25 + client.rank)
    else:  # the replacement, through the drop-in, without RANK
        os.environ.update(MODELAVG_COORDINATOR=addr, MODELAVG_JOB=os.environ["JOB"],
                          WORLD_SIZE=os.environ["WORLD"],
                          MODELAVG_MIN_WORLD_SIZE=os.environ["MIN_WORLD"])
        os.environ.pop("RANK", None)
        import modelavg.torch
        averager = modelavg.torch.PeriodicModelAverager(period=int(os.environ["PERIOD"]))
        client = averager.client
        with torch.no_grad():
            p.fill_(1000.0)  # whatever it holds is overwritten at its admission
    emit(event="start", rank=client.rank, admission_step=client.admission_step,
         elastic=client.elastic, step=averager.step, repr=repr(client))
    end = None
    for _ in range(max_steps):
        step = averager.step
        if end is not None and step >= end:
            break
        if role == "member" and client.rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            p.add_(client.rank + 1)  # this rank's "training"
        pre = p.detach().tolist()
        d = averager.average_parameters([p])
        emit(step=d.step, average=d.average, ranks=d.ranks, members=d.members,
             joining=d.joining, generation=d.generation, subgroup=d.subgroup, pre=pre,
             post=p.detach().tolist(), repr=repr(d))
        if d.joining and end is None:
            end = d.step + tail
        time.sleep(0.03)
    emit(event="done", step=averager.step)
    time.sleep(0.5)  # let the last round settle everywhere before the membership changes
    client.leave()
"""


def read_lines(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except (OSError, ValueError) as e:
        return [{"event": "unreadable", "error": str(e)}]


def tail(path, n=40):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run(args):
    import modelavg
    started = time.monotonic()
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin)
        addr = coordinator.address
        job = modelavg.create_job(JOB, WORLD, "PERIODIC", period=PERIOD,
                                  min_world_size=MIN_WORLD,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, coordinator=addr)
        if job.spec.min_world_size != MIN_WORLD or job.state != "PENDING":
            mt.fail(f"create_job returned {job}")
        work = group.temp_dir("modelavg-elastic-py-")
        env_base = dict(os.environ, PYTHONPATH=args.python_dir, ADDR=addr, JOB=JOB,
                        WORLD=str(WORLD), MIN_WORLD=str(MIN_WORLD), PERIOD=str(PERIOD),
                        KILL_RANK=str(KILL_RANK), KILL_STEP=str(KILL_STEP), TAIL=str(TAIL),
                        MAX_STEPS=str(MAX_STEPS))
        code = textwrap.dedent(WORKER)
        logs, outs, procs = {}, {}, {}

        def start(name, **env):
            outs[name] = os.path.join(work, f"{name}.jsonl")
            logs[name] = os.path.join(work, f"{name}.log")
            log = open(logs[name], "w")
            procs[name] = group.start([sys.executable, "-c", code], name,
                                      env=dict(env_base, OUT=outs[name], **env),
                                      stdout=log, stderr=log)

        for r in range(WORLD):
            start(f"rank{r}", ROLE="member", RANK=str(r))

        def failure(message):
            detail = "".join(f"\n--- {n} log:\n{tail(logs[n])}" for n in procs)
            mt.fail(f"{message}{detail}\n--- coordinator log:\n{coordinator.log_tail(40)}")

        deadline = time.monotonic() + args.timeout_s

        def poll(what, predicate):
            while time.monotonic() < deadline:
                for n, p in procs.items():
                    if p.poll() not in (None, 0) and n != f"rank{KILL_RANK}":
                        failure(f"{n} exited {p.returncode} while waiting for {what}")
                job = mt.poll_job(modelavg, JOB, addr, deadline)
                if predicate(job):
                    return job
                time.sleep(0.05)
            failure(f"timed out waiting for {what}")

        shrunk = poll("the shrink to 3 live ranks",
                      lambda j: j.state == "RUNNING" and j.live_world_size == MIN_WORLD)
        killed_at = time.monotonic()
        if shrunk.vacant_ranks != [KILL_RANK] or shrunk.deaths < 1 \
                or shrunk.spec.min_world_size != MIN_WORLD:
            failure(f"after the kill get_job shows {shrunk}")
        start("replacement", ROLE="replacement")
        admitted = poll("the admission", lambda j: j.admissions >= 1)
        if admitted.vacant_ranks or admitted.live_world_size != WORLD:
            failure(f"after the admission get_job shows {admitted}")
        admitted_steps = {m.rank: m.admitted_step for m in admitted.members}

        for n, p in procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired
                failure(f"{n} did not finish within {args.timeout_s} s")
        lines = {n: read_lines(outs[n]) for n in procs}
        rcs = {n: p.returncode for n, p in procs.items()}
        if rcs[f"rank{KILL_RANK}"] != -signal.SIGKILL:
            failure(f"rank {KILL_RANK} was to be killed; exit status {rcs[f'rank{KILL_RANK}']}")
        bad = {n: rc for n, rc in rcs.items() if n != f"rank{KILL_RANK}" and rc != 0}
        if bad:
            failure(f"exited non-zero: {bad}")
        if coordinator.stop() != 0:
            failure("the coordinator did not stop cleanly")
        check(lines, admitted_steps, failure)
    print(f"PASS elastic: kill at step {KILL_STEP}, replacement admitted at step "
          f"{lines['replacement'][1]['step']}, survivors ran {lines['rank0'][-1]['step']} "
          f"steps; shrink seen {killed_at - started:.1f} s after start, "
          f"{time.monotonic() - started:.1f} s in all")


def check(lines, admitted_steps, failure):
    survivors = [f"rank{r}" for r in range(WORLD) if r != KILL_RANK]
    start = lines["replacement"][0]
    if start.get("event") != "start":
        failure(f"the replacement's first line is {start}")
    a = start["admission_step"]
    if start["rank"] != KILL_RANK or a <= KILL_STEP or start["step"] != a or not start["elastic"]:
        failure(f"the replacement started as {start}: expected rank {KILL_RANK}, an admission "
                f"step past {KILL_STEP}, its averager at that step, an elastic client")
    if admitted_steps.get(KILL_RANK) != a or admitted_steps.get(0) != -1:
        failure(f"get_job's admitted_step: {admitted_steps}, the replacement got {a}")
    end = a + TAIL
    steps = {}  # name -> {step: line}
    for n, ls in lines.items():
        steps[n] = {l["step"]: l for l in ls if "event" not in l}
    for n in survivors:
        if lines[n][-1].get("event") != "done" or sorted(steps[n]) != list(range(end)):
            failure(f"{n} did not run every step 0..{end - 1} (ran {len(steps[n])}; last line "
                    f"{lines[n][-1]})")
    if sorted(steps["replacement"]) != list(range(a, end)):
        failure(f"the replacement ran steps {sorted(steps['replacement'])}, not {a}..{end - 1}")
    first = steps["replacement"][a]
    if not first["average"] or first["joining"] != [KILL_RANK] \
            or first["members"] != list(range(WORLD)):
        failure(f"the replacement's first decision: {first['repr']}")
    if first["post"] == first["pre"]:
        failure("the replacement's parameters were not overwritten at its admission")
    generations = {}
    for s in range(end):
        if s % PERIOD:
            for n in survivors:
                if steps[n][s]["average"]:
                    failure(f"{n} averaged at step {s}, a skip step: {steps[n][s]['repr']}")
            continue
        members = [0, 1, 2, 3] if s < KILL_STEP or s >= a else [0, 1, 2]
        joining = [KILL_RANK] if s == a else []
        holders = survivors + (["replacement"] if s >= a else []) \
            + ([f"rank{KILL_RANK}"] if s < KILL_STEP else [])
        ds = {n: steps[n][s] for n in holders}
        for n, d in ds.items():
            if not d["average"] or d["members"] != members or d["ranks"] != members \
                    or d["joining"] != joining or d["subgroup"] != 0:
                failure(f"step {s}: {n} decided {d['repr']} (ranks {d['ranks']}, members "
                        f"{d['members']}, joining {d['joining']}, subgroup {d['subgroup']}); "
                        f"expected ranks and members {members}, joining {joining}")
        gens = {d["generation"] for d in ds.values()}
        if len(gens) != 1:
            failure(f"step {s}: the members averaged in different generations {gens}")
        generations[s] = gens.pop()
        posts = {n: d["post"] for n, d in ds.items()}
        reference = posts[survivors[0]]
        if any(p != reference for p in posts.values()):
            failure(f"step {s}: the members hold different results: {posts}")
        contributors = [n for n in holders
                        if not (n == "replacement" and s == a)]
        for i, value in enumerate(reference):
            mean = sum(ds[n]["pre"][i] for n in contributors) / len(contributors)
            if abs(value - mean) > 1e-9 * max(1.0, abs(mean)):
                failure(f"step {s}: element {i} averaged to {value}, the mean of "
                        f"{contributors}' values is {mean}")
    before, during, after = generations[0], generations[KILL_STEP], generations[a]
    if not before < during < after:
        failure(f"generations at step 0, {KILL_STEP}, {a}: {before}, {during}, {after}: "
                "expected to grow at the kill and at the admission")


def test_elastic(suite_args):
    if "MODELAVG_TEST_TIMEOUT_S" not in os.environ:
        suite_args.timeout_s = 90  # the survivors' whole run and the replacement's
    run(suite_args)
