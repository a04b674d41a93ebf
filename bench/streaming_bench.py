#!/usr/bin/env python3
"""Streaming sync on loopback: bytes on the wire per worker-step and the longest stall of a
training step, for fragments F = 1 and 4, sync_delay 0 and > 0, payloads FP32, BF16 and INT8.

Starts a coordinator (--jobs_file) and `--world` modelavg-trace-worker processes per
configuration; each worker holds --numel float32 parameters as --tensors tensors and spends
--compute_ms per step before its averaging call (the "training step"). One outer level over the
world (DiLoCo's recipe, lr 0.7, momentum 0.9, nesterov), period --period. Prints one JSON line
per configuration: bytes_per_worker_step (the averager's count of bytes handed to Gloo,
averaged over workers and steps), longest_stall_ms (the longest averaging call, any worker,
after the first period), mean_call_ms, waited_ms (time calls waited for a background
all-reduce, summed over a worker's run, slowest worker).

  python3 bench/streaming_bench.py --build=build [--world=4 --numel=4194304 ...]

With --two_sites (needs root: `sudo /usr/bin/python3 bench/streaming_bench.py --two_sites`) the
run is on the two-site cluster of tests/cluster/netcluster.py instead of loopback: the
coordinator on the core, half the workers on site a and half on site b, each site's uplink
shaped to --site_mbit in each direction; each line then also has site_bytes_per_worker_step
(the Ethernet bytes that crossed site b's uplink, both directions, per worker and step).
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loopback:
    """Processes on this machine, the coordinator on 127.0.0.1."""

    def __init__(self, world):
        self.world = world
        self.coordinator_address = f"127.0.0.1:{free_port()}"

    def worker_host(self, rank):
        return None

    def popen(self, host, argv, **kwargs):
        return subprocess.Popen(argv, **kwargs)

    def gloo_hostname(self, rank):
        return "127.0.0.1"

    def site_bytes(self):
        return None


class TwoSites:
    """The netcluster: "coord" on the core, workers w0.. split between sites a and b."""

    def __init__(self, world, site_mbit):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests", "cluster"))
        import netcluster
        reason = netcluster.unavailable_reason()
        if reason:
            sys.exit(f"--two_sites: {reason}")
        hosts = [netcluster.Host("coord", None)] + [
            netcluster.Host(f"w{r}", "a" if r < world // 2 else "b") for r in range(world)]
        self.cluster = netcluster.Cluster(hosts, site_rate_mbit=site_mbit)
        self.coordinator_address = f"{self.cluster.hosts['coord'].address}:{free_port()}"

    def worker_host(self, rank):
        return f"w{rank}"

    def popen(self, host, argv, **kwargs):
        return self.cluster.popen(host or "coord", argv, **kwargs)

    def gloo_hostname(self, rank):
        return self.cluster.hosts[f"w{rank}"].address

    def site_bytes(self):
        return self.cluster.site_bytes("b")

    def close(self):
        self.cluster.close()


def run(args, build, name, fragments, delay, payload, tmp, net):
    level = {"period": args.period, "group_size": args.world, "fragments": fragments,
             "sync_delay": delay, "payload": payload,
             "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
    spec = {"jobs": [{"job_id": name, "world_size": args.world, "warmup_steps": 0,
                      "mode": "PERIODIC", "levels": [level]}]}
    jobs = os.path.join(tmp, name + ".json")
    with open(jobs, "w") as f:
        json.dump(spec, f)
    address = net.coordinator_address
    coord = net.popen(None, [os.path.join(build, "server", "modelavg-coordinator"),
                             f"--listen={address}", f"--jobs_file={jobs}",
                             "--log_level=warn"], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        site_before = net.site_bytes()
        workers = [net.popen(net.worker_host(r),
            [os.path.join(build, "tools", "modelavg-trace-worker"),
             f"--coordinator={address}", f"--job={name}", f"--rank={r}",
             f"--world_size={args.world}", f"--steps={args.steps}", f"--numel={args.numel}",
             f"--tensors={args.tensors}", f"--step_delay_ms={args.compute_ms}", "--unix_ms",
             f"--gloo_hostname={net.gloo_hostname(r)}",
             "--print_traffic", "--backend=gloo"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(args.world)]
        outs = []
        for w in workers:
            out, err = w.communicate(timeout=600)
            if w.returncode != 0:
                sys.exit(f"{name}: a worker failed: {err.strip()}")
            outs.append(out)
        site_after = net.site_bytes()
    finally:
        coord.terminate()
        coord.wait(timeout=30)
    calls, sent, waited = [], [], []
    for out in outs:
        for line in out.splitlines():
            d = json.loads(line)
            if "traffic" in d:
                sent.append(sum(t["bytes_sent"] for t in d["traffic"]))
                waited.append(sum(t["waited_ms"] for t in d["traffic"]))
            elif d["step"] >= args.period:  # past the first (plain) syncs of every fragment
                calls.append(d["call_ms"])
    out = {"fragments": fragments, "sync_delay": delay, "payload": payload,
            "world": args.world, "numel": args.numel, "tensors": args.tensors,
            "period": args.period, "compute_ms": args.compute_ms,
            "bytes_per_worker_step": round(sum(sent) / len(sent) / args.steps),
            "longest_stall_ms": max(calls), "mean_call_ms": round(sum(calls) / len(calls), 2),
            "waited_ms": round(max(waited), 1)}
    if site_before is not None:
        out["site_mbit"] = args.site_mbit
        out["site_bytes_per_worker_step"] = round(
            (site_after - site_before) / args.world / args.steps)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default="build")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--numel", type=int, default=4 << 20)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--compute_ms", type=int, default=50)
    p.add_argument("--two_sites", action="store_true",
                   help="run on the two-site network-namespace cluster (root)")
    p.add_argument("--site_mbit", type=int, default=200,
                   help="--two_sites: each site uplink's rate, each direction")
    p.add_argument("--fragments", default="1,4", help="comma-separated fragment counts")
    p.add_argument("--payloads", default="FP32,BF16,INT8")
    args = p.parse_args()
    args.build = os.path.abspath(args.build)
    net = TwoSites(args.world, args.site_mbit) if args.two_sites else Loopback(args.world)
    tmp = tempfile.mkdtemp(prefix="modelavg-streaming-bench.")
    try:
        for fragments in (int(f) for f in args.fragments.split(",")):
            for delay in (0, max(1, args.period // fragments // 2)):
                for payload in args.payloads.split(","):
                    name = f"f{fragments}-d{delay}-{payload.lower()}"
                    print(json.dumps(run(args, args.build, name, fragments, delay, payload, tmp,
                                         net)), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(net, TwoSites):
            net.close()


if __name__ == "__main__":
    main()
