#!/usr/bin/env python3
"""Launching like PyTorch: a 2-process drop-in job started by a torchrun.

  * ``python -m modelavg.run --standalone --nproc_per_node=2 worker.py`` (modelavg's torchrun,
    which works around Debian 12's torchrun bug on Python 3.11 and is torchrun unchanged on
    PyTorch 2.x);
  * the installed ``torchrun`` itself: plain on a PyTorch without the bug; on one with it, with
    the documented workaround ``--redirects=9:1 --tee=9:1``.
Each worker averages with modelavg.torch's PeriodicModelAverager(period=2, warmup_steps=1) from
the environment torchrun gives it (RANK, WORLD_SIZE) for 6 steps; every rank, every step is
checked against a naive re-statement of PyTorch's rule. The first job runs with
$MODELAVG_HEARTBEAT_RELAY_DIR: its two processes carry their beats through the host's relay,
so the coordinator sees HostHeartbeatStreams only, and no stream of a rank's own.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

WORKER = mt.dropin_worker(
    # One write per line: both workers share torchrun's stdout.
    '    os.write(1, (json.dumps({"rank": rank, "step": step, "value": p[0].item()}) + "\\n")'
    '.encode())',
    checks='assert os.environ["WORLD_SIZE"] == "2", os.environ["WORLD_SIZE"]')


def torch_has_the_bug():
    from torch.distributed.elastic.multiprocessing import api
    return api.Std.from_str("0") is not api.Std.NONE


def rpc_totals(metrics_port_file):
    """modelavg_rpcs_total summed over codes, by method, from the coordinator's /metrics."""
    import urllib.request
    address = open(metrics_port_file).read().strip()
    page = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    totals = {}
    for m in re.finditer(r'^modelavg_rpcs_total\{code="[A-Z_]+",method="(\w+)"\} (\S+)$', page,
                         re.M):
        totals[m.group(1)] = totals.get(m.group(1), 0) + float(m.group(2))
    return totals


def run_job(group, coord, name, launcher, work, python_dir, relay_dir=None):
    script = os.path.join(work, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    env = dict(os.environ, MODELAVG_COORDINATOR=coord.address, MODELAVG_JOB=name,
               PYTHONPATH=python_dir, OMP_NUM_THREADS="1",
               # torch.distributed.run keeps its torchelastic_* folder in TMPDIR: ours, removed.
               TMPDIR=work)
    env.pop("MODELAVG_HEARTBEAT_RELAY_DIR", None)
    if relay_dir is not None:
        env["MODELAVG_HEARTBEAT_RELAY_DIR"] = relay_dir
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = group.start(launcher + ["--standalone", "--nproc_per_node=2", script], name, env=env)
    results = mt.wait_all([proc], timeout_s=240)
    rc, out, err = results[name]
    if rc != 0:
        mt.fail(f"{' '.join(launcher)} exited {rc}:\n{out[-2000:]}\n{err[-3000:]}")
    got = {}
    for obj in re.findall(r"\{[^{}]*\}", out):
        d = json.loads(obj)
        got[(d["rank"], d["step"])] = d["value"]
    want = {(r, s): v for r, values in enumerate(mt.dropin_expected(2))
            for s, v in enumerate(values)}
    if set(got) != set(want):
        mt.fail(f"{' '.join(launcher)}: printed steps {sorted(got)}, expected {sorted(want)}\n"
                f"{out[-2000:]}\n{err[-2000:]}")
    for key, w in want.items():
        if abs(got[key] - w) > 1e-6:
            mt.fail(f"{' '.join(launcher)}: rank {key[0]} step {key[1]}: {got[key]}, expected {w}")
    print(f"{' '.join(os.path.basename(a) for a in launcher)}: 2 ranks x 6 steps as PyTorch's rule")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--python_dir", required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.python_dir)
    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-torchrun-")
        metrics_port_file = os.path.join(work, "metrics.port")
        coord = mt.Coordinator(group, args.coordinator, workdir=work,
                               extra_flags=["--metrics_listen=127.0.0.1:0",
                                            f"--metrics_port_file={metrics_port_file}"])
        relay_dir = os.path.join(work, "relay")
        run_job(group, coord, "via-modelavg-run", [sys.executable, "-m", "modelavg.run"],
                work, args.python_dir, relay_dir=relay_dir)
        # Through the relay: HostHeartbeatStreams only (the one that served, and the one that
        # took over when the first process finished), no HeartbeatStream of a rank's own.
        totals = rpc_totals(metrics_port_file)
        locks = [f for f in os.listdir(relay_dir) if f.endswith(".lock")]
        if (totals.get("HeartbeatStream", 0) != 0 or totals.get("Heartbeat", 0) != 0
                or not 1 <= totals.get("HostHeartbeatStream", 0) <= 2 or len(locks) != 1):
            mt.fail(f"with MODELAVG_HEARTBEAT_RELAY_DIR: RPCs {totals}, relay dir {locks}")
        print(f"via the host's heartbeat relay: {int(totals['HostHeartbeatStream'])} "
              "HostHeartbeatStream(s), no stream of a rank's own")
        # The torchrun of this Python's PyTorch (a venv's bin/), else the one on PATH.
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or \
            shutil.which("torchrun")
        passed = 2
        if torchrun is None:
            print("no torchrun on PATH: only python3 -m modelavg.run was checked")
            passed = 1
        elif torch_has_the_bug():
            print("this torch has the Std.from_str bug (Python 3.11, PyTorch 1.13): torchrun "
                  "with --redirects=9:1 --tee=9:1")
            run_job(group, coord, "via-torchrun-workaround",
                    [torchrun, "--redirects=9:1", "--tee=9:1"], work, args.python_dir)
        else:
            run_job(group, coord, "via-torchrun", [torchrun], work, args.python_dir)
        coord.stop()
    print(f"torchrun: {passed} passed, 0 failed")


if __name__ == "__main__":
    main()
