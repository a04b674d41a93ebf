"""What the benchmarks' drivers (bench/lm/run.py, bench/peers/run.py) share: the model's and the
inner optimizer's arguments that they take and hand on to bench/lm/worker.py (one definition, so
that both benchmarks train the same work by default), and the wait for a run's workers."""

import os
import signal
import subprocess
import time


def add_model_args(p):
    """Adds --d_model, --layers, --context, --batch and --lr to the argparse parser `p`."""
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner optimizer's (AdamW)")


def worker_flags(args):
    """Those arguments as bench/lm/worker.py's flags."""
    return [f"--d_model={args.d_model}", f"--layers={args.layers}", f"--context={args.context}",
            f"--batch={args.batch}", f"--lr={args.lr}"]


def wait_workers(procs, deadline, log_of, skip=()):
    """Waits for each worker process (their ranks: their indices in `procs`) until the monotonic
    `deadline`, killing the process group of one still running then; returns [(rank, exit code
    or "timeout", the last 3,000 characters of its log)] for each that failed. `log_of(rank)`:
    its log file's path; `skip`: ranks not waited for."""
    failed = []
    for rank, proc in enumerate(procs):
        if rank in skip:
            continue
        try:
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = "timeout"
        if rc != 0:
            with open(log_of(rank)) as f:
                failed.append((rank, rc, f.read()[-3000:]))
    return failed
