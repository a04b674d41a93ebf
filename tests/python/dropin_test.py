"""modelavg.torch's drop-in averagers side by side with PyTorch's own, in the same processes.

For one named configuration: starts a coordinator, then W processes (from a fork server, Gloo group
on 127.0.0.1). Each builds PyTorch's averager and modelavg's drop-in with the same constructor
arguments, keeps two copies of the same parameters, applies the same update to both before every
step, averages one copy with each, and asserts after every step that

  * both copies are bit-for-bit identical (the update keeps every value on a grid on which the
    mean of W values is exact in every dtype, so summation order cannot matter);
  * modelavg averaged exactly when PyTorch did, at the same level.

The drop-in creates the job itself from its arguments and WORLD_SIZE (the first rank wins, the
others check the spec).

  pytest tests/python/dropin_test.py ["-k NAME"]      (conftest.py: which build)

The `features_*` configurations also cover: optimizer param_groups as input, parameters whose
.grad is None (left alone, as PyTorch does), float32/float64/float16/bfloat16 in one call, a
non-contiguous parameter, and `averager.step` set on resume (to a step PyTorch's averager is set
to as well).
"""

import collections
import os
import queue as queue_module
import traceback

import pytest

import modelavg_testing as mt

# name: (mode, world, warmup, levels [(period, group_size)], steps, features)
CONFIGS = {
    "periodic_w4_p3_wu5": ("periodic", 4, 5, [(3, 4)], 14, False),
    "periodic_w4_p1_wu2": ("periodic", 4, 2, [(1, 4)], 6, False),
    "periodic_w8_p4_wu3": ("periodic", 8, 3, [(4, 8)], 12, False),
    "hierarchical_w4_2x2_4x4_wu1": ("hierarchical", 4, 1, [(2, 2), (4, 4)], 13, False),
    # Levels in non-ascending order: the last level whose period divides the step wins.
    "hierarchical_w4_desc_4x2_2x4_wu3": ("hierarchical", 4, 3, [(4, 2), (2, 4)], 13, False),
    "hierarchical_w8_mixed_6x4_3x2_4x8_wu7": ("hierarchical", 8, 7, [(6, 4), (3, 2), (4, 8)],
                                              19, False),
    "features_periodic_w2_p2": ("periodic", 2, 1, [(2, 2)], 9, True),
    "features_hierarchical_w4_2x2_4x4": ("hierarchical", 4, 0, [(2, 2), (4, 4)], 9, True),
}

# Per dtype: (grid steps per unit, values stay in [0, bound)). With W <= 8 the mean of W values
# on the grid needs log2(bound * grid * 8) significant bits: exact in the dtype, in any order.
GRIDS = {"float32": (1024, 256), "float64": (1024, 256), "float16": (8, 16),
         "bfloat16": (2, 4)}


def make_params(torch, rank, features):
    """name -> (tensor factory, dtype name, has grad). Both copies are built from the same."""
    specs = [("w", (3, 5), "float32", True), ("b", (7,), "float32", True),
             ("d", (2, 2), "float64", True)]
    if features:
        specs += [("h", (6,), "float16", True), ("bf", (5,), "bfloat16", True),
                  ("frozen", (4,), "float32", False), ("t", (4, 3), "float32", True)]
    out = collections.OrderedDict()
    for i, (name, shape, dtype, grad) in enumerate(specs):
        grid, bound = GRIDS[dtype]
        n = 1
        for s in shape:
            n *= s
        base = (torch.arange(n, dtype=torch.float64) * 3 + rank * 5 + i) % (bound * grid) / grid
        out[name] = (base.reshape(shape), dtype, grad)
    return out


def build(torch, params_spec):
    """One copy: name -> Parameter."""
    copy = collections.OrderedDict()
    for name, (base, dtype, grad) in params_spec.items():
        t = base.to(getattr(torch, dtype)).clone()
        if name == "t":
            # Non-contiguous: the transpose of a (3, 4) tensor.
            t = t.reshape(3, 4).clone().t()
            assert not t.is_contiguous()
        p = torch.nn.Parameter(t)
        if grad:
            p.grad = torch.zeros_like(p)
        copy[name] = p
    return copy


def update(torch, copy, rank, step):
    """The same deterministic, grid-preserving update on a copy."""
    with torch.no_grad():
        for i, (name, p) in enumerate(copy.items()):
            grid, bound = GRIDS[str(p.dtype).replace("torch.", "")]
            v = p.data.double() * grid + (rank + 1) * (step + 1) + i
            v = torch.remainder(torch.floor(v), bound * grid) / grid
            p.data.copy_(v.to(p.dtype))


def run_rank(rank, name, config, address, store_port, python_dir, out_queue):
    try:
        mode, world, warmup, levels, steps, features = config
        os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": name.replace("_", "-"),
                           "RANK": str(rank), "WORLD_SIZE": str(world)})
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.algorithms.model_averaging import hierarchical_model_averager
        from torch.distributed.algorithms.model_averaging import utils
        import torch_reference
        import modelavg.torch

        mt.join_rank_group(torch, dist, store_port, rank, world)
        dist.new_subgroups = torch_reference.gloo_new_subgroups  # PyTorch's needs CUDA

        averaged = []
        original = utils.average_parameters_or_parameter_groups

        def recording(params, process_group):
            averaged.append(True)
            return original(params, process_group)

        utils.average_parameters_or_parameter_groups = recording
        periods = [p for p, _ in levels]
        if mode == "periodic":
            theirs = averagers.PeriodicModelAverager(period=levels[0][0], warmup_steps=warmup)
            ours = modelavg.torch.PeriodicModelAverager(period=levels[0][0], warmup_steps=warmup)
        else:
            theirs = hierarchical_model_averager.HierarchicalModelAverager(
                period_group_size_dict=collections.OrderedDict(levels), warmup_steps=warmup)
            recording_dict = torch_reference.RecordingDict(theirs.period_process_group_dict)
            theirs.period_process_group_dict = recording_dict
            ours = modelavg.torch.HierarchicalModelAverager(
                period_group_size_dict=collections.OrderedDict(levels), warmup_steps=warmup,
                process_group=dist.group.WORLD)  # the default group is accepted

        spec = make_params(torch, rank, features)
        a, b = build(torch, spec), build(torch, spec)
        if features:
            # param_groups: the optimizers' own lists, split over two groups.
            opt_a = torch.optim.SGD(list(a.values()), lr=0.1)
            names = list(b)
            opt_b = torch.optim.SGD([{"params": [b[n] for n in names[:3]]},
                                     {"params": [b[n] for n in names[3:]], "lr": 0.2}], lr=0.1)
        resume_at = steps // 2 if features else None
        averages = 0
        for step in range(steps):
            if step == resume_at:
                # A resume from a checkpoint taken 3 steps later: both averagers jump there.
                theirs.step = ours.step + 3
                ours.step = theirs.step
            expected_step = theirs.step
            update(torch, a, rank, step)
            update(torch, b, rank, step)
            averaged.clear()
            torch_reference.RecordingDict.last_key = None
            theirs.average_parameters(opt_a.param_groups if features else a.values())
            decision = ours.average_parameters(opt_b.param_groups if features else b.values())
            if decision.step != expected_step:
                raise AssertionError(f"step {step}: modelavg decided step {decision.step}, "
                                     f"PyTorch's averager was at {expected_step}")
            if ours.step != theirs.step:
                raise AssertionError(f"step {step}: averager.step {ours.step}, PyTorch's "
                                     f"{theirs.step}")
            if bool(averaged) != decision.average:
                raise AssertionError(f"step {expected_step}: PyTorch {'averaged' if averaged else 'skipped'}"
                                     f", modelavg {decision}")
            if averaged:
                averages += 1
                level = 0 if mode == "periodic" else periods.index(
                    torch_reference.RecordingDict.last_key)
                if level != decision.level:
                    raise AssertionError(f"step {expected_step}: PyTorch averaged at level "
                                         f"{level}, modelavg {decision}")
                group = levels[level][1]
                first = rank // group * group
                if decision.ranks != list(range(first, first + group)):
                    raise AssertionError(f"step {expected_step}: modelavg averaged with "
                                         f"{decision.ranks}, PyTorch with ranks "
                                         f"{first}..{first + group - 1}")
            for n in a:
                x, y = a[n].detach(), b[n].detach()
                if x.dtype != y.dtype or not torch.equal(x, y):
                    diff = (x.double() - y.double()).abs().max().item()
                    raise AssertionError(
                        f"step {expected_step}: parameter {n} ({y.dtype}) differs from "
                        f"PyTorch's by up to {diff}:\n modelavg {y.flatten()[:6].tolist()}\n "
                        f"PyTorch  {x.flatten()[:6].tolist()}")
            if features:
                if b["t"].is_contiguous():
                    raise AssertionError("the non-contiguous parameter was replaced, not "
                                         "averaged in place")
        if features:
            # The parameter without .grad: never averaged by either, so each rank's copy is
            # its own (the ranks' values differ), while averaged ones agree across a subgroup.
            gathered = [torch.zeros_like(b["frozen"]) for _ in range(world)]
            dist.all_gather(gathered, b["frozen"].detach())
            if all(torch.equal(g, gathered[0]) for g in gathered):
                raise AssertionError("the parameter without .grad holds the same values on "
                                     "every rank: it was averaged")
        dist.barrier()
        dist.destroy_process_group()
        out_queue.put((rank, averages, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def run(name, args):
    config = CONFIGS[name]
    world = config[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    with mt.ProcessGroup() as group:
        # A generous heartbeat timeout: W processes on a loaded CI machine must not be declared
        # dead while they start (this test is about values, not faults).
        coordinator = mt.Coordinator(group, args.coordinator_bin,
                                     extra_flags=["--default_heartbeat_timeout_ms=15000"])
        store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
        ctx = mt.rank_context()  # forked from a server that imported torch once
        results = ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, name, config, coordinator.address,
                                                    store.port, args.python_dir, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        errors, done = [], {}
        try:
            for _ in procs:
                rank, averages, error = results.get(timeout=args.timeout_s)
                if error:
                    errors.append(error)
                    break
                done[rank] = averages
        except queue_module.Empty:
            errors.append(f"timed out after {args.timeout_s} s (finished ranks: {sorted(done)})")
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
        if errors:
            mt.fail(f"{name}: {errors[0]}\ncoordinator log:\n{coordinator.log_tail()}")
        bad_exit = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad_exit:
            mt.fail(f"{name}: ranks exited non-zero: {bad_exit}")
        if coordinator.stop() != 0:
            mt.fail(f"{name}: the coordinator did not stop cleanly:\n{coordinator.log_tail()}")
    averages = done[0]
    if averages == 0:
        mt.fail(f"{name}: no step averaged: the configuration proves nothing")
    print(f"PASS {name}: {world} ranks x {config[4]} steps identical to PyTorch "
          f"({averages} averaging steps on rank 0)")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dropin(name, suite_args):
    run(name, suite_args)
