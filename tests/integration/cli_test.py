#!/usr/bin/env python3
"""The `modelavg` command line against a real coordinator (token auth; and TLS).

  * create -f spec.json, jobs, job ID, schedule ID --from --count [--rank], watch ID, delete ID,
    as tables and with --json (checked against GetJob and against a naive re-statement of the
    hierarchical schedule rule);
  * the token: without it UNAUTHENTICATED with a hint, exit 1; with --auth_token_file it works;
  * the connection's old names (--address, --token_file, --timeout_ms, $MODELAVG_TOKEN_FILE)
    still work, each reported once on stderr naming its new name; $MODELAVG_COORDINATOR and
    $MODELAVG_AUTH_TOKEN_FILE stand in for the flags, which win over them;
  * TLS: --tls_ca_file against a coordinator with a throwaway certificate;
  * usage errors exit 2, a call's error exits 1 with one line naming the code;
  * update ID (UpdateJob, docs/plan-updates.md) against a RUNNING job of four trace workers:
    --period, --outer_lr and -f, each answered with a switch step past every step the members
    had reported; `job ID` shows the plan history; every rank's decision at every step it took
    follows the plan in force at that step (a naive restatement of the rule); refusals (a
    world_size change, --outer_lr on a plain level, another job's spec, usage) leave the plan
    as it was.
Prints the CLI's output (docs/operations-ui.md shows it).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

CHECKS = 0


def check(cond, message):
    global CHECKS
    CHECKS += 1
    if not cond:
        mt.fail(message)


def naive_decisions(world, levels, warmup, step):
    """(level, [subgroups' rank lists]) of a hierarchical job at `step`, or None (PyTorch's rule:
    from the last level to the first, the first whose period divides the step)."""
    if step < warmup:
        return None
    for level in range(len(levels) - 1, -1, -1):
        period, group = levels[level]
        if step % period == 0:
            return level, [list(range(g, g + group)) for g in range(0, world, group)]
    return None


def plan_level(plans, step):
    """The level a hierarchical job with plan history `plans` ([(switch_step, warmup, [(period,
    group)])], oldest first) averages at `step`, or None: the plan is the latest whose switch
    step is <= step; in it, PyTorch's rule (from the last level to the first, the first whose
    period divides the step)."""
    switch, warmup, levels = [p for p in plans if p[0] <= step][-1]
    if step < warmup:
        return None
    for level in range(len(levels) - 1, -1, -1):
        if step % levels[level][0] == 0:
            return level
    return None


def check_update(run, show, group, work, coord, trace_worker, token_file, stub, pb, md):
    """`modelavg update` against a RUNNING job of four trace workers (see the module's doc)."""
    job_id = "cli-update"
    spec = {"job_id": job_id, "world_size": 4, "mode": "HIERARCHICAL",
            "heartbeat_timeout_ms": 3000,
            "levels": [{"period": 2, "group_size": 2},
                       {"period": 6, "group_size": 4, "outer": {"lr": 0.7, "momentum": 0.9}}]}
    spec_path = os.path.join(work, "update-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    run("create", "-f", spec_path)
    traces, logs, workers = [], [], []
    for rank in range(4):
        traces.append(os.path.join(work, f"update-rank{rank}.jsonl"))
        logs.append(os.path.join(work, f"update-rank{rank}.log"))
        workers.append(group.start(
            [trace_worker, f"--coordinator={coord.address}", f"--auth_token_file={token_file}",
             f"--job={job_id}", f"--rank={rank}", "--world_size=4", "--steps=1000000",
             "--numel=4", "--step_delay_ms=20", "--collective_timeout_ms=20000",
             "--log_level=info"],
            f"update-worker{rank}", stdout=open(traces[-1], "w"), stderr=open(logs[-1], "w")))
    try:
        check_running_update(run, show, job_id, spec, spec_path, work, workers, traces)
    except (mt.Failure, SystemExit):  # mt.fail: a script exits
        for rank, log in enumerate(logs):
            print(f"--- update-worker{rank}'s log (last lines):\n" +
                  "".join(open(log).readlines()[-15:]))
        print(f"--- the coordinator's log (last lines):\n{coord.log_tail(40)}")
        raise


def check_running_update(run, show, job_id, spec, spec_path, work, workers, traces):
    """check_update's calls, against the job of `workers` (writing `traces`)."""

    def job_json():
        return json.loads(run("job", job_id, "--json").stdout)

    def wait_for(what, cond, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in workers:
                if w.poll() is not None:
                    mt.fail(f"{w.name} exited {w.returncode} while waiting for {what}")
            j = job_json()
            if cond(j):
                return j
            time.sleep(0.2)
        mt.fail(f"no {what} within {timeout_s} s: {job_json()}")

    wait_for("steps past 20 on every rank",
             lambda j: j["state"] == "RUNNING" and int(j["min_step"]) >= 20)

    def switched(j):
        return not j.get("pending_plan")

    # --period: level 0 averages every 8 steps from the switch step on.
    out = run("update", job_id, "--period=8", "--level=0")
    show(f"update {job_id} --period=8 --level=0", out)
    first = out.stdout.splitlines()[0]
    check(first.startswith(f"updated job {job_id}: plan version 1 from step "), first)
    e1 = int(first.rsplit(" ", 1)[1])
    steps_row = [ln for ln in out.stdout.splitlines() if ln.startswith("members' steps")]
    check(steps_row, f"no members' steps row: {out.stdout}")
    answered_max = int(steps_row[0].split()[-1])
    check(e1 > answered_max, f"switch step {e1} is not past the members' steps {steps_row}")
    j = wait_for("the members past the first switch step", switched)
    check(int(j["min_step"]) >= e1 and j["plan_version"] == 1, f"after the switch: {j}")
    out = run("job", job_id)
    show(f"job {job_id} (after --period=8)", out)
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines()
            if ln.startswith(("v0 ", "v1 "))}
    check(set(rows) == {"v0", "v1"} and rows["v0"][1] == "0" and rows["v1"][1] == str(e1),
          f"plan history rows {rows}: {out.stdout}")
    check("in force" in " ".join(rows["v1"]) and "past" in rows["v0"] and
          "8/2, 6/4 outer lr 0.7" in " ".join(rows["v1"]), f"v1 row {rows['v1']}")
    check(re.search(r"^plan version +1 \(latest 1\)$", out.stdout, re.M), out.stdout)

    # --outer_lr (the last level by default), as JSON: the UpdateJobResponse.
    out = run("update", job_id, "--outer_lr=0.35", "--json")
    reply = json.loads(out.stdout)
    e2 = int(reply["switch_step"])
    check(reply["plan_version"] == 2 and e2 > int(reply["job"]["max_step"]) and e2 > e1,
          f"--outer_lr reply: {reply}")
    pending = reply["job"]["pending_plan"]
    check(int(pending["switch_step"]) == e2 and pending["version"] == 2 and
          pending["spec"]["levels"][1]["outer"]["lr"] == 0.35 and
          int(pending["spec"]["levels"][0]["period"]) == 8,
          f"the pending plan of the reply: {pending}")
    wait_for("the members past the second switch step", switched)

    # Refusals: the job's plan stays as it was.
    before = len(job_json()["plan_history"])
    out = run("update", job_id, "--outer_lr=0.5", "--level=0", expect=1)
    check("no outer optimizer" in out.stderr and len(out.stderr.strip().splitlines()) == 1,
          f"--outer_lr on a plain level: {out.stderr}")
    out = run("update", job_id, "--period=4", "--level=2", expect=1)
    check("--level=2" in out.stderr and "2 levels" in out.stderr, out.stderr)
    smaller = dict(spec, world_size=2, levels=[{"period": 2, "group_size": 2},
                                               {"period": 6, "group_size": 2}])
    smaller_path = os.path.join(work, "update-world2.json")
    with open(smaller_path, "w") as f:
        json.dump(smaller, f)
    out = run("update", job_id, "-f", smaller_path, expect=1)
    check("UpdateJob: INVALID_ARGUMENT" in out.stderr and "world_size" in out.stderr,
          f"world_size change: {out.stderr}")
    other_path = os.path.join(work, "update-other.json")
    with open(other_path, "w") as f:
        json.dump(dict(spec, job_id="another-job"), f)
    out = run("update", job_id, "-f", other_path, expect=1)
    check("another-job" in out.stderr and "may not change" in out.stderr, out.stderr)
    run("update", job_id, expect=2)
    run("update", job_id, "-f", spec_path, "--period=4", expect=2)
    run("update", job_id, "-f", spec_path, "--level=0", expect=2)
    check(len(job_json()["plan_history"]) == before, "a refused update changed the plan")

    # -f from standard input, without a job_id: level 0 every 4 steps, a longer heartbeat
    # timeout (in force at once).
    whole = {k: v for k, v in spec.items() if k != "job_id"}
    whole["heartbeat_timeout_ms"] = 4000
    whole["levels"] = [{"period": 4, "group_size": 2},
                       {"period": 6, "group_size": 4, "outer": {"lr": 0.35, "momentum": 0.9}}]
    out = run("update", job_id, "-f", "-", stdin=json.dumps(whole))
    show(f"update {job_id} -f - ", out)
    check(out.stdout.startswith(f"updated job {job_id}: plan version 3 from step "), out.stdout)
    e3 = int(out.stdout.splitlines()[0].rsplit(" ", 1)[1])
    check(e3 > e2, f"switch steps {e1}, {e2}, {e3}")
    j = wait_for("the members past the third switch step", switched)
    check(int(j["spec"]["heartbeat_timeout_ms"]) == 4000, f"heartbeat timeout: {j['spec']}")
    out = run("job", job_id)
    show(f"job {job_id}", out)
    plan_rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("v")]
    check([r[0] for r in plan_rows] == ["v0", "v1", "v2", "v3"] and
          [int(r[1]) for r in plan_rows] == [0, e1, e2, e3], f"plan history: {out.stdout}")
    check(re.search(r"^heartbeat timeout +4000 ms$", out.stdout, re.M), out.stdout)
    check("pending plan" not in out.stdout, out.stdout)

    # Every rank, every step it took: the decision of the plan in force at that step.
    history = job_json()["plan_history"]
    plans = [(int(c.get("switch_step", 0)), int(c["spec"].get("warmup_steps", 0)),
              [(int(l["period"]), l["group_size"]) for l in c["spec"]["levels"]])
             for c in history]
    check([p[0] for p in plans] == [0, e1, e2, e3], f"plan_history {history}")
    run("delete", job_id)
    for w in workers:
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            mt.fail(f"{w.name} did not end within 30 s of its job's deletion")
    checked = 0
    for rank, trace in enumerate(traces):
        steps = []
        for ln in open(trace).read().splitlines():
            try:
                d = json.loads(ln)
            except ValueError:
                continue  # the line being written when the job was deleted
            if "step" not in d:
                continue
            want = plan_level(plans, d["step"])
            got = d["level"] if d["action"] == "AVERAGE" else None
            check(got == want, f"rank {rank} step {d['step']}: level {got}, the plans say {want}")
            steps.append(d["step"])
            checked += 1
        check(steps == list(range(len(steps))) and len(steps) > e3,
              f"rank {rank}: steps 0..{len(steps) - 1} (switches at {e1}, {e2}, {e3})")
    print(f"update: switch steps {e1}, {e2}, {e3}; {checked} decisions of 4 ranks checked")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--trace_worker", required=True)
    args = parser.parse_args()
    import grpc
    pb, pb_grpc = mt.coordinator_stubs()

    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-cli-")
        token_file = os.path.join(work, "token")
        with open(token_file, "w") as f:
            f.write("cli-operator-token\n")
        coord = mt.Coordinator(group, args.coordinator, workdir=work,
                               extra_flags=[f"--auth_token_file={token_file}"])

        def run(*argv, token=True, expect=0, stdin=None):
            cmd = [args.cli, f"--coordinator={coord.address}"]
            if token:
                cmd.append(f"--auth_token_file={token_file}")
            cmd += list(argv)
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, input=stdin)
            check(out.returncode == expect,
                  f"{' '.join(cmd[1:])}: exit {out.returncode}, expected {expect}\n"
                  f"stdout: {out.stdout}\nstderr: {out.stderr}")
            return out

        def show(title, out):
            print(f"$ modelavg {title}\n{out.stdout}", end="" if out.stdout.endswith("\n") else "\n")

        spec_path = os.path.join(work, "spec.json")
        levels = [(2, 2), (6, 4)]
        with open(spec_path, "w") as f:
            json.dump({"job_id": "cli-demo", "world_size": 4, "warmup_steps": 2,
                       "mode": "HIERARCHICAL", "heartbeat_timeout_ms": 60000,
                       "levels": [{"period": p, "group_size": g} for p, g in levels]}, f)
        out = run("create", "-f", spec_path)
        show("create -f spec.json", out)
        check("created job cli-demo" in out.stdout, f"create said: {out.stdout}")
        run("create", "-f", spec_path, expect=1)  # ALREADY_EXISTS
        bad = os.path.join(work, "bad.json")
        with open(bad, "w") as f:
            f.write('{"job_id": "x", "world_size": "four"}')
        out = run("create", "-f", bad, expect=1)
        check("is not a JobSpec in JSON" in out.stderr, f"bad spec: {out.stderr}")

        # Two workers join (over gRPC, as a trainer's client would), reporting steps.
        channel = grpc.insecure_channel(coord.address)
        stub = pb_grpc.CoordinatorStub(channel)
        md = [("authorization", "Bearer cli-operator-token")]

        watch_out = {}

        def watch():
            watch_out["r"] = subprocess.run(
                [args.cli, f"--coordinator={coord.address}", f"--auth_token_file={token_file}",
                 "watch", "cli-demo", "--watch_ms=4000"],
                capture_output=True, text=True, timeout=60)

        watcher = threading.Thread(target=watch)
        watcher.start()
        time.sleep(1.0)
        joins = []
        for r in range(4):
            t = threading.Thread(target=lambda r=r: joins.append(stub.Join(
                pb.JoinRequest(job_id="cli-demo", worker_id=f"trainer-{r}", host=f"node{r // 2}",
                               rank=r), metadata=md, timeout=30)))
            t.start()
            joins.append(t)
        for t in [j for j in joins if isinstance(j, threading.Thread)]:
            t.join()
        replies = {j.rank: j for j in joins if not isinstance(j, threading.Thread)}
        check(len(replies) == 4, f"joins: {replies}")
        for r, reply in replies.items():
            stub.Heartbeat(pb.HeartbeatRequest(job_id="cli-demo", rank=r,
                                               generation=reply.generation, step=10 + 3 * r,
                                               credential=reply.credential),
                           metadata=md, timeout=10)
        watcher.join()
        w = watch_out["r"]
        check(w.returncode == 0, f"watch exit {w.returncode}: {w.stderr}")
        print(f"$ modelavg watch cli-demo\n{w.stdout}", end="")
        check("SNAPSHOT" in w.stdout and w.stdout.count("MEMBER_JOINED") == 4
              and "WORLD_COMPLETE" in w.stdout, f"watch printed: {w.stdout}")

        out = run("jobs")
        show("jobs", out)
        header, row = out.stdout.splitlines()[0:2]
        check(header.split()[:3] == ["JOB", "STATE", "MODE"], f"jobs header: {header}")
        check(row.split()[:3] == ["cli-demo", "RUNNING", "hierarchical"], f"jobs row: {row}")
        listed = json.loads(run("jobs", "--json").stdout)
        check([j["spec"]["job_id"] for j in listed["jobs"]] == ["cli-demo"], f"{listed}")

        out = run("job", "cli-demo")
        show("job cli-demo", out)
        for r in range(4):
            check(f"trainer-{r}" in out.stdout, f"job shows no trainer-{r}: {out.stdout}")
        # Lag column: rank 0 is at step 10, the leader (rank 3) at 19.
        member_lines = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(("0 ", "1 ", "2 ", "3 "))]
        lags = {int(c[0]): int(c[5]) for c in member_lines}
        check(lags == {0: 9, 1: 6, 2: 3, 3: 0}, f"lags {lags} from {out.stdout}")
        got = json.loads(run("job", "cli-demo", "--json").stdout)
        truth = stub.GetJob(pb.GetJobRequest(job_id="cli-demo"), metadata=md, timeout=10)
        check(int(got["generation"]) == truth.generation and
              [m["worker_id"] for m in got["members"]] == [m.worker_id for m in truth.members],
              f"job --json {got} vs GetJob {truth}")

        out = run("schedule", "cli-demo", "--from=0", "--count=13")
        show("schedule cli-demo --from=0 --count=13", out)
        sched = json.loads(run("schedule", "cli-demo", "--from=0", "--count=13", "--json").stdout)
        by_step = {}
        for d in sched.get("decisions", []):
            by_step.setdefault(int(d["step"]), []).append(d)
        for step in range(13):
            want = naive_decisions(4, levels, 2, step)
            have = [d for d in by_step.get(step, []) if d["action"] == "AVERAGE"]
            if want is None:
                check(not have, f"step {step}: expected no averaging, got {have}")
            else:
                level, groups = want
                check(sorted([int(x) for x in d["ranks"]] for d in have) == groups and
                      all(int(d["level"]) == level for d in have),
                      f"step {step}: expected level {level} {groups}, got {have}")
        ranked = json.loads(run("schedule", "cli-demo", "--from=4", "--count=3", "--rank=3",
                                "--json").stdout)
        check([int(d["step"]) for d in ranked["decisions"]] == [4, 5, 6] and
              [int(x) for x in ranked["decisions"][0]["ranks"]] == [2, 3],
              f"schedule --rank=3: {ranked}")

        # Sharded replicas: 4 ranks in replicas of 2, elastic; rank 3 dies (it stops beating) and
        # its replica is retired with it.
        sharded_path = os.path.join(work, "sharded.json")
        with open(sharded_path, "w") as f:
            json.dump({"job_id": "cli-sharded", "world_size": 4, "replica_size": 2,
                       "min_world_size": 2, "mode": "PERIODIC", "heartbeat_timeout_ms": 1500,
                       "levels": [{"period": 2, "group_size": 4}]}, f)
        run("create", "-f", sharded_path)
        sharded = {}
        threads = [threading.Thread(target=lambda r=r: sharded.__setitem__(r, stub.Join(
            pb.JoinRequest(job_id="cli-sharded", worker_id=f"s-{r}", host=f"n{r}", rank=r),
            metadata=md, timeout=30))) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = run("job", "cli-sharded")
        show("job cli-sharded", out)
        check("2 of 2 ranks (rank r holds shard r % 2)" in out.stdout, out.stdout)
        header = [ln for ln in out.stdout.splitlines() if ln.startswith("RANK")][0].split()
        check(header[-3:] == ["REPLICA", "SHARD", "RETIRED_BY"], f"header {header}")
        rows = {int(c[0]): c for c in (ln.split() for ln in out.stdout.splitlines()
                                       if ln[:1].isdigit() and "s-" in ln)}
        check({r: (c[-3], c[-2]) for r, c in rows.items()} ==
              {0: ("0", "0"), 1: ("0", "1"), 2: ("1", "0"), 3: ("1", "1")}, f"rows {rows}")
        out = run("schedule", "cli-sharded", "--from=0", "--count=1")
        show("schedule cli-sharded --from=0 --count=1", out)
        groups = sorted(ln.split()[5] for ln in out.stdout.splitlines()[1:])
        check(groups == ["0,2", "1,3"], f"sharded groups {groups}: {out.stdout}")
        check(" 2x2 " in run("jobs").stdout, "jobs shows no REPLICAS 2x2")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for r in (0, 1, 2):
                stub.Heartbeat(pb.HeartbeatRequest(job_id="cli-sharded", rank=r,
                                                   generation=sharded[r].generation, step=1,
                                                   credential=sharded[r].credential),
                               metadata=md, timeout=10)
            state = stub.GetJob(pb.GetJobRequest(job_id="cli-sharded"), metadata=md, timeout=10)
            if state.generation > 1:
                break
            time.sleep(0.2)
        out = run("job", "cli-sharded")
        show("job cli-sharded (rank 3 lost)", out)
        check("replica 1 (ranks 2..3) retired" in out.stdout, out.stdout)
        retired = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("2 ")]
        check(retired and retired[0][3] == "RETIRED" and retired[0][-1] == "3",
              f"rank 2's row: {retired}")
        run("delete", "cli-sharded")

        # A compressed outer level with error feedback: the payload, the top-k density and the
        # feedback beside the level's period, in the job's page and in the job list.
        feedback_path = os.path.join(work, "feedback.json")
        with open(feedback_path, "w") as f:
            json.dump({"job_id": "cli-feedback", "world_size": 4, "mode": "HIERARCHICAL",
                       "levels": [{"period": 2, "group_size": 2},
                                  {"period": 8, "group_size": 4, "outer": {"lr": 0.7},
                                   "payload": "TOPK", "topk_density": 0.02,
                                   "error_feedback": 0.9}]}, f)
        run("create", "-f", feedback_path)
        out = run("job", "cli-feedback")
        show("job cli-feedback", out)
        plan = [ln for ln in out.stdout.splitlines() if ln.startswith("plan")]
        check(plan and plan[0].endswith(
            "(2, 2) (8, 4, outer lr 0.7 momentum 0, TOPK density 0.02, error feedback 0.9)"),
              f"job cli-feedback shows no payload, density and feedback: {out.stdout}")
        row = [ln for ln in run("jobs").stdout.splitlines() if ln.startswith("cli-feedback ")]
        check(row and "TOPK density 0.02, error feedback 0.9)" in row[0],
              f"jobs row of cli-feedback: {row}")
        got = json.loads(run("job", "cli-feedback", "--json").stdout)["spec"]["levels"][1]
        check(got.get("payload") == "TOPK" and got.get("topk_density") == 0.02 and
              got.get("error_feedback") == 0.9, f"job cli-feedback --json level 1: {got}")
        run("delete", "cli-feedback")

        check_update(run, show, group, work, coord, args.trace_worker, token_file, stub, pb, md)

        # Errors and usage.
        out = run("jobs", token=False, expect=1)
        check("UNAUTHENTICATED" in out.stderr and "--auth_token_file" in out.stderr, out.stderr)
        out = run("job", "nope", expect=1)
        check(out.stderr.startswith("modelavg: GetJob: NOT_FOUND"), out.stderr)
        check(len(out.stderr.strip().splitlines()) == 1, f"more than one line: {out.stderr}")
        run("job", expect=2)
        run("frobnicate", expect=2)

        # The connection's names: the old ones work, each reported once, naming the new one.
        def bare(argv, env_extra):
            env = {k: v for k, v in os.environ.items() if not k.startswith("MODELAVG_")}
            env.update(env_extra)
            return subprocess.run([args.cli, *argv], capture_output=True, text=True,
                                  timeout=60, env=env)
        old = bare([f"--address={coord.address}", f"--token_file={token_file}",
                    "--timeout_ms=5000", "jobs"], {})
        check(old.returncode == 0 and "cli-demo" in old.stdout, f"old flags: {old.stderr}")
        for name, new in (("--address", "--coordinator"), ("--token_file", "--auth_token_file"),
                          ("--timeout_ms", "--rpc_timeout_ms")):
            warned = [l for l in old.stderr.splitlines() if f"{name} is deprecated" in l]
            check(len(warned) == 1 and f"use {new}" in warned[0],
                  f"the warning for {name}: {old.stderr}")
        env = bare(["jobs"], {"MODELAVG_COORDINATOR": coord.address,
                              "MODELAVG_TOKEN_FILE": token_file})
        check(env.returncode == 0 and "cli-demo" in env.stdout and
              "MODELAVG_TOKEN_FILE is deprecated: use MODELAVG_AUTH_TOKEN_FILE" in env.stderr,
              f"$MODELAVG_TOKEN_FILE: {env.returncode} {env.stderr}")
        new = bare(["jobs"], {"MODELAVG_COORDINATOR": coord.address,
                              "MODELAVG_AUTH_TOKEN_FILE": token_file})
        check(new.returncode == 0 and "cli-demo" in new.stdout and new.stderr == "",
              f"$MODELAVG_AUTH_TOKEN_FILE: {new.returncode} {new.stderr}")
        # The flag wins over the variable (which names a port nobody serves).
        both = bare([f"--coordinator={coord.address}", "jobs"],
                    {"MODELAVG_COORDINATOR": "127.0.0.1:1", "MODELAVG_AUTH_TOKEN_FILE": token_file})
        check(both.returncode == 0 and "cli-demo" in both.stdout, f"flag over env: {both.stderr}")

        out = run("delete", "cli-demo")
        show("delete cli-demo", out)
        check("deleted job cli-demo" in out.stdout, out.stdout)
        check("no jobs" in run("jobs").stdout, "the job is still listed")
        channel.close()
        coord.stop()

        # TLS: a throwaway certificate for 127.0.0.1.
        key, cert = os.path.join(work, "key.pem"), os.path.join(work, "cert.pem")
        gen = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
             "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, text=True,
            timeout=60)
        if gen.returncode != 0:
            mt.fail(f"openssl could not make a certificate: {gen.stderr}")
        tls_dir = group.temp_dir("modelavg-cli-tls-")
        tls = mt.Coordinator(group, args.coordinator, workdir=tls_dir,
                             extra_flags=[f"--tls_cert={cert}", f"--tls_key={key}"])
        ok = subprocess.run([args.cli, f"--coordinator={tls.address}", f"--tls_ca_file={cert}",
                             "jobs"], capture_output=True, text=True, timeout=60)
        check(ok.returncode == 0 and "no jobs" in ok.stdout, f"TLS: {ok.stdout} {ok.stderr}")
        plain = subprocess.run([args.cli, f"--coordinator={tls.address}", "--rpc_timeout_ms=3000",
                                "jobs"], capture_output=True, text=True, timeout=60)
        check(plain.returncode == 1 and "UNAVAILABLE" in plain.stderr,
              f"plaintext to a TLS coordinator: {plain.returncode} {plain.stderr}")
        tls.stop()
    print(f"modelavg CLI: {CHECKS} passed, 0 failed")


if __name__ == "__main__":
    main()
