#!/usr/bin/python3
"""torchft and modelavg side by side: time to a target loss, bytes over the site link, overhead
over no averaging, and recovery after kill -9 of one replica.

  sudo /usr/bin/python3 bench/peers/run.py        # 50 and 5 Mbit/s, every mode, seeds 1,2,3
  sudo /usr/bin/python3 bench/peers/run.py --rates=5 --modes=ft_diloco,ma_diloco --seeds=1

The work is bench/lm's (the same byte-level transformer, corpus, AdamW inner optimizer, worker
loop and namespace cluster: two sites of two workers, the sites' uplinks shaped with tbf), but
the four workers are four peer replicas averaging every --diloco_period steps with DiLoCo's
outer step (SGD lr 0.7, momentum 0.9, Nesterov), as torchft runs it. The modes
(bench/peers/peer_modes.py): torchft's DiLoCo, streaming DiLoCo (4 fragments, delay 1) and
quantized DiLoCo (ft_*; the wheel's Lighthouse on the core host, a Manager per replica), and
modelavg's drop-in in the same modes plus INT4 with error feedback (ma_*; the coordinator on the
core host). Both are fault tolerant in every run: torchft's min_replica_size and the
Lighthouse's --min_replicas are 3, modelavg's job is elastic with min_world_size 3; both
declare a silent replica dead after 3 s of missing heartbeats (the Lighthouse's
--heartbeat_timeout_ms, the coordinator's default).

For each rate it runs the floor (`none`: no communication) first and last, every mode once per
seed (printing one JSON line per mode once its seeds are done: time to the target as median
and range over the seeds, steps, final loss, megabytes over site b's uplink, x floor — the
seconds to the target over the floor's seconds per step times the steps), then one recovery run
per system (--recovery): the target is switched off, rank 3 (site b) is killed with SIGKILL
half a period after its first sync and restarted at once as a replacement; the JSON line gives
the seconds from the kill to the survivors' next averaged step (rank 0's next sync that
committed) and to the restarted replica's first sync that carries its own contribution (torchft:
the first committed sync after the one that healed it; modelavg: the first sync after its
admission step, where it received its peers' average). Last, the ratios modelavg / torchft of
the best mode of each (the fastest to the target, median over seeds) per rate.

Writes --out_dir/peers.json (every figure) and --out_dir/peers.png (time to the target and
bytes per mode at each rate). Needs root, the `fortunes` package, python3-torch and
python3-matplotlib for this script, a Python with PyTorch 2.x, torchft 0.2.0 and modelavg's
package for the workers (--python, --build_dir).
"""

import argparse
import json
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
sys.path.insert(0, os.path.join(HERE, "..", "lm"))
sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
import corpus  # noqa: E402
import drivers  # noqa: E402
import netcluster as nc  # noqa: E402

WORKERS = [("w0", "a"), ("w1", "a"), ("w2", "b"), ("w3", "b")]
COORD_PORT = 7000
LIGHTHOUSE_PORT = 29510
KILLED = 3  # the rank killed in a recovery run (site b)
MIN_REPLICAS = 3
HEARTBEAT_TIMEOUT_MS = 3000


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--modes", default="ft_diloco,ma_diloco,ft_streaming,ma_streaming,ft_int8,"
                                      "ma_int8,ma_int4_ef")
    p.add_argument("--recovery", default="ft_diloco,ma_diloco",
                   help="modes given a kill -9 run at each rate (empty: none)")
    p.add_argument("--rates", default="50,5", help="site link rates, Mbit/s")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--target_loss", type=float, default=2.7)
    p.add_argument("--max_steps", type=int, default=768)
    p.add_argument("--floor_steps", type=int, default=128)
    p.add_argument("--recovery_steps", type=int, default=768)
    p.add_argument("--eval_every", type=int, default=32)
    p.add_argument("--diloco_period", type=int, default=128)
    p.add_argument("--outer_lr", type=float, default=0.7)
    p.add_argument("--outer_momentum", type=float, default=0.9)
    drivers.add_model_args(p)  # bench/lm's
    p.add_argument("--lighthouse_join_timeout_ms", type=int, default=10000,
                   help="how long the Lighthouse waits for a heartbeating replica that has not "
                        "asked for the quorum (torchft's README uses 10000)")
    p.add_argument("--timeout_s", type=float, default=600, help="per run")
    p.add_argument("--keep", action="store_true", help="keep the workers' logs (printed)")
    p.add_argument("--from_json", default="",
                   help="comma-separated peers.json files (e.g. one per rate): print their "
                        "ratios and plot them together, running nothing")
    p.add_argument("--retarget", type=float, default=None,
                   help="with --from_json: the time to this validation loss instead, read from "
                        "each run's evaluations")
    p.add_argument("--out_dir", default=os.path.join(REPO, "bench", "peers", "out"))
    p.add_argument("--build_dir", default=os.path.join(REPO, "build"))
    venv = os.path.join(REPO, ".venv", "bin", "python")
    p.add_argument("--python", default=venv, help="the workers' Python (PyTorch 2.x, torchft)")
    args = p.parse_args()
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    args.seed_list = [int(x) for x in args.seeds.split(",") if x.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.recovery_list = [m.strip() for m in args.recovery.split(",") if m.strip()]
    return args


def ft_reason(args):
    """Why torchft cannot run with the workers' Python (None: it can), and why its quantized
    mode cannot (None: it can)."""
    probe = ("import sys; sys.path.insert(0, %r)\n"
             "try:\n import torchft, torchft.manager, torchft.local_sgd\n"
             "except Exception as e:\n print('NOFT', repr(e)); raise SystemExit\n"
             "import peer_modes; print('Q', peer_modes.ft_quantization_unavailable())") % HERE
    out = subprocess.run([args.python, "-c", probe], capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return f"{args.python} failed: {out.stderr[-500:]}", None
    if lines[-1].startswith("NOFT"):
        return f"torchft does not import: {lines[-1][5:]}", None
    q = lines[-1][2:]
    return None, (None if q == "None" else q)


def start_service(args, cluster, mode, tmp, tag):
    """The mode's rendezvous on the core host: modelavg's coordinator or torchft's Lighthouse."""
    coord = cluster.hosts["coord"]
    log = open(os.path.join(tmp, f"{tag}.service.log"), "w")
    if mode.startswith("ft_"):
        lighthouse = os.path.join(os.path.dirname(args.python), "torchft_lighthouse")
        argv = [lighthouse, f"--min_replicas={MIN_REPLICAS}",
                f"--bind={coord.address}:{LIGHTHOUSE_PORT}", "--quorum_tick_ms=100",
                f"--heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}",
                f"--join_timeout_ms={args.lighthouse_join_timeout_ms}"]
        address = f"{coord.address}:{LIGHTHOUSE_PORT}"
    elif mode.startswith("ma_"):
        argv = [os.path.join(args.build_dir, "server", "modelavg-coordinator"),
                f"--listen={coord.address}:{COORD_PORT}", "--log_level=warn",
                f"--default_heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}"]
        address = f"{coord.address}:{COORD_PORT}"
    else:
        return None, ""
    proc = cluster.popen("coord", argv, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    if proc.poll() is not None:
        raise SystemExit(f"{argv[0]} exited: {open(log.name).read()[-2000:]}")
    return proc, address


def worker_argv(args, cluster, mode, rank, seed, tmp, tag, address, steps, target, files=None):
    host = WORKERS[rank][0]
    files = files or tag  # the replacement's files are its own; its job is the run's
    return [args.python, os.path.join(HERE, "worker.py"), f"--mode={mode}", f"--rank={rank}",
            f"--world_size={len(WORKERS)}", f"--address={cluster.hosts[host].address}",
            f"--master={cluster.hosts['w0'].address}", f"--coordinator={address}",
            f"--job=peers-{tag}", f"--corpus={args.corpus_path}",
            f"--out={os.path.join(tmp, f'{files}.{rank}.jsonl')}", f"--seed={seed}",
            f"--stop_file={os.path.join(tmp, f'{files}.stop')}", f"--max_steps={steps}",
            f"--eval_every={args.eval_every}", f"--target_loss={target}",
            *drivers.worker_flags(args), f"--stop_period={args.diloco_period}",
            f"--outer_lr={args.outer_lr}", f"--outer_momentum={args.outer_momentum}",
            f"--diloco_period={args.diloco_period}"]


def worker_env(args, tmp, tag, rank, rejoin=False):
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build_dir, "python"),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               MODELAVG_MIN_WORLD_SIZE=str(MIN_REPLICAS), PEERS_MIN_REPLICAS=str(MIN_REPLICAS),
               PEERS_EVENTS=os.path.join(tmp, f"{tag}.{rank}{'.rejoin' if rejoin else ''}.events"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"))
    if rejoin:
        env["PEERS_REJOIN"] = "1"
    return env


def events(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def run_once(args, cluster, mode, seed, tmp, recovery=False):
    tag = f"{mode}.s{seed}.r{args.rate:g}{'.kill' if recovery else ''}"
    service, address = start_service(args, cluster, mode, tmp, tag)
    steps = args.floor_steps if mode == "none" else (
        args.recovery_steps if recovery else args.max_steps)
    target = -1.0 if recovery else args.target_loss
    before = cluster.site_bytes("b")
    procs = []
    for rank, (host, _) in enumerate(WORKERS):
        err = open(os.path.join(tmp, f"{tag}.{rank}.err"), "w")
        procs.append(cluster.popen(
            host, worker_argv(args, cluster, mode, rank, seed, tmp, tag, address, steps, target),
            stdout=err, stderr=subprocess.STDOUT, env=worker_env(args, tmp, tag, rank)))
    deadline = time.monotonic() + args.timeout_s
    figures = {}
    if recovery:
        figures = kill_and_restart(args, cluster, mode, seed, tmp, tag, address, procs, deadline)
    failed = drivers.wait_workers(procs, deadline,
                                  lambda rank: os.path.join(tmp, f"{tag}.{rank}.err"),
                                  skip=(KILLED,) if recovery else ())
    if recovery:  # the replacement runs behind the survivors: give it time to contribute
        figures.update(recovery_figures(tmp, tag, figures["kill_t"], wait_s=60))
        replacement = figures.pop("proc")
        if replacement.poll() is None:
            os.killpg(replacement.pid, signal.SIGKILL)
            replacement.wait()
    link = cluster.site_bytes("b") - before
    if service is not None:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
    if failed and recovery:  # a finding, not the end of the benchmark: logs kept, reason told
        keep = os.path.join(args.out_dir, "logs")
        os.makedirs(keep, exist_ok=True)
        for name in os.listdir(tmp):
            if name.startswith(tag + ".") and name.endswith((".err", ".events", ".log")):
                shutil.copy(os.path.join(tmp, name), keep)
        rank, rc, err = failed[0]
        last = [ln for ln in err.splitlines() if ln.strip()][-1:]
        figures["error"] = f"rank {rank} ended with {rc}: {last[0] if last else ''}"
    elif failed:
        rank, rc, err = failed[0]
        raise RuntimeError(f"{tag}: rank {rank} ended with {rc}:\n{err}")
    evals = [json.loads(line) for line in open(os.path.join(tmp, f"{tag}.0.jsonl"))]
    hit = next((e for e in evals if e["val_loss"] <= args.target_loss), None)
    return dict(figures, mode=mode, seed=seed, rate_mbit=args.rate, evals=evals,
                steps_run=evals[-1]["step"], seconds_run=evals[-1]["seconds"],
                final_loss=evals[-1]["val_loss"], link_bytes=link,
                steps_to_target=hit["step"] if hit else None,
                seconds_to_target=hit["seconds"] if hit else None)


def kill_and_restart(args, cluster, mode, seed, tmp, tag, address, procs, deadline):
    """SIGKILL rank KILLED half a period after its first sync, then start it again."""
    path = os.path.join(tmp, f"{tag}.{KILLED}.events")
    while not events(path):
        if time.monotonic() > deadline or procs[KILLED].poll() is not None:
            raise RuntimeError(f"{tag}: rank {KILLED} never synced: "
                               f"{open(os.path.join(tmp, f'{tag}.{KILLED}.err')).read()[-3000:]}")
        time.sleep(0.05)
    first = events(path)[0]["t"]
    seconds_per_step = (first - args.worker_start) / args.diloco_period
    time.sleep(seconds_per_step * args.diloco_period / 2)
    os.killpg(procs[KILLED].pid, signal.SIGKILL)
    kill_t = time.time()
    procs[KILLED].wait()
    host = WORKERS[KILLED][0]
    err = open(os.path.join(tmp, f"{tag}.{KILLED}.rejoin.err"), "w")
    argv = worker_argv(args, cluster, mode, KILLED, seed, tmp, tag, address,
                       args.recovery_steps, -1.0, files=tag + ".rejoin")
    proc = cluster.popen(host, argv, stdout=err, stderr=subprocess.STDOUT,
                         env=worker_env(args, tmp, tag, KILLED, rejoin=True))
    return {"kill_t": kill_t, "proc": proc}


def recovery_figures(tmp, tag, kill_t, wait_s):
    """Seconds from the kill to rank 0's next committed sync, and to the replacement's first
    sync with its own contribution."""
    def contributed(e, first_step):
        if "healing" in e:  # torchft: committed, participating, and not the healing quorum
            return e["committed"] and e["participating"] and not e["healing"]
        return e["step"] > first_step  # modelavg: after its admission step's sync
    rejoin_path = os.path.join(tmp, f"{tag}.{KILLED}.rejoin.events")
    end = time.monotonic() + wait_s
    back = None
    while back is None and time.monotonic() < end:
        es = events(rejoin_path)
        if es:
            first_step = es[0].get("admission", es[0]["step"])
            back = next((e for e in es if contributed(e, first_step)), None)
        if back is None:
            time.sleep(0.2)
    survivors = next((e for e in events(os.path.join(tmp, f"{tag}.0.events"))
                      if e["t"] > kill_t and e["committed"]), None)
    return {"survivors_s": survivors["t"] - kill_t if survivors else None,
            "rejoined_s": back["t"] - kill_t if back else None}


def spread(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": round(values[0], 3),
            "max": round(values[-1], 3)}


def mode_line(args, mode, rs, floor):
    """One mode's figures over its seeds' runs (floor: the compute floor's seconds per step;
    None: each run's x_floor as it is)."""
    hit = [r for r in rs if r["steps_to_target"]]
    if floor is not None:
        for r in rs:
            r["x_floor"] = (r["seconds_run"] / r["steps_run"]) / floor if floor else None
    return {"rate_mbit": rs[0]["rate_mbit"], "mode": mode, "target_loss": args.target_loss,
            "reached": f"{len(hit)}/{len(rs)}",
            "seconds_to_target": spread([r["seconds_to_target"] for r in hit]),
            "steps_to_target": spread([r["steps_to_target"] for r in hit]),
            "final_loss": spread([r["final_loss"] for r in rs]),
            "link_MB": spread([r["link_bytes"] / 1e6 for r in rs]),
            "x_floor": spread([r["x_floor"] for r in rs])}


def best(lines, prefix):
    ok = [x for x in lines if x["mode"].startswith(prefix) and x.get("seconds_to_target")]
    return min(ok, key=lambda x: x["seconds_to_target"]["median"]) if ok else None


def ratios(args, lines, recoveries):
    out = []
    for rate in args.rate_list:
        at = [x for x in lines if x["rate_mbit"] == rate]
        ma, ft = best(at, "ma_"), best(at, "ft_")
        r = {"rate_mbit": rate, "ma_best": ma and ma["mode"], "ft_best": ft and ft["mode"]}
        if ma and ft:
            r["time_to_target_ma_over_ft"] = round(
                ma["seconds_to_target"]["median"] / ft["seconds_to_target"]["median"], 3)
            r["link_MB_ma_over_ft"] = round(ma["link_MB"]["median"] / ft["link_MB"]["median"], 3)
        rec = {x["mode"][:2]: x for x in recoveries if x["rate_mbit"] == rate}
        if "ma" in rec and "ft" in rec:
            for key in ("survivors_s", "rejoined_s"):
                a, b = rec["ma"].get(key), rec["ft"].get(key)
                r[f"{key}_ma_over_ft"] = round(a / b, 3) if a and b else None
        out.append(r)
    return out


def plot(lines, recoveries, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    modes = list(dict.fromkeys(x["mode"] for x in lines))
    width = 0.8 / max(1, len(args.rate_list))
    for k, rate in enumerate(args.rate_list):
        at = {x["mode"]: x for x in lines if x["rate_mbit"] == rate}
        xs = [i + k * width for i in range(len(modes))]
        for ax, key in ((axes[0], "seconds_to_target"), (axes[1], "link_MB")):
            med = [at[m][key]["median"] if m in at and at[m].get(key) else 0 for m in modes]
            lo = [med[i] - at[m][key]["min"] if m in at and at[m].get(key) else 0
                  for i, m in enumerate(modes)]
            hi = [at[m][key]["max"] - med[i] if m in at and at[m].get(key) else 0
                  for i, m in enumerate(modes)]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=f"{rate:g} Mbit/s",
                   color=f"C{k}")
        rec = [x for x in recoveries if x["rate_mbit"] == rate]
        xs = [i + k * width for i in range(len(rec))]
        axes[2].bar([x - width / 4 for x in xs], [r["survivors_s"] or 0 for r in rec],
                    width / 2, color=f"C{k}", label=f"survivors, {rate:g} Mbit/s")
        axes[2].bar([x + width / 4 for x in xs], [r["rejoined_s"] or 0 for r in rec],
                    width / 2, color=f"C{k}", alpha=0.5, hatch="//",
                    label=f"restarted, {rate:g} Mbit/s")
        axes[2].set_xticks(range(len(rec)), [r["mode"] for r in rec])
    for ax, title in ((axes[0], f"seconds to validation loss {args.target_loss}"),
                      (axes[1], "MB over the site link (whole run)")):
        ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    axes[2].set_title("seconds from kill -9 to an averaged step")
    axes[2].legend(fontsize=7)
    axes[2].grid(axis="y", alpha=0.3)
    fig.suptitle(f"4 replicas, 2 sites; DiLoCo every {args.diloco_period} steps "
                 f"(median and range over seeds {args.seeds})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    args = parse_args()
    if args.from_json:
        os.makedirs(args.out_dir, exist_ok=True)
        lines, recoveries = [], []
        for path in args.from_json.split(","):
            d = json.load(open(path))
            recoveries += d["recoveries"]
            args.seeds, args.target_loss = d["args"]["seeds"], d["args"]["target_loss"]
            args.diloco_period = d["args"]["diloco_period"]
            if args.retarget is None:
                lines += d["modes"]
                continue
            args.target_loss = args.retarget
            for x in d["modes"]:
                rs = [r for r in d["runs"] if "kill_t" not in r and r["mode"] == x["mode"]
                      and r["rate_mbit"] == x["rate_mbit"]]
                if "not_run" in x or not rs:
                    lines.append(x)
                    continue
                for r in rs:
                    hit = next((e for e in r["evals"] if e["val_loss"] <= args.retarget), None)
                    r["steps_to_target"] = hit["step"] if hit else None
                    r["seconds_to_target"] = hit["seconds"] if hit else None
                lines.append(mode_line(args, x["mode"], rs, None))
        if args.retarget is not None:
            for x in lines:
                print(json.dumps(x), flush=True)
        args.rate_list = list(dict.fromkeys(x["rate_mbit"] for x in lines))
        finish(args, lines, recoveries, [])
        return
    reason = nc.unavailable_reason()
    if reason:
        raise SystemExit(f"the benchmark needs a cluster of network namespaces: {reason}")
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(143)))
    no_ft, no_quant = ft_reason(args)
    skipped = {}
    for m in args.mode_list + args.recovery_list:
        if m.startswith("ft_") and no_ft:
            skipped[m] = no_ft
        elif m == "ft_int8" and no_quant:
            skipped[m] = no_quant
    os.makedirs(args.out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="modelavg-peers-")
    lines, recoveries, runs = [], [], []

    def save():
        with open(os.path.join(args.out_dir, "peers.json"), "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "corpus_path"},
                       "modes": lines, "recoveries": recoveries, "runs": runs}, f, indent=1)

    try:
        args.corpus_path = os.path.join(tmp, "corpus.pt")
        corpus.prepare(args.corpus_path)
        hosts = [nc.Host("coord", None)] + [nc.Host(n, s) for n, s in WORKERS]
        for rate in args.rate_list:
            args.rate = rate
            with nc.Cluster(hosts, site_rate_mbit=rate) as cluster:
                floors = [run_once(args, cluster, "none", args.seed_list[0], tmp)]
                floor = floors[0]["seconds_run"] / floors[0]["steps_run"]
                for mode in args.mode_list + [m for m in args.recovery_list
                                              if m not in args.mode_list]:
                    if mode in args.mode_list:
                        if mode in skipped:
                            line = {"rate_mbit": rate, "mode": mode, "not_run": skipped[mode]}
                        else:
                            rs = []
                            for seed in args.seed_list:
                                args.worker_start = time.time()
                                rs.append(run_once(args, cluster, mode, seed, tmp))
                            runs.extend(rs)
                            line = mode_line(args, mode, rs, floor)
                        lines.append(line)
                        print(json.dumps(line), flush=True)
                        save()
                    if mode not in args.recovery_list or mode in skipped:
                        continue
                    args.worker_start = time.time()
                    r = run_once(args, cluster, mode, args.seed_list[0], tmp, recovery=True)
                    runs.append(r)
                    line = {"rate_mbit": rate, "mode": mode, "recovery": "kill -9 of rank 3",
                            "survivors_s": r["survivors_s"] and round(r["survivors_s"], 2),
                            "rejoined_s": r["rejoined_s"] and round(r["rejoined_s"], 2),
                            "final_loss": round(r["final_loss"], 3),
                            **({"error": r["error"]} if "error" in r else {})}
                    recoveries.append(line)
                    print(json.dumps(line), flush=True)
                    save()
                floors.append(run_once(args, cluster, "none", args.seed_list[-1], tmp))
                f2 = [f["seconds_run"] / f["steps_run"] for f in floors]
                print(json.dumps({"rate_mbit": rate,
                                  "floor_s_per_step": [round(f, 4) for f in f2]}), flush=True)
    finally:
        if args.keep:
            print(f"logs: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    save()
    finish(args, lines, recoveries, runs)


def markdown(lines, recoveries):
    """The modes and recoveries as the Markdown table of docs/benchmarks.md."""
    def f(x, key, fmt="{:.1f}"):
        v = x.get(key)
        if not v:
            return "-"
        return (fmt + " [" + fmt + ", " + fmt + "]").format(v["median"], v["min"], v["max"])
    rec = {(x["rate_mbit"], x["mode"]): x for x in recoveries}
    out = ["| Mbit/s | mode | reached | seconds to target | steps | final loss | link MB | "
           "x floor | kill -9: survivors s | restarted s |", "|" + "---|" * 10]
    for x in lines:
        r = rec.get((x["rate_mbit"], x["mode"]), {})
        if "not_run" in x:
            out.append(f"| {x['rate_mbit']:g} | {x['mode']} | not run: {x['not_run']} |" +
                       " |" * 7)
            continue
        out.append(" | ".join([
            f"| {x['rate_mbit']:g}", x["mode"], x["reached"], f(x, "seconds_to_target"),
            f(x, "steps_to_target", "{:.0f}"), f(x, "final_loss", "{:.3f}"), f(x, "link_MB"),
            f(x, "x_floor", "{:.2f}"), str(r.get("survivors_s", "-")),
            str(r.get("rejoined_s", "-"))]) + " |")
    return "\n".join(out)


def finish(args, lines, recoveries, runs):
    for r in ratios(args, lines, recoveries):
        print(json.dumps(r), flush=True)
    if args.from_json:
        print(markdown(lines, recoveries))
    try:
        plot(lines, recoveries, args, os.path.join(args.out_dir, "peers.png"))
    except ImportError as e:
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
