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
* ``elastic_w6_s2_heal``: 3 replicas of 2 in an elastic job (``min_world_size`` 4), averaging
  every 2 steps. Rank 3 is killed (SIGKILL) at step 10: its mate gets ``ReplicaLostError``, the
  other two replicas go on averaging without replica 1; then two new processes, started without
  a rank, form a new FSDP2 replica and are admitted whole; at the admission step each new rank's
  local shards are overwritten in place with the live replicas' average of its own shard, and
  from then on all three average again. Here the replicas' full models travel through files
  (the dead rank's world can make no new process group), one per replica and step.

  pytest tests/python/fsdp2_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import queue
import signal
import time
import traceback

import pytest

import modelavg_testing as mt

# name: (world, replica_size, levels [(period, group_size in ranks, outer or None)], steps, how)
CONFIGS = {
    "fsdp2_w8_s2_diloco": (8, 2, [(2, 4, None), (6, 8, (0.7, 0.9, True))], 14, "explicit"),
    "hsdp_w4_s2_dropin": (4, 2, [(2, 4, None)], 9, "dropin"),
    "elastic_w6_s2_heal": (6, 2, [(2, 6, None)], 0, "elastic"),
}
KILL_RANK, KILL_STEP = 3, 10  # a rank of replica 1, killed before its call at an averaging step
TAIL = 6                      # everyone stops at the admission step + TAIL
MAX_STEPS = 3000              # the survivors' bound if no replacement ever comes


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


def sharded_model(torch, fully_shard, shard_mesh, seed):
    """The test's model, FSDP2-sharded over `shard_mesh` (each Linear, then the root)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def run_elastic_rank(rank, name, config, address, store_port, python_dir, out_queue, role,
                     models_dir):
    """A member (role "member", rank given) or a replacement's rank (role "replacement": no
    rank; store_port is the new replica's own store). Each rank writing shard 0 of its replica
    saves the replica's full model before every step (<models_dir>/<step>_<replica>.pt); after
    each averaging step every rank checks its local shards against the mean of the files of the
    replicas that averaged."""
    try:
        world, s, levels, _, _ = config
        import time
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import modelavg
        job_id = name.replace("_", "-")
        if role == "member":
            mt.join_rank_group(torch, dist, store_port, rank, world)
            mesh = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
            shard_mesh = mesh["shard"]
            client = mt.connect_rank(modelavg, address, job_id, rank)
        else:
            # A new replica: its ranks learn from the coordinator which rank and shard they are,
            # then form their own Gloo group and FSDP2 mesh, shard = rank within it.
            client = modelavg.connect(address, job_id, join_timeout=120)
            mt.join_rank_group(torch, dist, store_port, client.shard, s)
            shard_mesh = init_device_mesh("cpu", (s,), mesh_dim_names=("shard",))
        rank, replica, shard = client.rank, client.replica, client.shard
        averager = modelavg.PeriodicModelAverager(client)
        model = sharded_model(torch, fully_shard, shard_mesh,
                              seed=100 + replica if role == "member" else 999)
        params = dict(model.named_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        full_opts = StateDictOptions(full_state_dict=True)
        period = levels[0][0]

        def model_file(step, k):
            return os.path.join(models_dir, f"{step}_{k}.pt")

        def replica_model(step, k):
            deadline = time.monotonic() + 120
            while not os.path.exists(model_file(step, k)):
                if time.monotonic() > deadline:
                    raise AssertionError(f"rank {rank}: no model of replica {k} at step {step}")
                time.sleep(0.01)
            return torch.load(model_file(step, k))

        end, checked, admission = None, 0, client.admission_step

        def one_step(step):
            nonlocal end, admission
            g = torch.Generator().manual_seed(1000 * replica + 10 * step + shard)
            x = torch.randn(8, 6, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x.sum(1, keepdim=True)))
            loss.backward()
            opt.step()
            full = {n: t.detach().clone() for n, t in
                    get_model_state_dict(model, options=full_opts).items()}
            if shard == 0:
                tmp = model_file(step, replica) + f".{rank}.tmp"
                torch.save(full, tmp)
                os.replace(tmp, model_file(step, replica))
            if role == "member" and rank == KILL_RANK and step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            storages = {n: p.to_local().data_ptr() for n, p in params.items()}
            decision = averager.average_parameters(model.parameters())
            if joining := list(decision.joining):
                if end is None:
                    end = step + TAIL
                    admission = step
            if step % period != 0:
                if decision.average:
                    raise AssertionError(f"rank {rank} step {step}: averaged, the rule skips")
                time.sleep(0.02)  # paced, so that the replacement comes within MAX_STEPS
                return
            contributors = sorted({r // s for r in decision.members} -
                                  {r // s for r in joining})
            live = [0, 1, 2] if step < KILL_STEP else [0, 2]
            if admission is not None and admission >= 0 and step > admission:
                live = [0, 1, 2]
            # At the kill step, shard 0's round may still have had rank 2 (alive until its
            # next call) in it; later ones may not.
            allowed = [live] + ([[0, 1, 2]] if step == KILL_STEP and shard == 0 else [])
            if not decision.average or contributors not in allowed:
                raise AssertionError(f"rank {rank} step {step}: {decision}; expected the "
                                     f"replicas {allowed}")
            want = {n: sum(replica_model(step, k)[n] for k in contributors) /
                    len(contributors) for n in full}
            for n, p in params.items():
                if p.to_local().data_ptr() != storages[n]:
                    raise AssertionError(f"rank {rank} step {step}: {n} moved to new storage")
                check(torch, rank, step, f"{n}'s local shard", p.to_local().detach(),
                      shard_piece(torch, want[n], s, shard))
            return True

        for _ in range(MAX_STEPS):
            step = averager.step
            if end is not None and step >= end:
                break
            try:
                checked += bool(one_step(step))
            except Exception as e:
                # Rank 3's mate: its replica is lost, at its next averaging call
                # (ReplicaLostError) or in FSDP's next collective with the dead rank (Gloo's
                # error), whichever comes first.
                lost = isinstance(e, modelavg.ReplicaLostError) and e.rank == KILL_RANK or \
                    isinstance(e, RuntimeError) and "gloo" in str(e).lower()
                if role != "member" or rank != KILL_RANK - 1 or step < KILL_STEP or not lost:
                    raise
                out_queue.put((rank, "replica lost", None))
                out_queue.close()
                out_queue.join_thread()
                os._exit(0)  # its replica cannot go on
        if end is None:
            raise AssertionError(f"rank {rank}: no replacement was admitted in {MAX_STEPS} steps")
        time.sleep(0.5)  # the last round settles everywhere before the membership changes
        client.leave()
        out_queue.put((rank, {"role": role, "admission": admission, "checked": checked}, None))
        out_queue.close()
        out_queue.join_thread()
        os._exit(0)  # the world's Gloo group has a dead member: no orderly teardown
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank} ({role}): {type(e).__name__}: {e}"))


def run_elastic(name, config, coordinator, group, ctx, args):
    import torch.distributed as dist
    import modelavg
    world, s, levels, _, _ = config
    modelavg.create_job(name.replace("_", "-"), world, "PERIODIC", [levels[0][:2]],
                        replica_size=s, min_world_size=world - s, heartbeat_timeout_ms=2000,
                        coordinator=coordinator.address)
    models_dir = group.temp_dir("modelavg-fsdp2-models-")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    new_store = dist.TCPStore("127.0.0.1", 0, s + 1, True, wait_for_workers=False)
    procs = [ctx.Process(target=run_elastic_rank, daemon=True,
                         args=(r, name, config, coordinator.address, store.port, args.python_dir,
                               results, "member", models_dir)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + args.timeout_s
    try:
        # The replica is retired (its ranks vacant), then its replacement starts.
        while True:
            job = mt.poll_job(modelavg, name.replace("_", "-"), coordinator.address, deadline)
            if len(job.vacant_ranks) == s:
                break
            if time.monotonic() > deadline:
                mt.fail(f"{name}: replica 1 was never retired: {job}")
            time.sleep(0.1)
        for _ in range(s):
            procs.append(ctx.Process(target=run_elastic_rank, daemon=True,
                                     args=(-1, name, config, coordinator.address, new_store.port,
                                           args.python_dir, results, "replacement", models_dir)))
            procs[-1].start()
        for _ in range(world - 1 + s):  # the killed rank says nothing
            rank, value, error = results.get(timeout=max(1, deadline - time.monotonic()))
            if error:
                mt.fail(f"{name}: {error}\ncoordinator log:\n{coordinator.log_tail()}")
            got.setdefault(rank, []).append(value)
    except queue.Empty:
        mt.fail(f"{name}: timed out (results so far {got})\ncoordinator log:\n"
                f"{coordinator.log_tail()}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if "replica lost" not in got.get(KILL_RANK - 1, []):
        mt.fail(f"{name}: rank {KILL_RANK - 1} did not end with ReplicaLostError: {got}")
    new = [v for v in got.get(KILL_RANK - 1, []) + got.get(KILL_RANK, []) if v != "replica lost"]
    admissions = {v["admission"] for vs in got.values() for v in vs if isinstance(v, dict)}
    if len(new) != s or any(v["role"] != "replacement" for v in new) or len(admissions) != 1:
        mt.fail(f"{name}: the replacement did not take ranks {KILL_RANK - 1}..{KILL_RANK} at one "
                f"admission step: {got}")
    return (f"replica 1 lost at step {KILL_STEP}, its replacement admitted at step "
            f"{admissions.pop()} and healed shard by shard; every rank's local shards against "
            f"the live replicas' mean at every averaging step ({got[0][0]['checked']} on rank 0)")


def run(name, args):
    config = CONFIGS[name]
    world = config[0]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()
    with mt.ProcessGroup() as group:
        if config[4] == "elastic":
            coordinator = mt.Coordinator(group, args.coordinator_bin)
            print(f"PASS {name}: {run_elastic(name, config, coordinator, group, ctx, args)}")
            return
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
