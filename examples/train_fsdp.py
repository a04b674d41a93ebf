#!/usr/bin/python3
"""Train a model sharded inside each replica (FSDP) with modelavg averaging across replicas.

Four processes form two replicas of two ranks (``replica_size=2``: ranks 0-1 are replica 0,
ranks 2-3 replica 1; rank r holds shard r % 2). Inside a replica the model is sharded over its
two ranks and trained with data parallelism over them, as FSDP does: each rank keeps one flat
shard of the parameters, gathers the whole model for the forward and backward pass over its
replica's process group, and steps the optimizer on its shard. Across replicas nothing is
exchanged but modelavg's averaging: every 4 steps, and the two replicas' shards average shard by
shard (rank 0 with rank 2, rank 1 with rank 3; docs/sharded.md). The modelavg lines are the
drop-in averager, ``MODELAVG_REPLICA_SIZE`` (or ``modelavg.torch.set_options(replica_size=2)``),
and passing the averager the tensors this rank holds.

Where the installed PyTorch runs FullyShardedDataParallel on CPU (2.1 or later), the replica is
FSDP itself (``use_orig_params=False``: ``model.parameters()`` are FSDP's flat parameters, this
rank's shard); elsewhere (Debian's 1.13 cannot) the same sharding written out here, about thirty
lines. ``--sharding=fsdp`` or ``--sharding=by_hand`` picks one.

Run it end to end (starts a coordinator on 127.0.0.1 and four workers, then stops everything):

    PYTHONPATH=build/python python3 examples/train_fsdp.py

Or start the workers yourself against a running coordinator (torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; two nodes of two processes are two replicas):

    MODELAVG_COORDINATOR=host:50051 MODELAVG_JOB=train-fsdp MODELAVG_REPLICA_SIZE=2 \\
        torchrun --nnodes=2 --nproc_per_node=2 ... examples/train_fsdp.py --worker

Each worker prints its loss; the launcher checks that, after the last step (an averaging step),
both replicas hold the same model, shard by shard.
"""

import argparse
import json
import os
import subprocess
import sys

WORLD = 4
REPLICA_SIZE = 2
PERIOD = 4  # steps between averagings across the replicas


def fsdp_runs_on_cpu():
    try:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    except Exception:  # Debian's 1.13 fails to import it on Python 3.11
        return False
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 1)


class ShardedByHand:
    """FSDP's sharding written out: one flat parameter per replica, split into replica_size
    shards; this rank keeps `shard` and gathers the rest for each pass."""

    def __init__(self, torch, dist, model, group, replica_size, shard):
        self.torch, self.dist, self.model, self.group = torch, dist, model, group
        self.s, self.shard = replica_size, shard
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        self.numel = flat.numel()
        self.chunk = -(-self.numel // replica_size)  # padded, as FSDP pads its flat parameter
        padded = torch.zeros(self.chunk * replica_size)
        padded[:self.numel] = flat
        self.local = torch.nn.Parameter(padded[shard * self.chunk:(shard + 1) * self.chunk]
                                        .clone())

    def parameters(self):
        """What this rank holds: its shard of the flat parameter."""
        return [self.local]

    def loss_and_grad(self, loss_of):
        torch, dist = self.torch, self.dist
        parts = [torch.empty(self.chunk) for _ in range(self.s)]
        dist.all_gather(parts, self.local.detach(), group=self.group)  # the whole model
        flat = torch.cat(parts)[:self.numel]
        offset = 0
        for p in self.model.parameters():
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            p.grad = None
        loss = loss_of(self.model)
        loss.backward()
        grad = torch.zeros(self.chunk * self.s)
        grad[:self.numel] = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        dist.all_reduce(grad, group=self.group)  # the replica's data-parallel mean
        self.local.grad = grad[self.shard * self.chunk:(self.shard + 1) * self.chunk] / self.s
        return loss


def worker(args):
    import torch
    import torch.distributed as dist
    from modelavg.torch import PeriodicModelAverager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = int(os.environ.get("MODELAVG_REPLICA_SIZE", REPLICA_SIZE))
    replica, shard = rank // s, rank % s
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Every rank creates every replica's group (torch.distributed's rule); it uses its own.
    groups = [dist.new_group(list(range(k * s, k * s + s))) for k in range(world // s)]
    group = groups[replica]

    torch.manual_seed(0)  # the same initial model in every replica
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    sharding = args.sharding
    if sharding == "auto":
        sharding = "fsdp" if fsdp_runs_on_cpu() else "by_hand"
    if sharding == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model, process_group=group, device_id=torch.device("cpu"),
                     use_orig_params=False)
        held = list(model.parameters())  # FSDP's flat parameters: this rank's shard

        def loss_and_grad(loss_of):
            loss = loss_of(model)
            loss.backward()
            return loss
    else:
        sharded = ShardedByHand(torch, dist, model, group, s, shard)
        held = sharded.parameters()
        loss_and_grad = sharded.loss_and_grad
    optimizer = torch.optim.SGD(held, lr=0.05, momentum=0.9)

    # Each replica trains on its own data: y = sin(x . w) + noise; its ranks split each batch.
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, generator=g)
    g.manual_seed(100 + rank)
    x = torch.randn(2048, 16, generator=g)
    y = torch.sin(x @ w_true / 4).unsqueeze(1) + 0.05 * torch.randn(2048, 1, generator=g)

    averager = PeriodicModelAverager(period=PERIOD)
    losses = []
    for step in range(args.steps):
        batch = slice((step * 32) % 2048, (step * 32) % 2048 + 32)
        optimizer.zero_grad()
        loss = loss_and_grad(
            lambda m: torch.nn.functional.mse_loss(m(x[batch]), y[batch]))
        optimizer.step()
        # Across replicas: this rank's shard with the same shard of the other replica.
        decision = averager.average_parameters(held)
        losses.append(loss.item())
        if step % args.log_every == 0:
            print(f"[rank {rank}, replica {replica}, shard {shard}] step {step:4d}  loss "
                  f"{loss.item():.4f}  {decision.action} {list(decision.ranks)}", flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in held)
    print(json.dumps({"rank": rank, "replica": replica, "shard": shard, "sharding": sharding,
                      "first_loss": sum(losses[:8]) / 8, "last_loss": sum(losses[-8:]) / 8,
                      "shard_checksum": round(checksum, 6)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args):
    """Starts a coordinator on 127.0.0.1 and WORLD workers of this script; stops them all."""
    from local_launch import LocalCoordinator, find_coordinator, gather
    with LocalCoordinator(find_coordinator(args.coordinator_bin, "train_fsdp"),
                          "train-fsdp") as coordinator:
        print(f"coordinator at {coordinator.address}; {WORLD} workers in replicas of "
              f"{REPLICA_SIZE}", flush=True)
        master_port = str(free_port())
        workers = []
        for rank in range(WORLD):
            env = dict(os.environ, MODELAVG_COORDINATOR=coordinator.address,
                       MODELAVG_JOB="train-fsdp", MODELAVG_REPLICA_SIZE=str(REPLICA_SIZE),
                       RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=master_port,
                       GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            workers.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", f"--steps={args.steps}",
                 f"--log_every={args.log_every}", f"--sharding={args.sharding}"],
                env=env, stdout=subprocess.PIPE, text=True))
        summaries, failed = gather(workers, args.timeout_s)
        if failed or len(summaries) != WORLD:
            print("train_fsdp: a worker failed (its error is above); the coordinator's log:\n"
                  + coordinator.log_tail(), file=sys.stderr)
            return 1
    # The last step averaged: each shard is the same in both replicas.
    by_shard = {}
    for s in summaries:
        by_shard.setdefault(s["shard"], set()).add(s["shard_checksum"])
    same = all(len(v) == 1 for v in by_shard.values())
    learned = all(s["last_loss"] < s["first_loss"] for s in summaries)
    print(f"both replicas ended with the same model, shard by shard: {same}; every rank's loss "
          f"went down: {learned}")
    return 0 if same and learned else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true",
                   help="run one worker (RANK, WORLD_SIZE, MASTER_*, MODELAVG_* from the "
                        "environment)")
    p.add_argument("--steps", type=int, default=121,
                   help="steps per worker (121: the last step, 120, averages across replicas)")
    p.add_argument("--log_every", type=int, default=40)
    p.add_argument("--sharding", choices=["auto", "fsdp", "by_hand"], default="auto")
    p.add_argument("--coordinator_bin", help="default: build/server/modelavg-coordinator")
    p.add_argument("--timeout_s", type=float, default=300)
    args = p.parse_args()
    if args.worker or "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
