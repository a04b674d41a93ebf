"""Sharded replicas (``create_job(..., replica_size=S)``) from Python against plain PyTorch.

For one named configuration: starts a coordinator, then W forked processes, replica k being
ranks k*S .. k*S + S - 1. Configurations ``by_hand_*`` shard a model by hand, as FSDP does:
every replica has its own full model (a seed per replica); rank r keeps shard r % S of every
weight (its slice of the flattened weight, ``tensor_split`` into S parts) and, beside it, the
replica's whole model as the reference. Before every step both get the same update (noise drawn
per replica, step and weight; the shard gets its slice of it). modelavg averages the shards; the
reference averages the *whole* models of the replicas in the rank's block with ``dist.all_reduce``
on a Gloo group (PyTorch's averagers over replicas). After every step each rank's shard must equal
its slice of the reference model, and the decision must be the rule's.

``fsdp_cpu`` runs FullyShardedDataParallel itself inside each replica (a Gloo process group of
its S ranks) and averages its flat parameters; it says so and skips where the installed PyTorch
cannot run FSDP on CPU (then bench/gpu_bench.sh runs it on a GPU machine). ``dtensor_local``
checks that a DTensor parameter is averaged through ``to_local()`` (its storage), and skips
where PyTorch has no DTensor. ``replica_lost_w4_s2`` kills one rank of an elastic job's replica:
its mate gets ``modelavg.ReplicaLostError`` naming the replica and the lost rank, the others go on.
``bad_specs``: each replica_size that does not fit the job is an InvalidArgumentError naming it.

  pytest tests/python/sharded_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import signal
import sys
import time
import traceback

import pytest

import modelavg_testing as mt

# name: (mode, world, replica_size, warmup, levels, steps, how); levels (period, group_size).
CONFIGS = {
    "by_hand_w8_s2_hierarchical": ("hierarchical", 8, 2, 3, [(2, 4), (5, 8)], 14, "explicit"),
    "by_hand_w6_s3_periodic_dropin": ("periodic", 6, 3, 1, [(2, 6)], 10, "dropin"),
    "by_hand_w8_s4_groups_of_one": ("hierarchical", 8, 4, 0, [(2, 4), (3, 8)], 10, "explicit"),
    "fsdp_cpu": ("hierarchical", 4, 2, 0, [(2, 4)], 6, "fsdp"),
    "dtensor_local": (None, 0, 0, 0, [], 0, "dtensor"),
    "replica_lost_w4_s2": ("periodic", 4, 2, 0, [(1, 4)], 80, "lost"),
    "bad_specs": (None, 0, 0, 0, [], 0, "bad"),
}

# (world, levels, replica_size, min_world_size) -> what the InvalidArgumentError must say.
BAD_SPECS = [
    (8, [(2, 4), (5, 8)], 3, 0, "replica_size 3 does not divide world_size 8"),
    (8, [(2, 2), (5, 8)], 4, 0, "replica_size 4 does not divide levels[0].group_size 2"),
    (8, [(2, 4), (5, 8)], 2, 5, "replica_size 2 does not divide min_world_size 5"),
    (8, [(2, 8)], -1, 0, "replica_size must be >= 0"),
]


def check_bad_specs(coordinator, python_dir):
    """Each bad replica_size: INVALID_ARGUMENT (a ValueError) naming the field and values."""
    sys.path.insert(0, python_dir)
    import modelavg
    for i, (world, levels, s, min_world, want) in enumerate(BAD_SPECS):
        try:
            modelavg.create_job(f"bad-{i}", world, "HIERARCHICAL", levels, replica_size=s,
                                min_world_size=min_world, coordinator=coordinator.address)
        except modelavg.InvalidArgumentError as e:
            if want not in str(e) or not isinstance(e, ValueError):
                mt.fail(f"bad spec {i}: {e!r} does not say {want!r}")
            continue
        mt.fail(f"bad spec {i} (replica_size {s}) was accepted")
    job = modelavg.create_job("good", 8, "HIERARCHICAL", [(2, 4), (5, 8)], replica_size=2,
                              coordinator=coordinator.address)
    if job.spec.replica_size != 2:
        mt.fail(f"the job's spec has replica_size {job.spec.replica_size}")
    print(f"PASS bad_specs: {len(BAD_SPECS)} bad replica sizes refused, each naming the values")


def naive_group(world, replica_size, group_size, rank):
    """The rule: the ranks of rank's block of group_size that hold its shard."""
    first = rank // group_size * group_size
    return [r for r in range(first, first + group_size) if r % replica_size == rank % replica_size]


def decide(mode, warmup, levels, step):
    """PyTorch's schedule: the level index, or None."""
    if step < warmup:
        return None
    if mode == "periodic":
        return 0 if (step - warmup) % levels[0][0] == 0 else None
    for i in range(len(levels) - 1, -1, -1):
        if step % levels[i][0] == 0:
            return i
    return None


def full_model(torch, replica):
    """The replica's whole model: a few weights of odd sizes (not multiples of S)."""
    g = torch.Generator().manual_seed(4242 + replica)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64).float()
            for name, shape in [("w", (5, 7)), ("b", (11,)), ("v", (3, 3, 2))]}


def shard_of(t, replica_size, shard):
    """Shard `shard` of `t`: its slice of the flattened tensor (FSDP's flat parameter, unpadded)."""
    return t.reshape(-1).tensor_split(replica_size)[shard]


def update(torch, full, mine, replica, step, replica_size, shard):
    """The same local step on the replica's whole model and on this rank's shard of it."""
    with torch.no_grad():
        for i, (name, t) in enumerate(full.items()):
            g = torch.Generator().manual_seed(replica * 100003 + step * 101 + i)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float64).float() * 0.1
            t.add_(noise)
            mine[i].add_(shard_of(noise, replica_size, shard))


def run_by_hand(rank, name, config, address, store_port, python_dir, out_queue):
    try:
        mode, world, s, warmup, levels, steps, how = config
        sys.path.insert(0, python_dir)
        import torch
        import torch.distributed as dist
        import modelavg
        mt.join_rank_group(torch, dist, store_port, rank, world)
        replica, shard = rank // s, rank % s
        # The reference's groups: every rank creates every group (dist.new_group's rule).
        groups = {}
        for i, (_, g) in enumerate(levels):
            for r in range(world):
                key = (i, tuple(naive_group(world, s, g, r)))
                if key not in groups:
                    groups[key] = dist.new_group(list(key[1]), backend="gloo")
        full = full_model(torch, replica)
        mine = [torch.nn.Parameter(shard_of(t, s, shard).clone()) for t in full.values()]
        for p in mine:
            p.grad = torch.zeros_like(p)
        job_id = name.replace("_", "-")
        if how == "dropin":
            import modelavg.torch
            os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": job_id,
                               "RANK": str(rank), "WORLD_SIZE": str(world)})
            modelavg.torch.set_options(replica_size=s)
            averager = modelavg.torch.PeriodicModelAverager(period=levels[0][0],
                                                            warmup_steps=warmup)
        else:
            if rank == 0:
                modelavg.create_job(job_id, world, mode, levels, warmup_steps=warmup,
                                    replica_size=s, coordinator=address)
            client = mt.connect_rank(modelavg, address, job_id, rank)
            cls = (modelavg.PeriodicModelAverager if mode == "periodic"
                   else modelavg.HierarchicalModelAverager)
            averager = cls(client)
        client = averager.client
        if (client.replica_size, client.replica, client.shard) != (s, replica, shard):
            raise AssertionError(f"rank {rank}: client says replica_size {client.replica_size}, "
                                 f"replica {client.replica}, shard {client.shard}")
        averaged = 0
        for step in range(steps):
            update(torch, full, mine, replica, step, s, shard)
            decision = averager.average_parameters(mine)
            level = decide(mode, warmup, levels, step)
            if level is None:
                if decision.average:
                    raise AssertionError(f"rank {rank} step {step}: averaged, the rule skips")
            else:
                want = naive_group(world, s, levels[level][1], rank)
                if not decision.average or decision.level != level or \
                        list(decision.ranks) != want:
                    raise AssertionError(f"rank {rank} step {step}: modelavg {decision}, the "
                                         f"rule level {level} ranks {want}")
                group = groups[(level, tuple(want))]
                with torch.no_grad():
                    for t in full.values():
                        dist.all_reduce(t, group=group)
                        t.div_(len(want))
                averaged += 1
            for i, (wname, t) in enumerate(full.items()):
                want = shard_of(t, s, shard)
                if not torch.allclose(mine[i].detach(), want, rtol=1e-5, atol=1e-5):
                    diff = (mine[i].detach() - want).abs().max().item()
                    raise AssertionError(
                        f"rank {rank} (replica {replica}, shard {shard}) step {step}: weight "
                        f"{wname}'s shard differs from its slice of the replicas' average by "
                        f"{diff}")
        dist.barrier()
        dist.destroy_process_group()
        if how != "dropin":
            client.leave()
        out_queue.put((rank, averaged, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def fsdp_unavailable():
    """Why this PyTorch cannot run FSDP on CPU here, or None."""
    try:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    except Exception as e:  # an import that fails for any reason (Debian's 1.13: a dataclass)
        return f"torch {torch.__version__} cannot import FullyShardedDataParallel: {e}"
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 1):
        return f"torch {torch.__version__} runs FSDP on CUDA only (CPU needs 2.1 or later)"
    return None


def run_fsdp(rank, name, config, address, store_port, python_dir, out_queue):
    """FSDP inside each replica (its S ranks), modelavg across replicas, against the same model
    trained unsharded and averaged with dist.all_reduce over the replicas."""
    try:
        mode, world, s, warmup, levels, steps, _ = config
        sys.path.insert(0, python_dir)
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        import modelavg
        mt.join_rank_group(torch, dist, store_port, rank, world)
        replica, shard = rank // s, rank % s
        replica_groups = [dist.new_group(list(range(k * s, k * s + s)), backend="gloo")
                          for k in range(world // s)]
        shard_groups = {j: dist.new_group(list(range(j, world, s)), backend="gloo")
                        for j in range(s)}

        def build():
            torch.manual_seed(7)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                       torch.nn.Linear(5, 3))

        model = FSDP(build(), process_group=replica_groups[replica],
                     device_id=torch.device("cpu"), use_orig_params=False)
        reference = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        if rank == 0:
            modelavg.create_job(name.replace("_", "-"), world, mode, levels,
                                warmup_steps=warmup, replica_size=s, coordinator=address)
        client = mt.connect_rank(modelavg, address, name.replace("_", "-"), rank)
        averager = modelavg.HierarchicalModelAverager(client)
        for step in range(steps):
            g = torch.Generator().manual_seed(replica * 1000 + step)
            x = torch.randn(4, 6, generator=g)
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
            # FSDP's flat parameters: this rank's shard of the replica's model.
            averager.average_parameters(model.parameters())
            if decide(mode, warmup, levels, step) is not None:
                with torch.no_grad():
                    for p in reference.parameters():
                        dist.all_reduce(p, group=shard_groups[shard])
                        p.div_(world // s)
            with FSDP.summon_full_params(model):
                for (n, p), q in zip(model.module.named_parameters(), reference.parameters()):
                    if not torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-5):
                        raise AssertionError(f"rank {rank} step {step}: FSDP's {n} differs from "
                                             "the unsharded replicas' average")
        dist.barrier()
        client.leave()
        out_queue.put((rank, steps, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def check_dtensor(args):
    """A DTensor parameter is described by its local shard's storage."""
    sys.path.insert(0, args.python_dir)
    import torch
    from modelavg import _params
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no DTensor (PyTorch 2.x has "
                    "torch.distributed.tensor); nothing to average through to_local()")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    p = torch.nn.Parameter(d)
    specs, _ = _params.describe([p])
    local = d.to_local()
    if specs[0][0] != local.data_ptr() or specs[0][1] != local.numel():
        mt.fail(f"a DTensor was described as {specs[0]}, not its local shard "
                f"({local.data_ptr()}, {local.numel()})")
    dist.destroy_process_group()
    print("PASS dtensor_local: a DTensor parameter is averaged through to_local()'s storage")


def run_lost(rank, name, config, address, store_port, python_dir, out_queue):
    """Rank 1 dies at step 10; rank 0, its replica mate, must get ReplicaLostError."""
    try:
        mode, world, s, warmup, levels, steps, _ = config
        sys.path.insert(0, python_dir)
        import torch
        import modelavg
        torch.set_num_threads(1)
        job_id = name.replace("_", "-")
        if rank == 0:  # (gRPC starts in the ranks: the parent forks them)
            modelavg.create_job(job_id, world, mode, levels, replica_size=s, min_world_size=2,
                                heartbeat_timeout_ms=2000, coordinator=address)
        client = mt.connect_rank(modelavg, address, job_id, rank)
        averager = modelavg.PeriodicModelAverager(client)
        p = torch.nn.Parameter(torch.full((8,), float(rank)))
        p.grad = torch.zeros_like(p)
        for step in range(steps):
            if rank == 1 and step == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                decision = averager.average_parameters([p])
            except modelavg.ReplicaLostError as e:
                if rank != 0 or e.rank != 1 or e.replica != 0:
                    raise AssertionError(f"rank {rank}: ReplicaLostError rank={e.rank} "
                                         f"replica={e.replica}: {e}")
                if not isinstance(e, modelavg.PeerFailureError):
                    raise AssertionError("ReplicaLostError is not a PeerFailureError")
                out_queue.put((rank, str(e), None))
                return
            time.sleep(0.05)
        if rank == 0:
            raise AssertionError("rank 0 finished without ReplicaLostError")
        # The other replica went on without replica 0: at the end each of its ranks averages
        # alone (the only live rank of its shard).
        if list(decision.members) != [rank]:
            raise AssertionError(f"rank {rank}: the last step averaged with {decision.members}")
        client.leave()
        out_queue.put((rank, "finished", None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))


def run(name, args):
    config = CONFIGS[name]
    how = config[6]
    if how == "dtensor":
        check_dtensor(args)
        return
    if how == "fsdp":
        why = fsdp_unavailable()
        if why:
            pytest.skip(f"{why}; bench/gpu_bench.sh runs this test where PyTorch can")
    world = config[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin,
                                     extra_flags=["--default_heartbeat_timeout_ms=15000"])
        if how == "bad":
            check_bad_specs(coordinator, args.python_dir)
            return
        if how == "lost":
            results = ctx.Queue()
            procs = [ctx.Process(target=run_lost, daemon=True,
                                 args=(r, name, config, coordinator.address, 0,
                                       args.python_dir, results)) for r in range(world)]
            for p in procs:
                p.start()
            got = {}
            try:
                for _ in range(world - 1):  # rank 1 dies without a word
                    r, value, error = results.get(timeout=args.timeout_s)
                    if error:
                        mt.fail(f"{name}: {error}\ncoordinator log:\n{coordinator.log_tail()}")
                    got[r] = value
            finally:
                for p in procs:
                    p.join(timeout=10)
            if "replica 0 (ranks 0..1)" not in got.get(0, ""):
                mt.fail(f"{name}: rank 0's error does not name its replica: {got.get(0)}")
            if got.get(2) != "finished" or got.get(3) != "finished":
                mt.fail(f"{name}: the other replica did not finish: {got}")
            print(f"PASS {name}: rank 0 got ReplicaLostError ({got[0][:160]}...); ranks 2, 3 "
                  "finished")
            return
        target = run_fsdp if how == "fsdp" else run_by_hand
        done = mt.run_world(ctx, world, target, name, config, coordinator, args.python_dir,
                            args.timeout_s)
        print(f"PASS {name}: {world} ranks in replicas of {config[2]}: every shard equals its "
              f"slice of the replicas' PyTorch average, every step ({done.get(0)} averaging "
              "steps)")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded(name, suite_args):
    run(name, suite_args)
