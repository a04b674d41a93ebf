"""FSDP2 (``fully_shard``, DTensor parameters) inside each replica, modelavg across replicas,
against a reference in plain PyTorch at every step, on every rank.

Each configuration starts a coordinator and W processes (Gloo on CPU) on a 2-D ``DeviceMesh``
``["replicate", "shard"]`` of shape (W / S, S): rank r = replica * S + shard, the layout of a
modelavg job with ``replica_size=S``. Each replica trains its own copy of a small model with
``fully_shard`` over the mesh's ``"shard"`` dimension (its parameters are DTensors; each rank
holds its ``Shard(0)`` piece), on data of its own; the ``"replicate"`` dimension is modelavg's:
instead of HSDP's gradient all-reduce every step, modelavg averages the local shards, shard by
shard, on its schedule.

At every step each rank first gathers its replica's full model (``get_model_state_dict`` with
``full_state_dict=True``), then averages; the reference computes, from those full models alone,
what the step must produce — ``dist.all_reduce`` over the replicas of the chosen block divided
by their number, or for an outer (DiLoCo) level ``torch.optim.SGD`` on an anchor with the
replicas' mean pseudo-gradient — and each rank's local shard (``to_local()``) must equal its
``Shard(0)`` piece of that, with its storage unchanged (averaged in place, never a copy).

* ``fsdp2_w8_s2_diloco``: 4 replicas of 2 ranks in 2 "sites" of 2 replicas: the explicit
  ``HierarchicalModelAverager`` averages within a site every 2 steps and runs DiLoCo across
  sites (outer SGD lr 0.7, momentum 0.9, Nesterov) every 6.
* ``hsdp_w4_s2_dropin``: 2 replicas of 2, the drop-in ``PeriodicModelAverager`` with
  ``replica_size`` read from the mesh; each call also carries a plain parameter and a DTensor
  laid out as HSDP lays out its parameters, ``(Replicate(), Shard(0))`` over the whole 2-D mesh.

  pytest tests/python/fsdp2_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import traceback

import pytest

import modelavg_testing as mt

# name: (world, replica_size, levels [(period, group_size in ranks, outer or None)], steps, how)
CONFIGS = {
    "fsdp2_w8_s2_diloco": (8, 2, [(2, 4, None), (6, 8, (0.7, 0.9, True))], 14, "explicit"),
    "hsdp_w4_s2_dropin": (4, 2, [(2, 4, None)], 9, "dropin"),
}


def decide(levels, step):
    """PyTorch's hierarchical schedule (no warm-up): the last level whose period divides step."""
    for i in range(len(levels) - 1, -1, -1):
        if step % levels[i][0] == 0:
            return i
    return None


def block_ranks(rank, group_size, s):
    """The ranks that hold rank's shard in its block of group_size ranks."""
    first = rank // group_size * group_size
    return [r for r in range(first, first + group_size) if r % s == rank % s]


class Reference:
    """What an averaging step makes of the replicas' full models, in plain PyTorch."""

    def __init__(self, torch, dist, world, s, levels):
        self.torch, self.dist, self.levels = torch, dist, levels
        self.groups = {}  # (level, ranks) -> Gloo group; every rank creates every group
        for i, (_, g, _) in enumerate(levels):
            for first in range(0, world, g):
                for shard in range(s):
                    ranks = tuple(block_ranks(first + shard, g, s))
                    self.groups[(i, ranks)] = dist.new_group(list(ranks), backend="gloo")
        self.anchors, self.optimizers = {}, {}

    def mean(self, t, level, ranks):
        t = t.detach().clone()
        self.dist.all_reduce(t, group=self.groups[(level, tuple(ranks))])
        return t / len(ranks)

    def step(self, full, level, ranks):
        """full: name -> this replica's full tensor before the step; returns name -> after."""
        torch = self.torch
        outer = self.levels[level][2]
        with torch.no_grad():
            if outer is None or level not in self.anchors:
                out = {n: self.mean(t, level, ranks) for n, t in full.items()}
                if outer is not None:  # the outer level's first step: its anchor is the mean
                    self.anchors[level] = {n: torch.nn.Parameter(t.clone())
                                           for n, t in out.items()}
                    lr, momentum, nesterov = outer
                    self.optimizers[level] = torch.optim.SGD(
                        list(self.anchors[level].values()), lr=lr, momentum=momentum,
                        nesterov=nesterov)
                return out
            anchors = self.anchors[level]
            for n, a in anchors.items():
                a.grad = self.mean(a.detach() - full[n], level, ranks)
        self.optimizers[level].step()
        return {n: a.detach().clone() for n, a in self.anchors[level].items()}


def shard_piece(torch, full, s, shard):
    """Shard(0)'s piece of `full` for `shard` of s (torch.chunk's split; empty past the end)."""
    pieces = torch.chunk(full, s, dim=0)
    if shard < len(pieces):
        return pieces[shard]
    return full.new_empty((0,) + tuple(full.shape[1:]))


def check(torch, rank, step, what, got, want):
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"rank {rank} step {step}: {what} differs from the reference "
                             f"({tuple(got.shape)} vs {tuple(want.shape)}, {diff})")


def run_rank(rank, name, config, address, store_port, python_dir, out_queue):
    try:
        world, s, levels, steps, how = config
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Replicate, Shard
        import modelavg
        mt.join_rank_group(torch, dist, store_port, rank, world)
        mesh = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
        replica, shard = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
        if (replica, shard) != (rank // s, rank % s):
            raise AssertionError(f"rank {rank}: mesh coordinates {(replica, shard)}")
        reference = Reference(torch, dist, world, s, levels)

        torch.manual_seed(100 + replica)  # the replicas start apart; averaging brings them in
        model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(),
                                    torch.nn.Linear(9, 1))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        params = dict(model.named_parameters())
        if not all(isinstance(p, DTensor) for p in params.values()):
            raise AssertionError(f"rank {rank}: fully_shard left non-DTensor parameters")
        extra = {}
        if how == "dropin":
            # Beside FSDP2's: a plain parameter, and HSDP's layout over the whole 2-D mesh
            # (replicated across replicas, which local SGD lets drift apart between averagings).
            g = torch.Generator().manual_seed(7 + replica)
            plain = torch.nn.Parameter(torch.randn(5, generator=g))
            full = torch.randn(7, 3, generator=g)
            hsdp = torch.nn.Parameter(DTensor.from_local(
                shard_piece(torch, full, s, shard).clone(), mesh, [Replicate(), Shard(0)],
                run_check=False, shape=full.shape, stride=full.stride()))
            for p in (plain, hsdp):
                p.grad = torch.zeros_like(p)
            extra = {"plain": plain, "hsdp": hsdp}
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)

        job_id = name.replace("_", "-")
        if how == "dropin":
            import modelavg.torch
            os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": job_id,
                               "RANK": str(rank), "WORLD_SIZE": str(world)})
            modelavg.torch.set_options(replica_size=mesh["shard"].size())
            averager = modelavg.torch.PeriodicModelAverager(period=levels[0][0])
        else:
            if rank == 0:
                job_levels = [(p, g) if o is None else
                              modelavg.Level(p, g, outer=modelavg.OuterSGD(
                                  o[0], momentum=o[1], nesterov=o[2])) for p, g, o in levels]
                modelavg.create_job(job_id, world, "HIERARCHICAL", job_levels, replica_size=s,
                                    coordinator=address)
            averager = modelavg.HierarchicalModelAverager(
                mt.connect_rank(modelavg, address, job_id, rank))
        client = averager.client
        if (client.replica_size, client.replica, client.shard) != (s, replica, shard):
            raise AssertionError(f"rank {rank}: client says replica_size {client.replica_size},"
                                 f" replica {client.replica}, shard {client.shard}")

        full_opts = StateDictOptions(full_state_dict=True)
        averaged = 0
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * replica + 10 * step + shard)
            x = torch.randn(8, 6, generator=g)
            y = torch.sin(x.sum(dim=1, keepdim=True))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            with torch.no_grad():  # the extra parameters' own local step
                for i, p in enumerate(extra.values()):
                    local = p.to_local() if isinstance(p, DTensor) else p
                    local.add_(0.1 * (replica + 1) * (step + 1 + i))
            # The replica's full model before the step (a collective over the replica's ranks).
            full = {n: t.detach().clone() for n, t in
                    get_model_state_dict(model, options=full_opts).items()}
            full.update({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                         for n, p in extra.items()})
            everything = dict(params, **extra)
            storages = {n: (p.to_local() if isinstance(p, DTensor) else p).data_ptr()
                        for n, p in everything.items()}
            decision = averager.average_parameters(list(everything.values()))
            level = decide(levels, step)
            if level is None:
                if decision.average:
                    raise AssertionError(f"rank {rank} step {step}: averaged, the rule skips")
                want = full
            else:
                ranks = block_ranks(rank, levels[level][1], s)
                if not decision.average or decision.level != level or \
                        list(decision.ranks) != ranks:
                    raise AssertionError(f"rank {rank} step {step}: modelavg {decision}, the "
                                         f"rule level {level} ranks {ranks}")
                want = reference.step(full, level, ranks)
                averaged += 1
            for n, p in everything.items():
                local = p.to_local() if isinstance(p, DTensor) else p
                if local.data_ptr() != storages[n]:
                    raise AssertionError(f"rank {rank} step {step}: {n} moved to new storage")
                if isinstance(p, DTensor):
                    check(torch, rank, step, f"{n}'s local shard", local.detach(),
                          shard_piece(torch, want[n], s, shard))
                else:
                    check(torch, rank, step, n, local.detach(), want[n])
        dist.barrier()
        dist.destroy_process_group()
        client.leave()
        out_queue.put((rank, averaged, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def run(name, args):
    config = CONFIGS[name]
    world = config[0]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin,
                                     extra_flags=["--default_heartbeat_timeout_ms=15000"])
        done = mt.run_world(ctx, world, run_rank, name, config, coordinator, args.python_dir,
                            args.timeout_s)
    print(f"PASS {name}: {world} ranks in replicas of {config[1]} (FSDP2 over the mesh's shard "
          f"dimension): every local shard equals the reference's piece at every step "
          f"({done[0]} averaging steps), in place")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2(name, suite_args):
    run(name, suite_args)
