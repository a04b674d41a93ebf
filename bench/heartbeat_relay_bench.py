#!/usr/bin/env python3
"""What the host's heartbeat relay costs, and saves: N Python processes of one host (as torchrun
starts them) connect to one job and beat for a while without averaging, first each on a stream
of its own, then through the relay (heartbeat_relay_dir). Prints one JSON line per mode: the
coordinator's CPU per beat and its open HostHeartbeatStreams/HeartbeatStreams, the CPU of the
process that serves the relay and the mean of the others, as a share of one core.

  python3 bench/heartbeat_relay_bench.py --coordinator_bin=build/server/modelavg-coordinator \\
      --python_dir=build/python --ranks=8 --seconds=10

Both modes run in the same invocation, one after the other, against the same coordinator: compare
them with each other, not with another machine's figures.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import modelavg

    def wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.01)

    options = dict(heartbeat_interval=float(os.environ["INTERVAL"]), join_timeout=120)
    if os.environ["RELAY_DIR"]:
        options["heartbeat_relay_dir"] = os.environ["RELAY_DIR"]
    client = modelavg.connect(os.environ["ADDR"], os.environ["JOB"],
                              rank=int(os.environ["RANK"]), **options)
    print("ready", flush=True)
    wait_for(os.environ["GO"])
    start = time.process_time()
    wait_for(os.environ["MEASURED"])
    print(json.dumps({"pid": os.getpid(), "cpu_s": time.process_time() - start}), flush=True)
    wait_for(os.environ["STOP"])
    client.leave("finished")
""")


def read_until(p, wanted):
    """The first line of p's stdout that `wanted` accepts (the package logs there too); None at
    its end."""
    for line in p.stdout:
        if wanted(line.strip()):
            return line.strip()
    return None


def proc_cpu_s(pid):
    """utime + stime of a process, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics(address):
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def open_streams(page, method):
    m = re.search(r'^modelavg_streams_open\{method="%s"\} (\S+)$' % method, page, re.M)
    return int(float(m.group(1))) if m else -1


def wait_for_file(path, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().strip():
            return open(path).read().strip()
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not appear within {timeout_s} s")


def run_mode(args, work, coord_pid, address, metrics_address, mode):
    sys.path.insert(0, args.python_dir)
    import modelavg
    job = f"relay-bench-{mode}"
    # A period far past the run: no step averages, only the heartbeats are measured.
    modelavg.create_job(job, args.ranks, "PERIODIC", period=10**9, coordinator=address)
    relay_dir = os.path.join(work, f"relay-{mode}") if mode == "relay" else ""
    flags = {name: os.path.join(work, f"{mode}.{name}") for name in ("go", "measured", "stop")}
    env = dict(os.environ, PYTHONPATH=args.python_dir, ADDR=address, JOB=job,
               INTERVAL=str(args.heartbeat_interval), RELAY_DIR=relay_dir, GO=flags["go"],
               MEASURED=flags["measured"], STOP=flags["stop"], OMP_NUM_THREADS="1")
    procs = []
    try:
        for r in range(args.ranks):
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER],
                                          env=dict(env, RANK=str(r)),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True,
                                          start_new_session=True))
        for p in procs:
            if read_until(p, lambda line: line == "ready") is None:
                p.kill()
                raise RuntimeError(f"a worker of mode {mode} did not connect: "
                                   f"{p.stderr.read()[-2000:]}")
        time.sleep(2.0)  # streams settled (and, with the relay, its server chosen)
        page = metrics(metrics_address)
        coord_start = proc_cpu_s(coord_pid)
        open(flags["go"], "w").close()
        time.sleep(args.seconds)
        open(flags["measured"], "w").close()
        coord_cpu = proc_cpu_s(coord_pid) - coord_start
        cpu = {}
        for p in procs:
            d = json.loads(read_until(p, lambda line: line.startswith('{"pid"')))
            cpu[d["pid"]] = d["cpu_s"]
        serving = 0
        if relay_dir:
            locks = [f for f in os.listdir(relay_dir) if f.endswith(".lock")]
            serving = int(open(os.path.join(relay_dir, locks[0])).read().strip() or 0)
        beats = args.ranks * args.seconds / args.heartbeat_interval
        others = [c for pid, c in cpu.items() if pid != serving]
        out = {
            "mode": mode, "ranks": args.ranks, "seconds": args.seconds,
            "heartbeat_interval_s": args.heartbeat_interval,
            "coordinator_cpu_us_per_beat": round(coord_cpu / beats * 1e6, 2),
            "coordinator_cores": round(coord_cpu / args.seconds, 4),
            "host_heartbeat_streams_open": open_streams(page, "HostHeartbeatStream"),
            "heartbeat_streams_open": open_streams(page, "HeartbeatStream"),
            "other_process_cores_mean": round(sum(others) / len(others) / args.seconds, 4),
        }
        if serving:
            out["relay_process_cores"] = round(cpu.get(serving, -1) / args.seconds, 4)
        print(json.dumps(out), flush=True)
    finally:
        open(flags["stop"], "w").close()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator_bin", required=True)
    parser.add_argument("--python_dir", required=True)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--heartbeat_interval", type=float, default=0.1)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="modelavg-relay-bench-")
    coord = None
    try:
        port_file = os.path.join(work, "port")
        metrics_file = os.path.join(work, "metrics.port")
        log = open(os.path.join(work, "coordinator.log"), "w")
        coord = subprocess.Popen([args.coordinator_bin, "--listen=127.0.0.1:0",
                                  f"--port_file={port_file}", "--metrics_listen=127.0.0.1:0",
                                  f"--metrics_port_file={metrics_file}", "--log_level=warn"],
                                 stdout=log, stderr=subprocess.STDOUT)
        address = wait_for_file(port_file)
        metrics_address = wait_for_file(metrics_file)
        for mode in ("own", "relay"):
            run_mode(args, work, coord.pid, address, metrics_address, mode)
    finally:
        if coord is not None:
            coord.send_signal(signal.SIGTERM)
            try:
                coord.wait(timeout=10)
            except subprocess.TimeoutExpired:
                coord.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
