#!/usr/bin/python3
"""Train a PyTorch model with 4 processes and hierarchical model averaging through modelavg.

Each worker is an ordinary PyTorch trainer (torch.nn model, optimizer, DataLoader over its own
shard of a synthetic regression task). The only modelavg line is the import of the drop-in
HierarchicalModelAverager: pairs of workers average every 4 steps, all four every 16, after 8
warm-up steps.

Run it end to end (starts a coordinator on 127.0.0.1 and four workers, then stops everything):

    PYTHONPATH=build/python python3 examples/train_torch.py

(`bash examples/run_train_torch.sh` also installs the packages and builds first.) Or start the
workers yourself, e.g. with torchrun, against a running coordinator:

    MODELAVG_COORDINATOR=127.0.0.1:50051 MODELAVG_JOB=train-torch \\
        torchrun --nproc_per_node=4 examples/train_torch.py --worker

Each worker prints its loss; the launcher prints one summary line per worker and a final check
that the workers ended with the same parameters (the last step is an all-worker averaging step).

The launcher then trains again with DiLoCo on the all-worker level (``--diloco`` in a worker: the
drop-in's ``outer`` keyword, ``modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)``; see
docs/diloco.md) and prints both runs' mean final loss side by side.
"""

import argparse
import collections
import json
import os
import subprocess
import sys

WORLD = 4
LEVELS = collections.OrderedDict([(4, 2), (16, 4)])  # period -> group size, PyTorch's order
WARMUP = 8


def worker(args):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from modelavg.torch import HierarchicalModelAverager  # the only modelavg line

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)  # the same initial model everywhere
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # The task: y = sin(x . w) + noise; every rank draws its own shard.
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, generator=g)
    g.manual_seed(100 + rank)
    x = torch.randn(4096, 16, generator=g)
    y = torch.sin(x @ w_true / 4).unsqueeze(1) + 0.05 * torch.randn(4096, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(rank))

    outer = None
    if args.diloco:
        import modelavg
        outer = {16: modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)}  # the all-four level
    averager = HierarchicalModelAverager(period_group_size_dict=LEVELS, warmup_steps=WARMUP,
                                         outer=outer)
    averagings = collections.Counter()
    step, losses = 0, []
    while step < args.steps:
        for xb, yb in loader:
            if step >= args.steps:
                break
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            decision = averager.average_parameters(model.parameters())
            if decision.average:
                averagings[f"groups of {len(decision.ranks)}"] += 1
            losses.append(loss.item())
            if step % args.log_every == 0:
                print(f"[rank {rank}] step {step:4d}  loss {loss.item():.4f}  {decision.action}",
                      flush=True)
            step += 1
    with torch.no_grad():
        full = torch.nn.functional.mse_loss(model(x), y).item()
        checksum = sum(float(p.double().sum()) for p in model.parameters())
    print(json.dumps({"rank": rank, "steps": step, "first_loss": sum(losses[:10]) / 10,
                      "final_loss": full, "averagings": dict(averagings),
                      "param_checksum": round(checksum, 6)}), flush=True)


def launch(args):
    """Starts a coordinator on 127.0.0.1 and WORLD workers of this script; stops them all."""
    from local_launch import LocalCoordinator, find_coordinator
    with LocalCoordinator(find_coordinator(args.coordinator_bin, "train_torch"),
                          "train-torch") as coordinator:
        final = {}
        for diloco in (False, True):
            name = "DiLoCo (outer SGD on the all-four level)" if diloco else "plain averaging"
            print(f"coordinator at {coordinator.address}; starting {WORLD} workers: {name}",
                  flush=True)
            code, loss = run_job(args, coordinator, diloco)
            if code != 0:
                return code
            final[name] = loss
        print("mean final loss: " + ", ".join(f"{k} {v:.5f}" for k, v in final.items()))
        return 0


def run_job(args, coordinator, diloco):
    """One job of WORLD workers; (exit code, mean final loss)."""
    from local_launch import gather
    workers = []
    for rank in range(WORLD):
        env = dict(os.environ, MODELAVG_COORDINATOR=coordinator.address,
                   MODELAVG_JOB="train-torch-diloco" if diloco else "train-torch",
                   RANK=str(rank), WORLD_SIZE=str(WORLD))
        workers.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", f"--steps={args.steps}",
             f"--log_every={args.log_every}"] + (["--diloco"] if diloco else []),
            env=env, stdout=subprocess.PIPE, text=True))
    summaries, failed = gather(workers, args.timeout_s)
    if failed or len(summaries) != WORLD:
        print("train_torch: a worker failed (its error is above); the coordinator's log:\n"
              + coordinator.log_tail(), file=sys.stderr)
        return 1, 0.0
    same = len({s["param_checksum"] for s in summaries}) == 1
    print(f"all {WORLD} workers ended with the same parameters: {same}")
    return (0 if same else 1), sum(s["final_loss"] for s in summaries) / len(summaries)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true",
                   help="run one worker (RANK, WORLD_SIZE, MODELAVG_* from the environment)")
    p.add_argument("--steps", type=int, default=161,
                   help="steps per worker (161: step 160 averages over all four)")
    p.add_argument("--log_every", type=int, default=40)
    p.add_argument("--diloco", action="store_true",
                   help="(worker) DiLoCo on the all-four level: outer SGD lr 0.7, momentum 0.9, "
                        "nesterov")
    p.add_argument("--coordinator_bin", help="default: build/server/modelavg-coordinator")
    p.add_argument("--timeout_s", type=float, default=600)
    args = p.parse_args()
    if args.worker or "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
