#!/usr/bin/python3
"""Paced rounds against step-locked ones, with one of four replicas 2x slower.

  sudo /usr/bin/python3 bench/paced/run.py                  # locked and paced, seeds 1,2,3
  sudo /usr/bin/python3 bench/paced/run.py --smoke          # a few rounds, one seed

The work is bench/lm's (the same byte-level transformer, corpus, AdamW inner optimizer, worker
loop and namespace cluster: two sites of two workers, the sites' uplinks shaped with tbf to
--rate_mbit) in its DiLoCo hierarchy: the pair inside each site averages every
--diloco_site_period steps, all four take DiLoCo's outer step (SGD, --outer_lr, Nesterov
--outer_momentum) every --diloco_period steps. Rank --slow_rank (3, site b) runs --slow_factor
times slower: after each optimizer step it sleeps (F - 1) x that step's compute
(bench/lm/worker.py --slow_factor). The site level locks rank 2 to it, so site b's pair is the
slow group and site a's pair (ranks 0, 1) the fast members. Two modes (bench/lm/modes.py):

  locked  the `diloco` mode: every rank averages at the same steps; the fast pair waits for the
          slow one at every outer step
  paced   the `diloco_paced` mode: the outer level paced (docs/paced.md): --diloco_period counts
          the slow pair's inner steps, the fast pair takes about F times as many, each outer
          step is the token-weighted mean

Each run ends once rank 0's validation loss (every --eval_every of its steps) reaches
--target_loss, or at --max_steps of rank 0's: locked, at the next outer step's count
(bench/lm's rule); paced, after the next outer round (rank 0 names it in the stop file; every
rank stops right after that round's call). Every rank writes its compute time (outside the
averaging calls, evaluation excluded, the injected sleep included) every --util_every steps.

For each mode it prints one JSON line over the seeds (median and range): seconds to the target
(rank 0's training seconds at its first evaluation at or below it), its steps, the utilization
(compute / wall, the whole run) of the fast members (the mean of ranks 0 and 1) and of the slow
pair (ranks 2 and 3), each rank's, the fast members' utilization from the outer round 2 on (a
paced level takes round 1 step-locked: no pace is known when it is planned), the final loss,
the outer rounds taken, MB over site b's uplink; then the ratio locked / paced of the median
seconds to the target. Each run's line gives the inner steps rank 0 and the slow rank took
between consecutive outer rounds. During a paced run it reads the coordinator's status page
(--metrics_listen) twice a second for the job's group paces, the paces the next round would be
planned with. Writes --out_dir/paced.json (every
figure, every evaluation and utilization line, the group paces) and --out_dir/paced.png (each
member's utilization over time, one panel per mode; the paced run's group paces over time; the
time to the target). Needs root (namespaces), the
`fortunes` package, matplotlib for the plot, a Python with PyTorch for the workers (--python)
and a build (--build_dir: modelavg-coordinator and modelavg-python).
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
LM = os.path.join(REPO, "bench", "lm")
sys.path.insert(0, LM)
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
import corpus  # noqa: E402
import drivers  # noqa: E402
import netcluster as nc  # noqa: E402

WORKERS = [("w0", "a"), ("w1", "a"), ("w2", "b"), ("w3", "b")]
FAST, SLOW = (0, 1), (2, 3)  # site a's pair, site b's pair (the slow rank's)
COORD_PORT = 7000
STATUS_PORT = 7001  # the coordinator's status page: the paced job's group paces are read there
MODES = {"locked": "diloco", "paced": "diloco_paced"}  # this benchmark's name -> bench/lm's


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--modes", default="locked,paced", help=f"comma-separated, from {list(MODES)}")
    p.add_argument("--rate_mbit", type=float, default=50, help="the site link's rate")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--slow_rank", type=int, default=3)
    p.add_argument("--slow_factor", type=float, default=2.0)
    p.add_argument("--target_loss", type=float, default=2.2)
    p.add_argument("--max_steps", type=int, default=3000, help="rank 0's")
    p.add_argument("--eval_every", type=int, default=32)
    p.add_argument("--util_every", type=int, default=16)
    p.add_argument("--diloco_period", type=int, default=128,
                   help="the outer level's period (paced: the slow pair's inner steps)")
    p.add_argument("--diloco_site_period", type=int, default=8,
                   help="the period of the plain average inside a site (bench/lm's is 2: there "
                        "the pair's averaging is a fifth of the fast pair's time on 2 cores)")
    p.add_argument("--outer_lr", type=float, default=0.9)
    p.add_argument("--outer_momentum", type=float, default=0.3)
    drivers.add_model_args(p)  # bench/lm's
    p.add_argument("--cpu_quota", type=float, default=0.4,
                   help="CPUs each worker may use at most (a cgroup v1 CFS quota; 0: no cap): "
                        "without it a worker computes faster while the others wait, which no "
                        "separate machine does, and the paces measured at a round's end are off")
    p.add_argument("--timeout_s", type=float, default=600, help="per run")
    p.add_argument("--keep", action="store_true", help="keep the workers' logs (printed)")
    p.add_argument("--from_json", default="",
                   help="a paced.json: print its figures as docs/benchmarks.md's Markdown table "
                        "and plot them again into --out_dir, running nothing")
    p.add_argument("--out_dir", default=os.path.join(REPO, "bench", "paced", "out"))
    p.add_argument("--build_dir", default=os.path.join(REPO, "build"))
    venv = os.path.join(REPO, ".venv", "bin", "python")
    p.add_argument("--python", default=venv if os.access(venv, os.X_OK) else "/usr/bin/python3",
                   help="the workers' Python (PyTorch)")
    p.add_argument("--smoke", action="store_true",
                   help="a short check: a tiny model, outer period 16, 96 steps, one seed; fails "
                        "unless every run ended, the paced run's ranks after the same round, "
                        "its fast pair with more steps than the slow one; skips (77) without "
                        "namespaces unless MODELAVG_REQUIRE_CLUSTER=1")
    args = p.parse_args()
    if args.smoke:
        args.d_model, args.layers, args.batch = 32, 1, 4
        args.max_steps, args.diloco_period, args.target_loss = 96, 16, 0.0
        args.eval_every, args.util_every, args.seeds = 32, 8, args.seeds.split(",")[0]
    args.seed_list = [int(x) for x in args.seeds.split(",") if x.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    return args


def lines(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


CPU_CGROUP = "/sys/fs/cgroup/cpu"


class CpuCaps:
    """One cgroup v1 CPU controller group a worker, each capped at `cpus` CPUs (a CFS quota over
    a 10 ms period, so that a step is throttled in small slices); removed on close."""

    def __init__(self, cpus, n):
        self.dirs = []
        if not cpus:
            return
        if not os.access(os.path.join(CPU_CGROUP, "cgroup.procs"), os.W_OK):
            raise SystemExit(f"--cpu_quota needs a writable cgroup v1 CPU controller at "
                             f"{CPU_CGROUP} (or --cpu_quota=0)")
        for rank in range(n):
            d = os.path.join(CPU_CGROUP, f"modelavg-paced-{os.getpid()}-{rank}")
            os.makedirs(d, exist_ok=True)
            self.dirs.append(d)
            for name, value in (("cpu.cfs_period_us", 10000),
                                ("cpu.cfs_quota_us", max(1000, int(10000 * cpus)))):
                with open(os.path.join(d, name), "w") as f:
                    f.write(str(value))

    def add(self, rank, pid):
        if self.dirs:
            with open(os.path.join(self.dirs[rank], "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def close(self):
        for d in self.dirs:
            try:
                os.rmdir(d)
            except OSError as e:
                print(f"could not remove {d}: {e}", file=sys.stderr)


def run_once(args, cluster, mode, seed, tmp, caps):
    """One run of `mode` (locked or paced) with `seed`: its figures, evaluations and each rank's
    utilization lines."""
    tag = f"{mode}.s{seed}"
    coord = cluster.hosts["coord"]
    log = open(os.path.join(tmp, f"{tag}.coordinator.log"), "w")
    coordinator = cluster.popen("coord", [
        os.path.join(args.build_dir, "server", "modelavg-coordinator"),
        f"--listen={coord.address}:{COORD_PORT}", "--log_level=warn",
        f"--metrics_listen={coord.address}:{STATUS_PORT}"],
        stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    if coordinator.poll() is not None:
        raise SystemExit(f"the coordinator exited: {open(log.name).read()[-2000:]}")
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build_dir, "python"),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    before = cluster.site_bytes("b")
    started = time.monotonic()
    procs = []
    for rank, (host, _) in enumerate(WORKERS):
        argv = [args.python, os.path.join(LM, "worker.py"), f"--mode={MODES[mode]}",
                f"--rank={rank}", f"--world_size={len(WORKERS)}",
                f"--address={cluster.hosts[host].address}",
                f"--master={cluster.hosts['w0'].address}",
                f"--coordinator={coord.address}:{COORD_PORT}", f"--job=paced-{tag}",
                f"--corpus={args.corpus_path}", f"--out={os.path.join(tmp, f'{tag}.{rank}.jsonl')}",
                f"--util_out={os.path.join(tmp, f'{tag}.{rank}.util')}",
                f"--util_every={args.util_every}", f"--seed={seed}",
                f"--stop_file={os.path.join(tmp, f'{tag}.stop')}", f"--max_steps={args.max_steps}",
                f"--eval_every={args.eval_every}", f"--target_loss={args.target_loss}",
                *drivers.worker_flags(args), f"--stop_period={args.diloco_period}",
                f"--outer_lr={args.outer_lr}", f"--outer_momentum={args.outer_momentum}",
                f"--diloco_period={args.diloco_period}",
                f"--diloco_site_period={args.diloco_site_period}",
                f"--slow_factor={args.slow_factor if rank == args.slow_rank else 1}"]
        err = open(os.path.join(tmp, f"{tag}.{rank}.err"), "w")
        procs.append(cluster.popen(host, argv, stdout=err, stderr=subprocess.STDOUT, env=env))
        caps.add(rank, procs[-1].pid)  # `ip netns exec` execs the worker: the same process
    paces, done = [], threading.Event()
    watch = threading.Thread(target=watch_paces, daemon=True,
                             args=(cluster,
                                   f"http://{coord.address}:{STATUS_PORT}/jobs/paced-{tag}",
                                   started, paces, done))
    if mode == "paced":
        watch.start()
    failed = drivers.wait_workers(procs, time.monotonic() + args.timeout_s,
                                  lambda rank: os.path.join(tmp, f"{tag}.{rank}.err"))
    done.set()
    if watch.is_alive():
        watch.join()
    wall = time.monotonic() - started
    link = cluster.site_bytes("b") - before
    coordinator.send_signal(signal.SIGTERM)
    try:
        coordinator.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(coordinator.pid, signal.SIGKILL)
    if failed:
        rank, rc, err = failed[0]
        raise RuntimeError(f"{tag}: rank {rank} ended with {rc}:\n{err}")
    evals = lines(os.path.join(tmp, f"{tag}.0.jsonl"))
    ends = [lines(os.path.join(tmp, f"{tag}.{rank}.jsonl"))[-1] for rank in range(len(WORKERS))]
    util = [lines(os.path.join(tmp, f"{tag}.{rank}.util")) for rank in range(len(WORKERS))]
    hit = next((e for e in evals if e["val_loss"] <= args.target_loss), None)
    utilization = [u[-1]["compute"] / u[-1]["wall"] for u in util]
    settled = [utilization_from_round(u, 2) for u in util]
    return {"mode": mode, "seed": seed, "evals": evals, "util": util, "group_paces": paces,
            "steps": [e["step"] for e in ends], "rounds": [e.get("round") for e in ends],
            "utilization": [round(x, 4) for x in utilization],
            "fast_utilization": statistics.mean(utilization[r] for r in FAST),
            "slow_utilization": statistics.mean(utilization[r] for r in SLOW),
            "utilization_from_round2": [x and round(x, 4) for x in settled],
            "fast_utilization_from_round2": (statistics.mean(settled[r] for r in FAST)
                                             if all(settled[r] for r in FAST) else None),
            "round_steps": [round_steps(u) for u in util],
            "steps_to_target": hit["step"] if hit else None,
            "seconds_to_target": hit["seconds"] if hit else None,
            "seconds_run": evals[-1]["seconds"], "final_loss": evals[-1]["val_loss"],
            "link_bytes": link, "process_wall_s": wall}


def watch_paces(cluster, url, started, paces, done):
    """Appends (seconds since `started`, [each group's pace, steps/s; None: not known]) to
    `paces`, read from the coordinator's status page (the paced job's "group paces" row: what
    the next round would be planned with) about twice a second, until `done` is set."""
    row = re.compile(r"group paces</dt><dd>([^<]*) steps/s")
    while not done.wait(0.5):
        page = cluster.run("coord", ["curl", "-s", "--max-time", "1", url], check=False).stdout
        m = row.search(page)
        if m:
            paces.append((round(time.monotonic() - started, 2),
                          [None if v.strip() == "?" else float(v) for v in m.group(1).split(",")]))


def round_start(u, k):
    """The utilization line of one rank's `u` written at its round k of the last level (the
    first line with round >= k; None: the rank did not take it)."""
    return next((x for x in u if x["round"] >= k), None)


def utilization_from_round(u, k):
    """compute / wall of one rank from its round k of the last level to its end: the
    utilization once round 1, which a paced level takes step-locked (docs/paced.md), is over."""
    a = round_start(u, k)
    if a is None or u[-1]["wall"] <= a["wall"]:
        return None
    return (u[-1]["compute"] - a["compute"]) / (u[-1]["wall"] - a["wall"])


def round_seconds(u):
    """The median wall seconds one rank took between its consecutive rounds of the last level
    (None: fewer than two rounds)."""
    starts = [x["wall"] for x in u if x["round"] >= 0 and round_start(u, x["round"]) is x]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return statistics.median(gaps) if gaps else None


def round_steps(u):
    """The inner steps one rank took between its consecutive rounds of the last level."""
    starts = [x["step"] for x in u if x["round"] >= 0 and
              round_start(u, x["round"]) is x]
    return [b - a for a, b in zip(starts, starts[1:])]


def spread(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(values[0], 4),
            "max": round(values[-1], 4)}


def mode_line(args, mode, rs):
    hit = [r for r in rs if r["seconds_to_target"] is not None]
    return {"rate_mbit": args.rate_mbit, "mode": mode, "bench_lm_mode": MODES[mode],
            "slow": f"rank {args.slow_rank} x{args.slow_factor:g}",
            "target_loss": args.target_loss, "reached": f"{len(hit)}/{len(rs)}",
            "seconds_to_target": spread([r["seconds_to_target"] for r in hit]),
            "steps_to_target": spread([r["steps_to_target"] for r in hit]),
            "fast_utilization": spread([r["fast_utilization"] for r in rs]),
            "slow_utilization": spread([r["slow_utilization"] for r in rs]),
            "fast_utilization_from_round2": spread([r["fast_utilization_from_round2"]
                                                    for r in rs]),
            "rank_utilization": [spread([r["utilization"][k] for r in rs])
                                 for k in range(len(WORKERS))],
            "final_loss": spread([r["final_loss"] for r in rs]),
            "rounds": spread([r["rounds"][0] for r in rs if r["rounds"][0] is not None]),
            "rank_steps": [spread([r["steps"][k] for r in rs]) for k in range(len(WORKERS))],
            "link_MB": spread([r["link_bytes"] / 1e6 for r in rs])}


def ratio(lines_):
    by = {x["mode"]: x for x in lines_}
    if not all(m in by and by[m]["seconds_to_target"] for m in ("locked", "paced")):
        return None
    s = {m: by[m]["seconds_to_target"] for m in ("locked", "paced")}
    return {"time_to_target_locked_over_paced": round(s["locked"]["median"] /
                                                     s["paced"]["median"], 3),
            "fast_utilization": {m: by[m]["fast_utilization"]["median"]
                                 for m in ("locked", "paced")}}


def windowed(u, window_s):
    """(time, utilization over the last window_s seconds) at each line of one rank's `u`."""
    out = []
    j = 0
    for k, x in enumerate(u):
        while u[j]["wall"] < x["wall"] - window_s:
            j += 1
        a = u[j - 1] if j > 0 else {"wall": 0.0, "compute": 0.0}
        if x["wall"] > a["wall"]:
            out.append((x["wall"], (x["compute"] - a["compute"]) / (x["wall"] - a["wall"])))
    return out


def plot(args, runs, lines_, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in args.mode_list if any(r["mode"] == m for r in runs)]
    fig, grid = plt.subplots(2, 2, figsize=(12, 8.4))
    axes = list(grid.flat)
    seed = args.seed_list[0]
    for ax, mode in zip(axes, modes):
        r = next(r for r in runs if r["mode"] == mode and r["seed"] == seed)
        slow = r["util"][args.slow_rank]  # the window: about two of its rounds
        window = round(2 * slow[-1]["wall"] / max(1, slow[-1]["round"] + 1), 1)
        for k, u in enumerate(r["util"]):
            role = "fast" if k in FAST else ("slow" if k == args.slow_rank else "slow pair")
            t = [x["wall"] for x in u]
            ax.plot(t, [x["compute"] / x["wall"] if x["wall"] else 0 for x in u],
                    color=f"C{k}", label=f"rank {k} ({role})")
            w = windowed(u, window)
            ax.plot([a for a, _ in w], [b for _, b in w], color=f"C{k}", alpha=0.3,
                    linewidth=0.8)
        if r["seconds_to_target"] is not None:
            ax.axvline(r["seconds_to_target"], color="grey", linestyle="--", linewidth=1,
                       label=f"target {args.target_loss:g} (rank 0)")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("wall-clock since the rank's first step (s)")
        ax.set_ylabel("utilization (compute / wall)")
        ax.set_title(f"{mode} (seed {seed}): solid since the start, faint over the last "
                     f"{window:g} s")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    paced = next((r for r in runs if r["mode"] == "paced" and r["seed"] == seed), None)
    ax = axes[2]
    if paced and paced["group_paces"]:
        for g, name in enumerate(("site a's pair (fast)", "site b's pair (slow)")):
            pts = [(t, v[g]) for t, v in paced["group_paces"] if len(v) > g and v[g]]
            ax.plot([t for t, _ in pts], [v for _, v in pts], color=f"C{2 * g}", label=name)
        ax.legend(fontsize=7)
    ax.set_xlabel("seconds since the workers were started")
    ax.set_ylabel("group pace, steps/s (coordinator's status page)")
    ax.set_title(f"paced (seed {seed}): the paces the next round would be planned with")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax = axes[3]
    for i, x in enumerate(lines_):
        s = x["seconds_to_target"]
        if not s:
            continue
        ax.bar(i, s["median"], yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
               capsize=4, color=f"C{i + 4}")
    ax.set_xticks(range(len(lines_)), [x["mode"] for x in lines_])
    ax.set_ylabel(f"seconds to validation loss {args.target_loss:g}")
    ax.set_title(f"time to the target (median, range over seeds {args.seeds})")
    ax.title.set_fontsize(9)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"4 replicas, 2 sites at {args.rate_mbit:g} Mbit/s, rank {args.slow_rank} "
                 f"{args.slow_factor:g}x slower; DiLoCo every {args.diloco_period} steps "
                 f"(paced: the slow pair's),\nthe pair in a site every "
                 f"{args.diloco_site_period}; "
                 + (f"each worker capped at {args.cpu_quota:g} CPU"
                    if getattr(args, "cpu_quota", 0) else "workers uncapped"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(path):
    """A paced.json's figures as the Markdown table of docs/benchmarks.md."""
    d = json.load(open(path))
    a = d["args"]

    def f(v, fmt):
        if not v:
            return "-"
        return (fmt + " [" + fmt + ", " + fmt + "]").format(v["median"], v["min"], v["max"])
    rows = ["| mode | reached | seconds to " + f"{a['target_loss']:g}" +
            " | rank 0's steps to it | "
            "outer round at the target | fast members' utilization | from round 2 | rank 2 | "
            "rank 3 (slow) | seconds a round | final loss |", "|" + "---|" * 11]
    for x in d["modes"]:
        rs = [r for r in d["runs"] if r["mode"] == x["mode"]]
        per_round = spread([round_seconds(r["util"][a["slow_rank"]]) for r in rs])
        at = spread([next((e["round"] for e in r["evals"] if e["val_loss"] <= a["target_loss"]),
                          None) for r in rs])
        rows.append(" | ".join([
            f"| {x['mode']}", x["reached"], f(x["seconds_to_target"], "{:.1f}"),
            f(x["steps_to_target"], "{:.0f}"), f(at, "{:.0f}"), f(x["fast_utilization"], "{:.2f}"),
            f(x["fast_utilization_from_round2"], "{:.2f}"),
            f(x["rank_utilization"][2], "{:.2f}"), f(x["rank_utilization"][3], "{:.2f}"),
            f(per_round, "{:.2f}"), f(x["final_loss"], "{:.3f}")]) + " |")
    r = d.get("ratio")
    if r:
        rows.append(f"\nlocked / paced, median seconds to the target: "
                    f"{r['time_to_target_locked_over_paced']:.2f}")
    return "\n".join(rows)


def smoke_check(runs):
    for r in runs:
        if r["mode"] == "paced":
            if len(set(r["rounds"])) != 1 or r["rounds"][0] < 1:
                raise SystemExit(f"FAIL: the paced run's ranks ended after rounds {r['rounds']}")
            if not min(r["steps"][k] for k in FAST) > max(r["steps"][k] for k in SLOW):
                raise SystemExit(f"FAIL: paced, the fast pair took no more steps than the slow "
                                 f"one: {r['steps']}")
        if not all(len(u) >= 2 for u in r["util"]):
            raise SystemExit(f"FAIL: {r['mode']}: a rank wrote fewer than 2 utilization lines")
    print("smoke: every run ended; paced: every rank after the same round, the fast pair with "
          "more steps")


def main():
    args = parse_args()
    if args.from_json:
        print(markdown(args.from_json))
        d = json.load(open(args.from_json))
        os.makedirs(args.out_dir, exist_ok=True)
        plot(argparse.Namespace(**d["args"]), d["runs"], d["modes"],
             os.path.join(args.out_dir, "paced.png"))
        return
    reason = nc.unavailable_reason()
    if reason and args.smoke and os.environ.get("MODELAVG_REQUIRE_CLUSTER") != "1":
        print(f"SKIP: {reason} (MODELAVG_REQUIRE_CLUSTER=1 fails instead)")
        sys.exit(77)
    if reason:
        raise SystemExit(f"the benchmark needs a cluster of network namespaces: {reason}")
    if (args.smoke and args.cpu_quota
            and not os.access(os.path.join(CPU_CGROUP, "cgroup.procs"), os.W_OK)):
        print(f"smoke: no writable {CPU_CGROUP}: the workers run uncapped")
        args.cpu_quota = 0.0
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(143)))
    os.makedirs(args.out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="modelavg-paced-")
    runs, out = [], []
    caps = CpuCaps(args.cpu_quota, len(WORKERS))

    def save():
        with open(os.path.join(args.out_dir, "paced.json"), "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "corpus_path"},
                       "modes": out, "ratio": ratio(out), "runs": runs}, f, indent=1)

    try:
        args.corpus_path = os.path.join(tmp, "corpus.pt")
        corpus.prepare(args.corpus_path)
        hosts = [nc.Host("coord", None)] + [nc.Host(n, s) for n, s in WORKERS]
        with nc.Cluster(hosts, site_rate_mbit=args.rate_mbit) as cluster:
            for mode in args.mode_list:
                rs = []
                for seed in args.seed_list:
                    t = time.monotonic()
                    r = run_once(args, cluster, mode, seed, tmp, caps)
                    rs.append(r)
                    runs.append(r)
                    print(json.dumps({"mode": mode, "seed": seed, "steps": r["steps"],
                                      "rounds": r["rounds"], "utilization": r["utilization"],
                                      "from_round2": r["utilization_from_round2"],
                                      "round_steps": [r["round_steps"][k]
                                                      for k in (0, args.slow_rank)],
                                      "seconds_to_target": r["seconds_to_target"],
                                      "final_loss": round(r["final_loss"], 4),
                                      "run_s": round(time.monotonic() - t, 1)}), flush=True)
                out.append(mode_line(args, mode, rs))
                print(json.dumps(out[-1]), flush=True)
                save()
    finally:
        caps.close()
        if args.keep:
            print(f"logs: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    r = ratio(out)
    if r:
        print(json.dumps(r), flush=True)
    save()
    try:
        plot(args, runs, out, os.path.join(args.out_dir, "paced.png"))
        print(f"plot: {os.path.join(args.out_dir, 'paced.png')}")
    except ImportError as e:
        print(f"no plot: {e}")
    if args.smoke:
        smoke_check(runs)


if __name__ == "__main__":
    main()
