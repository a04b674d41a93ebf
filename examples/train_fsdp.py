#!/usr/bin/python3
"""Train a model sharded inside each replica (FSDP2) with modelavg averaging across replicas.

Eight processes on a 2-D ``DeviceMesh`` ``["replicate", "shard"]`` of shape (4, 2): four replicas
of two ranks (``replica_size`` = the mesh's shard dimension, 2: ranks 0-1 are replica 0, ...; rank
r holds shard r % 2). Inside a replica PyTorch's FSDP2 (``fully_shard`` over the mesh's
``"shard"`` dimension) shards the model: each parameter is a DTensor of which each rank holds one
``Shard(0)`` piece, gathered for the forward and backward pass, its gradient reduce-scattered.
Across replicas the mesh's ``"replicate"`` dimension is modelavg's, in place of HSDP's gradient
all-reduce on every step, at two levels as two "sites" of two replicas would: every 4 steps the
two replicas of a site average, and every 12 steps the sites run a DiLoCo outer step (outer SGD,
lr 0.7, momentum 0.9, Nesterov) over all four, shard by shard (docs/sharded.md). The modelavg
lines are the drop-in averager, ``modelavg.torch.set_options(replica_size=...)`` from the mesh,
and passing the averager ``model.parameters()`` as they are: modelavg averages each DTensor's
local shard in place.

Where the installed PyTorch has no ``fully_shard`` (before 2.6; Debian's 1.13), the same
sharding written out here, about thirty lines, stands in: ``--sharding=by_hand`` picks it.

Run it end to end (starts a coordinator on 127.0.0.1 and eight workers, then stops everything):

    PYTHONPATH=build/python .venv/bin/python examples/train_fsdp.py

Or start the workers yourself against a running coordinator (torchrun sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; four nodes of two processes are four replicas):

    MODELAVG_COORDINATOR=host:50051 MODELAVG_JOB=train-fsdp \\
        torchrun --nnodes=4 --nproc_per_node=2 ... examples/train_fsdp.py --worker

Each worker prints its loss; the launcher checks that, after the last step (an outer step over
all four replicas), every replica holds the same model, shard by shard.
"""

import argparse
import json
import os
import subprocess
import sys

WORLD = 8
REPLICA_SIZE = 2  # the mesh's shard dimension
SITE_PERIOD = 4  # steps between averagings of the replicas of a site
OUTER_PERIOD = 12  # steps between DiLoCo outer steps across the sites


def fsdp2_available():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception:  # none before PyTorch 2.6 (Debian's 1.13 fails to import FSDP at all)
        return False
    return True


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
    import modelavg
    import modelavg.torch
    from modelavg.torch import HierarchicalModelAverager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = int(os.environ.get("MODELAVG_REPLICA_SIZE", REPLICA_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sharding = args.sharding
    if sharding == "auto":
        sharding = "fsdp2" if fsdp2_available() else "by_hand"

    torch.manual_seed(0)  # the same initial model in every replica
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    if sharding == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
        replica, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
        s = mesh["shard"].size()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        held = list(model.parameters())  # DTensors: this rank holds a Shard(0) piece of each

        def loss_and_grad(loss_of):
            loss = loss_of(model)
            loss.backward()
            return loss
    else:
        replica, shard = rank // s, rank % s
        # Every rank creates every replica's group (torch.distributed's rule); it uses its own.
        groups = [dist.new_group(list(range(k * s, k * s + s))) for k in range(world // s)]
        sharded = ShardedByHand(torch, dist, model, groups[replica], s, shard)
        held = sharded.parameters()
        loss_and_grad = sharded.loss_and_grad
    optimizer = torch.optim.SGD(held, lr=0.05, momentum=0.9)

    # Each replica trains on its own data: y = sin(x . w) + noise; its ranks split each batch.
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, generator=g)
    g.manual_seed(100 + rank)
    x = torch.randn(2048, 16, generator=g)
    y = torch.sin(x @ w_true / 4).unsqueeze(1) + 0.05 * torch.randn(2048, 1, generator=g)

    # Across replicas: a site's two replicas (2 * s ranks) every SITE_PERIOD steps; all of them,
    # with DiLoCo's outer step, every OUTER_PERIOD steps. Each rank averages its shard with the
    # same shard of the other replicas.
    modelavg.torch.set_options(replica_size=s)
    averager = HierarchicalModelAverager(
        period_group_size_dict={SITE_PERIOD: 2 * s, OUTER_PERIOD: world},
        outer={OUTER_PERIOD: modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)})
    losses = []
    for step in range(args.steps):
        batch = slice((step * 32) % 2048, (step * 32) % 2048 + 32)
        optimizer.zero_grad()
        loss = loss_and_grad(
            lambda m: torch.nn.functional.mse_loss(m(x[batch]), y[batch]))
        optimizer.step()
        decision = averager.average_parameters(held)
        losses.append(loss.item())
        if step % args.log_every == 0:
            print(f"[rank {rank}, replica {replica}, shard {shard}] step {step:4d}  loss "
                  f"{loss.item():.4f}  {decision.action} {list(decision.ranks)}", flush=True)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in held]
    checksum = sum(float(t.detach().double().sum()) for t in local)
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
                       MODELAVG_JOB="train-fsdp",
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
    # The last step was an outer step over all replicas: each shard is the same in all of them.
    by_shard = {}
    for s in summaries:
        by_shard.setdefault(s["shard"], set()).add(s["shard_checksum"])
    same = all(len(v) == 1 for v in by_shard.values())
    learned = all(s["last_loss"] < s["first_loss"] for s in summaries)
    print(f"all {WORLD // REPLICA_SIZE} replicas ended with the same model, shard by shard "
          f"({summaries[0]['sharding']}): {same}; every rank's loss "
          f"went down: {learned}")
    return 0 if same and learned else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true",
                   help="run one worker (RANK, WORLD_SIZE, MASTER_*, MODELAVG_* from the "
                        "environment)")
    p.add_argument("--steps", type=int, default=121,
                   help="steps per worker (121: the last step, 120, is an outer step)")
    p.add_argument("--log_every", type=int, default=40)
    p.add_argument("--sharding", choices=["auto", "fsdp2", "by_hand"], default="auto",
                   help="auto: FSDP2 (fully_shard) where this PyTorch has it, else by_hand")
    p.add_argument("--coordinator_bin", help="default: build/server/modelavg-coordinator")
    p.add_argument("--timeout_s", type=float, default=300)
    args = p.parse_args()
    if args.worker or "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
