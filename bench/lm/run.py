#!/usr/bin/python3
"""Time to a target loss across a slow link: a small transformer LM on four workers, two sites.

  sudo /usr/bin/python3 bench/lm/run.py                       # every mode, 50 Mbit/s
  sudo /usr/bin/python3 bench/lm/run.py --rate_mbit=20 --modes=ddp,modelavg
  sudo /usr/bin/python3 bench/lm/run.py --seeds=1,2,3 --modes=none,modelavg,diloco,int8

Builds a cluster of network namespaces (tests/cluster/netcluster.py): workers w0, w1 in site a,
w2, w3 in site b, the sites joined by a link shaped with tbf to --rate_mbit in each direction, a
modelavg coordinator on a host of its own. For each mode (bench/lm/modes.py) it starts the four
workers (bench/lm/worker.py), which train a byte-level transformer on the training split of
Debian's fortunes corpus (bench/lm/corpus.py) until rank 0's validation loss on the held-out
split reaches --target_loss (or --max_steps). Then it prints a table:

  mode      the mode
  steps     steps to the target (rank 0's first evaluation at or below it)
  seconds   training wall-clock to the target (rank 0's clock, evaluation time excluded)
  x floor   seconds / (the compute floor's seconds per step x steps): 1.0 is communication
            for free; the floor is the `none` mode's seconds per step (no communication at all,
            run first and again last, the two averaged, since the machine's load drifts;            the same four processes sharing the same CPUs)
  link MB   megabytes that crossed site b's uplink in the whole run (interface counters, both
            directions, Ethernet frames)
  sent MB   megabytes rank 0 handed to the transport in the last (cross-site) level's rounds,
            from modelavg's traffic() (modelavg modes only)
  sync KB   of those, kilobytes per cross-site sync after the first (diloco* modes; the first,
            at step 0, is FP32 whatever the payload: it sets the anchor)
  final     rank 0's last validation loss
  avg ms    rank 0's milliseconds per step in the mode's after-step call (the averagers' whole
            cost: decisions, copies, all-reduces; DDP's communication is inside backward: -)

With several --seeds (each seed its own initial model and batches; the held-out split is the
same) every mode runs once per seed, a table per seed, then one line per mode: the median and
the range of steps, seconds and x floor over the seeds, and how many seeds reached the target.

It writes --out_dir/lm_bench.png (validation loss against wall-clock, one line per mode) and
--out_dir/lm_bench.json (every figure and every evaluation). Needs root (namespaces), the tests'
.venv (deploy/install_deps.sh: the workers' PyTorch), python3-torch and python3-matplotlib (this
script's corpus and plot), the `fortunes` package, and a build (modelavg-coordinator and the
Python package: cmake --build build --target modelavg-coordinator modelavg-python).
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
import corpus  # noqa: E402
import drivers  # noqa: E402
import modes  # noqa: E402
import netcluster as nc  # noqa: E402

WORKERS = [("w0", "a"), ("w1", "a"), ("w2", "b"), ("w3", "b")]
COORD_PORT = 7000


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--modes", default="none,ddp,torch_avg,modelavg,diloco,streaming,int8",
                   help=f"comma-separated, from {sorted(modes.MODES)} (none first: the floor)")
    p.add_argument("--rate_mbit", type=float, default=50, help="the site link's rate")
    p.add_argument("--target_loss", type=float, default=2.6,
                   help="validation loss (nats per byte) to reach")
    p.add_argument("--max_steps", type=int, default=1200)
    p.add_argument("--floor_steps", type=int, default=128,
                   help="steps the `none` mode runs (it measures seconds per step)")
    p.add_argument("--eval_every", type=int, default=32)
    drivers.add_model_args(p)
    p.add_argument("--diloco_period", type=int, default=128,
                   help="the diloco mode's cross-site period (its outer step)")
    p.add_argument("--diloco_site_period", type=int, default=2,
                   help="the diloco mode's period of the plain average inside a site")
    p.add_argument("--outer_lr", type=float, default=0.9,
                   help="the diloco mode's outer learning rate")
    p.add_argument("--outer_momentum", type=float, default=0.3,
                   help="the diloco mode's outer Nesterov momentum")
    p.add_argument("--topk_density", type=float, default=0.02,
                   help="the diloco_topk* modes' Level.topk_density")
    p.add_argument("--seeds", default="1",
                   help="comma-separated seeds; with more than one, every mode runs once per "
                        "seed and a summary gives the median and range over them")
    p.add_argument("--timeout_s", type=float, default=1800, help="per mode")
    p.add_argument("--out_dir", default=os.path.join(REPO, "bench", "lm", "out"))
    p.add_argument("--build_dir", default=os.path.join(REPO, "build"))
    venv_python = os.path.join(REPO, ".venv", "bin", "python")
    p.add_argument("--python", default=venv_python if os.access(venv_python, os.X_OK)
                   else "/usr/bin/python3",
                   help="the workers' Python (default: the repository's .venv, PyTorch 2.x from "
                        "PyPI, when present)")
    p.add_argument("--smoke", action="store_true",
                   help="CI: a tiny model for a few dozen steps, every mode; fails unless each "
                        "mode's loss fell and PyTorch's averagers and modelavg's agree; skips "
                        "(77) without namespaces unless MODELAVG_REQUIRE_CLUSTER=1")
    args = p.parse_args()
    if args.smoke:
        args.d_model, args.layers, args.batch, args.max_steps = 32, 1, 4, 66
        args.floor_steps, args.target_loss = 66, 0.0
        args.diloco_period = 32  # two outer steps in the smoke run's 66
        if args.modes == p.get_default("modes"):  # the error-feedback payloads too
            args.modes += ",diloco_int4_ef,diloco_topk_ef"
    try:
        args.seed_list = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, not {args.seeds!r}")
    if not args.seed_list:
        p.error("--seeds names no seed")
    return args


def run_mode(args, cluster, mode, tmp, corpus_path, seed=1):
    """Runs one mode to its end with `seed`; returns its figures and rank 0's evaluations."""
    coord = cluster.hosts["coord"]
    master = cluster.hosts["w0"].address
    tag = f"{mode}.s{seed}"
    stop_file = os.path.join(tmp, f"{tag}.stop")
    procs = []
    coordinator = None
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build_dir, "python"),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if mode in modes.NEEDS_COORDINATOR:
        log = open(os.path.join(tmp, f"{tag}.coordinator.log"), "w")
        coordinator = cluster.popen("coord", [
            os.path.join(args.build_dir, "server", "modelavg-coordinator"),
            f"--listen={coord.address}:{COORD_PORT}", "--log_level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1.0)
        if coordinator.poll() is not None:
            raise SystemExit(f"the coordinator exited: {open(log.name).read()[-2000:]}")
    steps = args.floor_steps if mode == "none" else args.max_steps
    stop_period = 1 if mode == "ddp" else max(modes.MODES[mode].levels(args))
    before = cluster.site_bytes("b")
    started = time.monotonic()
    for rank, (host, _) in enumerate(WORKERS):
        argv = [args.python, os.path.join(HERE, "worker.py"), f"--mode={mode}",
                f"--rank={rank}", f"--world_size={len(WORKERS)}",
                f"--address={cluster.hosts[host].address}", f"--master={master}",
                f"--coordinator={coord.address}:{COORD_PORT}", f"--job=lm-{mode}-s{seed}",
                f"--corpus={corpus_path}", f"--out={os.path.join(tmp, f'{tag}.{rank}.jsonl')}",
                f"--seed={seed}",
                f"--stop_file={stop_file}", f"--max_steps={steps}",
                f"--eval_every={args.eval_every}", f"--target_loss={args.target_loss}",
                *drivers.worker_flags(args),
                f"--stop_period={stop_period}", f"--outer_lr={args.outer_lr}",
                f"--diloco_period={args.diloco_period}",
                f"--diloco_site_period={args.diloco_site_period}",
                f"--outer_momentum={args.outer_momentum}",
                f"--topk_density={args.topk_density}"]
        err = open(os.path.join(tmp, f"{tag}.{rank}.err"), "w")
        procs.append(cluster.popen(host, argv, stdout=err, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + args.timeout_s
    failed = drivers.wait_workers(procs, deadline,
                                  lambda rank: os.path.join(tmp, f"{tag}.{rank}.err"))
    wall = time.monotonic() - started
    link_bytes = cluster.site_bytes("b") - before
    if coordinator is not None:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(timeout=10)
    if failed:
        rank, rc, err = failed[0]
        raise SystemExit(f"mode {mode} (seed {seed}): rank {rank} ended with {rc}:\n{err}")
    evals = [json.loads(line) for line in open(os.path.join(tmp, f"{tag}.0.jsonl"))]
    hit = next((e for e in evals if e["val_loss"] <= args.target_loss), None)
    return {"mode": mode, "seed": seed, "evals": evals, "steps_run": evals[-1]["step"],
            "seconds_run": evals[-1]["seconds"], "final_loss": evals[-1]["val_loss"],
            "steps_to_target": hit["step"] if hit else None,
            "seconds_to_target": hit["seconds"] if hit else None,
            "link_bytes": link_bytes, "process_wall_s": wall,
            "rank0_bytes_sent": evals[-1].get("bytes_sent"),
            "rank0_bytes_at_step0": evals[-1].get("bytes_at_step0")}


def after_ms(r):
    """Rank 0's milliseconds per step in the after-step call, over the whole run."""
    last = r["evals"][-1]
    if r["mode"] == "ddp" or "after_step_seconds" not in last or not last["step"]:
        return "-"
    return f"{1000 * last['after_step_seconds'] / last['step']:.1f}"


def sync_kb(r, args):
    """Rank 0's kilobytes per cross-site sync after the first (the diloco* modes: a sync every
    --diloco_period steps from step 0, whose first sync is FP32 in every payload)."""
    if not r["mode"].startswith("diloco") or not r["rank0_bytes_sent"]:
        return "-"
    syncs = (r["steps_run"] - 1) // args.diloco_period
    if syncs <= 0:
        return "-"
    later = r["rank0_bytes_sent"][-1] - r["rank0_bytes_at_step0"][-1]
    return f"{later / syncs / 1e3:.0f}"


def table(results, floor, args):
    rows = [("mode", "steps", "seconds", "x floor", "link MB", "sent MB", "sync KB", "final",
             "avg ms")]
    for r in results:
        steps, secs = r["steps_to_target"], r["seconds_to_target"]
        ratio = (secs / (floor * steps)) if (steps and floor) else None
        r["x_floor"] = ratio
        rows.append((r["mode"], str(steps) if steps else f">{r['steps_run']}",
                     f"{secs:.1f}" if secs is not None else f">{r['seconds_run']:.1f}",
                     f"{ratio:.2f}" if ratio else "-", f"{r['link_bytes'] / 1e6:.1f}",
                     f"{r['rank0_bytes_sent'][-1] / 1e6:.2f}" if r["rank0_bytes_sent"] else "-",
                     sync_kb(r, args), f"{r['final_loss']:.3f}", after_ms(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def summary(results, args):
    """One line per mode: the median and range over the seeds of steps, seconds and x floor to
    the target, and how many seeds reached it."""
    def spread(values, fmt):
        if not values:
            return "-"
        values = sorted(values)
        return f"{fmt(statistics.median(values))} [{fmt(values[0])}, {fmt(values[-1])}]"
    rows = [("mode", "reached", "steps", "seconds", "x floor", "link MB")]
    for mode in dict.fromkeys(r["mode"] for r in results if r["mode"] != "none"):
        rs = [r for r in results if r["mode"] == mode]
        hit = [r for r in rs if r["steps_to_target"]]
        rows.append((mode, f"{len(hit)}/{len(rs)}",
                     spread([r["steps_to_target"] for r in hit], lambda v: f"{v:.0f}"),
                     spread([r["seconds_to_target"] for r in hit], lambda v: f"{v:.1f}"),
                     spread([r["x_floor"] for r in hit if r.get("x_floor")],
                            lambda v: f"{v:.2f}"),
                     spread([r["link_bytes"] / 1e6 for r in rs], lambda v: f"{v:.1f}")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def plot(results, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for r in results:  # one colour a mode; the first seed's line labelled and solid
        first = r["mode"] not in colors
        colors.setdefault(r["mode"], f"C{len(colors)}")
        ax.plot([e["seconds"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]],
                marker="." if first else None, color=colors[r["mode"]],
                alpha=1.0 if first else 0.45, label=r["mode"] if first else None)
    ax.axhline(args.target_loss, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xscale("log")  # DDP takes ten times as long as the averaging modes
    ax.set_xlabel("training wall-clock (s, log scale)")
    ax.set_ylabel("validation loss (nats/byte)")
    period = (f", DiLoCo every {args.diloco_period} steps"
              if any(r["mode"].startswith("diloco") for r in results) else "")
    ax.set_title(f"4 workers, 2 sites, {args.rate_mbit:g} Mbit/s between them{period}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    args = parse_args()
    mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "none" in mode_list and len(mode_list) > 1 and not args.smoke:
        mode_list.append("none")  # the floor again at the end: the average of the two is used
    unknown = [m for m in mode_list if m not in modes.MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {sorted(modes.MODES)}")
    reason = nc.unavailable_reason()
    if reason and args.smoke and os.environ.get("MODELAVG_REQUIRE_CLUSTER") != "1":
        print(f"SKIP: {reason} (MODELAVG_REQUIRE_CLUSTER=1 fails instead)")
        sys.exit(77)
    if reason:
        raise SystemExit(f"the benchmark needs a cluster of network namespaces: {reason}")
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(143)))
    os.makedirs(args.out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="modelavg-lmbench-")
    results = []
    try:
        corpus_path = os.path.join(tmp, "corpus.pt")
        n_train, n_val = corpus.prepare(corpus_path)
        print(f"corpus: {n_train} training bytes, {n_val} held-out bytes "
              f"({corpus.FORTUNES})", flush=True)
        hosts = [nc.Host("coord", None)] + [nc.Host(n, s) for n, s in WORKERS]
        # The floor first and last (once each, whatever the seeds), every other mode per seed.
        seeds = args.seed_list
        runs = [(m, seed) for seed in seeds for m in mode_list if m != "none"]
        if "none" in mode_list:
            runs = [("none", seeds[0])] + runs + [("none", seeds[-1])] * (mode_list[-1] == "none")
        with nc.Cluster(hosts, site_rate_mbit=args.rate_mbit) as cluster:
            for mode, seed in runs:
                t = time.monotonic()
                r = run_mode(args, cluster, mode, tmp, corpus_path, seed)
                results.append(r)
                print(f"{mode} (seed {seed}): {r['steps_run']} steps in {r['seconds_run']:.1f} s, final loss "
                      f"{r['final_loss']:.3f}, {r['link_bytes'] / 1e6:.1f} MB over the link "
                      f"({time.monotonic() - t:.0f} s with start-up)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floors = [r["seconds_run"] / r["steps_run"] for r in results if r["mode"] == "none"]
    floor = sum(floors) / len(floors) if floors else None
    results = [r for i, r in enumerate(results) if r["mode"] != "none" or i == 0]
    print()
    print(f"target validation loss {args.target_loss}; link {args.rate_mbit:g} Mbit/s; "
          f"compute floor {floor:.3f} s/step (first and last: "
          f"{', '.join(f'{f:.3f}' for f in floors)})" if floor else "no `none` mode: no floor")
    for seed in args.seed_list:
        if len(args.seed_list) > 1:
            print(f"\nseed {seed}")
        print(table([r for r in results if r["seed"] == seed or r["mode"] == "none"], floor,
                    args))
    if len(args.seed_list) > 1:
        print(f"\nover seeds {args.seeds}: median [lowest, highest] of the seeds that reached the "
              f"target")
        print(summary(results, args))
    png = os.path.join(args.out_dir, "lm_bench.png")
    plot(results, args, png)
    with open(os.path.join(args.out_dir, "lm_bench.json"), "w") as f:
        json.dump({"args": vars(args), "floor_s_per_step": floor, "results": results}, f,
                  indent=1)
    print(f"plot: {png}")
    if args.smoke:
        smoke_check(results)


def smoke_check(results):
    by = {r["mode"]: r for r in results}
    for r in results:
        first, last = r["evals"][0]["val_loss"], r["final_loss"]
        if r["mode"].startswith("diloco"):
            # Two outer steps with Nesterov momentum in a 66-step run extrapolate past the
            # group's mean and need not lower the loss yet; it must have learned something:
            # below a uniform guess over the bytes, ln(256).
            if not last < math.log(256):
                raise SystemExit(f"FAIL: mode {r['mode']}: validation loss {last:.3f} is no better "
                                 f"than a uniform guess ({math.log(256):.3f})")
            continue
        if not last < first:
            raise SystemExit(f"FAIL: mode {r['mode']}: validation loss went from {first:.3f} "
                             f"to {last:.3f}")
    if "torch_avg" in by and "modelavg" in by:
        a, b = by["torch_avg"]["final_loss"], by["modelavg"]["final_loss"]
        if abs(a - b) > 0.01:
            raise SystemExit(f"FAIL: the same schedule gave {a:.4f} with PyTorch's averagers "
                             f"and {b:.4f} with modelavg's")
    # The compressed payloads travel as documented: after the first (FP32) sync, INT4 0.126x and
    # TOPK at 0.02 about 0.02x of FP32's bytes a sync; both well under a fifth.
    fp32 = by.get("diloco")
    for name in ("diloco_int4_ef", "diloco_topk_ef"):
        if name not in by or not fp32:
            continue
        later = [r["rank0_bytes_sent"][-1] - r["rank0_bytes_at_step0"][-1] for r in (by[name], fp32)]
        if not 0 < later[0] < 0.2 * later[1]:
            raise SystemExit(f"FAIL: mode {name} sent {later[0]} bytes after the first sync, FP32 "
                             f"DiLoCo {later[1]}: not the compressed payload")
    print("smoke: every mode's loss fell (diloco*: below a uniform guess); PyTorch's averagers "
          "and modelavg agree; the error-feedback payloads sent under a fifth of FP32's bytes")


if __name__ == "__main__":
    main()
