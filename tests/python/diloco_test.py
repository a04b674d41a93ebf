"""DiLoCo (a level's outer optimizer) from Python against plain PyTorch, every rank, every step.

For one named configuration: starts a coordinator, then W processes (from a fork server). Each
keeps two copies of the same parameters and applies the same local update to both before every
step. One copy goes through modelavg (``average_parameters`` on a job whose levels carry
``modelavg.OuterSGD``); the other through a reference written here from the rule alone, on a
Gloo process group:

  * the decision: PyTorch's schedule (periodic: s >= warmup and (s - warmup) % period == 0;
    hierarchical: s >= warmup, the last level whose period divides s; blocks of group_size);
  * a plain level, or an outer level's first averaging step: ``dist.all_reduce`` of the
    parameters over the block, divided by its size; an outer level then clones the result into
    its anchor (float32 for float16/bfloat16 parameters) and builds ``torch.optim.SGD`` on it;
  * an outer level's later steps: ``grad = all_reduce(anchor - x) / n`` set as the anchor's
    ``.grad``, ``optimizer.step()``, then ``x.copy_(anchor)``.

After every step both copies must agree (close to float32 rounding), on every rank.

Configurations ``checkpoint_*`` instead run the job in two halves: the first processes stop at a
step and save ``averager.state_dict()`` with the parameters (torch.save); new processes, in a new
job of the same spec, load them and go on. Their values must equal, exactly, those of an
uninterrupted run of a third job.

  pytest tests/python/diloco_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import traceback

import pytest

import modelavg_testing as mt

# Levels: (period, group_size, outer) with outer None or (lr, momentum, nesterov).
# name: (mode, world, warmup, levels, steps, how) with how "explicit" (create_job + averager)
# or "dropin" (modelavg.torch with its outer keyword).
CONFIGS = {
    "periodic_w4_p3_wu5_nesterov": ("periodic", 4, 5, [(3, 4, (0.7, 0.9, True))], 26,
                                    "explicit"),
    "periodic_w2_dropin": ("periodic", 2, 2, [(2, 2, (0.7, 0.9, True))], 20, "dropin"),
    # backup_device="cpu" (torchft's name): host parameters keep their state in host memory
    # either way, so the values are the reference's exactly as without it.
    "periodic_w2_dropin_backup_cpu": ("periodic", 2, 2, [(2, 2, (0.7, 0.9, True))], 20,
                                      "dropin_backup"),
    "hierarchical_w8_outer_last": ("hierarchical", 8, 1,
                                   [(2, 2, None), (4, 4, None), (8, 8, (0.7, 0.9, True))], 34,
                                   "explicit"),
    "hierarchical_w6_outer_first": ("hierarchical", 6, 0,
                                    [(2, 2, (0.5, 0.5, False)), (6, 6, None)], 26, "dropin"),
    "hierarchical_w4_two_outer": ("hierarchical", 4, 1,
                                  [(2, 2, (0.8, 0.9, False)), (6, 4, (0.7, 0.9, True))], 30,
                                  "explicit"),
    "lr1_momentum0_is_plain_w4": ("hierarchical", 4, 0,
                                  [(2, 2, (1.0, 0.0, False)), (4, 4, (1.0, 0.0, False))], 17,
                                  "explicit"),
    "checkpoint_w4_two_outer": ("hierarchical", 4, 1,
                                [(2, 2, (0.8, 0.9, False)), (6, 4, (0.7, 0.9, True))], 30,
                                "checkpoint"),
}
CHECKPOINT_AT = 13


def make_params(torch, rank):
    """name -> tensor: float32, float64 and bfloat16 (float32 outer state) parameters."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = {}
    for name, shape, dtype in [("w", (4, 5), torch.float32), ("b", (7,), torch.float32),
                               ("d", (3,), torch.float64), ("h", (6,), torch.bfloat16)]:
        out[name] = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return out


def decide(mode, warmup, levels, step, rank):
    """PyTorch's schedule, restated: (level index, first rank of the block, size) or None."""
    if step < warmup:
        return None
    if mode == "periodic":
        period, group, _ = levels[0]
        return (0, 0, group) if (step - warmup) % period == 0 else None
    for i in range(len(levels) - 1, -1, -1):
        period, group, _ = levels[i]
        if step % period == 0:
            return (i, rank // group * group, group)
    return None


class Reference:
    """The rule on plain PyTorch: dist.all_reduce and torch.optim.SGD."""

    def __init__(self, torch, dist, world, levels):
        self.torch, self.dist, self.levels = torch, dist, levels
        self.groups = {}  # (level, first) -> process group; every rank creates every group
        for i, (_, size, _) in enumerate(levels):
            for first in range(0, world, size):
                self.groups[(i, first)] = dist.new_group(list(range(first, first + size)),
                                                         backend="gloo")
        self.anchors = {}     # level -> [anchor Parameter]
        self.optimizers = {}  # level -> torch.optim.SGD

    def mean(self, t, group, n):
        t = t.clone()
        self.dist.all_reduce(t, group=group)
        return t / n

    def step(self, params, decision):
        torch = self.torch
        level, first, n = decision
        group = self.groups[(level, first)]
        outer = self.levels[level][2]
        xs = list(params.values())
        with torch.no_grad():
            if outer is None or level not in self.anchors:
                for x in xs:
                    if x.dtype in (torch.float16, torch.bfloat16):
                        # modelavg stages half parameters as float32; so does the reference.
                        x.copy_(self.mean(x.float(), group, n).to(x.dtype))
                    else:
                        x.copy_(self.mean(x, group, n))
                if outer is not None:
                    state = [torch.nn.Parameter(x.detach().clone().to(
                        torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype))
                        for x in xs]
                    lr, momentum, nesterov = outer
                    self.anchors[level] = state
                    self.optimizers[level] = torch.optim.SGD(state, lr=lr, momentum=momentum,
                                                             nesterov=nesterov)
                return
            anchors = self.anchors[level]
            for a, x in zip(anchors, xs):
                a.grad = self.mean(a.detach() - x.to(a.dtype), group, n)
        self.optimizers[level].step()
        with torch.no_grad():
            for a, x in zip(self.anchors[level], xs):
                x.copy_(a.detach().to(x.dtype))


def job_levels(modelavg, levels):
    return [(p, g) if o is None else
            modelavg.Level(p, g, outer=modelavg.OuterSGD(o[0], momentum=o[1], nesterov=o[2]))
            for p, g, o in levels]


def make_averager(modelavg, mode, world, warmup, levels, how, job_id, address, rank):
    if how in ("dropin", "dropin_backup"):
        import modelavg.torch
        backup = {"backup_device": "cpu"} if how == "dropin_backup" else {}
        if backup:
            try:
                modelavg.torch.PeriodicModelAverager(period=2, backup_device="cuda:7")
                raise AssertionError("backup_device='cuda:7' was accepted")
            except ValueError as e:
                assert "backup_device" in str(e), e
        os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": job_id,
                           "RANK": str(rank), "WORLD_SIZE": str(world)})
        sgd = {p: modelavg.OuterSGD(o[0], momentum=o[1], nesterov=o[2])
               for p, _, o in levels if o is not None}
        if mode == "periodic":
            avg = modelavg.torch.PeriodicModelAverager(period=levels[0][0], warmup_steps=warmup,
                                                       outer=sgd[levels[0][0]], **backup)
            assert avg.backup_device == backup.get("backup_device"), avg.backup_device
            return avg
        return modelavg.torch.HierarchicalModelAverager(
            period_group_size_dict={p: g for p, g, _ in levels}, warmup_steps=warmup,
            outer=sgd, **backup)
    if rank == 0:
        modelavg.create_job(job_id, world, mode, job_levels(modelavg, levels),
                            warmup_steps=warmup, coordinator=address)
    client = mt.connect_rank(modelavg, address, job_id, rank)
    cls = (modelavg.PeriodicModelAverager if mode == "periodic"
           else modelavg.HierarchicalModelAverager)
    return cls(client)


def check_close(torch, step, rank, ours, ref):
    for (name, x), (_, y) in zip(ours.items(), ref.items()):
        tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
        if not torch.allclose(x.double(), y.double(), rtol=tol, atol=tol):
            diff = (x.double() - y.double()).abs().max().item()
            raise AssertionError(f"rank {rank} step {step}: {name} ({x.dtype}) differs from "
                                 f"the PyTorch reference by {diff}:\n modelavg "
                                 f"{x.flatten()[:5].tolist()}\n PyTorch  "
                                 f"{y.flatten()[:5].tolist()}")


def run_rank(rank, name, config, address, store_port, python_dir, out_queue):
    """Compares modelavg with the reference on every step."""
    try:
        mode, world, warmup, levels, steps, how = config
        import torch
        import torch.distributed as dist
        import modelavg
        mt.join_rank_group(torch, dist, store_port, rank, world)
        plain = name.startswith("lr1_")
        # lr 1, momentum 0 must equal plain averaging: there the reference averages, no SGD.
        reference = Reference(torch, dist, world,
                              [(p, g, None) for p, g, _ in levels] if plain else levels)
        ours_t, ref_t = make_params(torch, rank), make_params(torch, rank)
        ours_p = mt.as_parameters(torch, ours_t)
        averager = make_averager(modelavg, mode, world, warmup, levels, how,
                                 name.replace("_", "-"), address, rank)
        outer_steps = 0
        for step in range(steps):
            mt.local_update(torch, ours_t, rank, step)
            mt.local_update(torch, ref_t, rank, step)
            decision = averager.average_parameters(ours_p)
            want = decide(mode, warmup, levels, step, rank)
            if decision.average != (want is not None) or (want and decision.level != want[0]):
                raise AssertionError(f"rank {rank} step {step}: modelavg {decision}, the rule "
                                     f"{want}")
            if want is not None:
                reference.step(ref_t, want)
                outer_steps += levels[want[0]][2] is not None
            check_close(torch, step, rank, ours_t, ref_t)
        state = averager.state_dict()
        expected_levels = sorted({d[0] for d in (decide(mode, warmup, levels, s, rank)
                                                 for s in range(steps)) if d is not None
                                  and levels[d[0]][2] is not None})
        if sorted(state["anchors"]) != expected_levels or state["step"] != steps:
            raise AssertionError(f"rank {rank}: state_dict has step {state['step']} and anchors "
                                 f"for levels {sorted(state['anchors'])}; expected {steps} and "
                                 f"{expected_levels}")
        if not plain:
            for level, anchors in state["anchors"].items():
                for a, x, p in zip(anchors, reference.anchors[level], ours_t.values()):
                    tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-5
                    want = x.detach().double().flatten()
                    if a.dtype != x.dtype or not torch.allclose(a.double(), want, rtol=tol,
                                                               atol=tol):
                        raise AssertionError(f"rank {rank}: the anchor of level {level} differs "
                                             "from the reference's")
        dist.barrier()
        dist.destroy_process_group()
        averager.client.leave()
        out_queue.put((rank, outer_steps, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def run_checkpoint_rank(rank, name, config, address, store_port, python_dir, out_queue, phase,
                        state_dir):
    """phase "whole": steps 0..steps-1; "first": 0..CHECKPOINT_AT-1, then save; "second": load,
    then CHECKPOINT_AT..steps-1. Reports every step's parameters (as lists)."""
    try:
        mode, world, warmup, levels, steps, _ = config
        import torch
        import modelavg
        torch.set_num_threads(1)
        params = make_params(torch, rank)
        ps = mt.as_parameters(torch, params)
        averager = make_averager(modelavg, mode, world, warmup, levels, "explicit",
                                 f"{name.replace('_', '-')}-{phase}", address, rank)
        path = os.path.join(state_dir, f"rank{rank}.pt")
        first, last = 0, steps
        if phase == "first":
            last = CHECKPOINT_AT
        if phase == "second":
            saved = torch.load(path)
            averager.load_state_dict(saved["averager"])
            with torch.no_grad():
                for p, v in zip(ps, saved["params"]):
                    p.copy_(v)
            first = averager.step
            if first != CHECKPOINT_AT:
                raise AssertionError(f"rank {rank}: restored step {first}, saved at "
                                     f"{CHECKPOINT_AT}")
        trace = {}
        for step in range(first, last):
            mt.local_update(torch, params, rank, step)
            averager.average_parameters(ps)
            trace[step] = [p.detach().clone() for p in ps]
        if phase == "first":
            torch.save({"averager": averager.state_dict(),
                        "params": [p.detach().clone() for p in ps]}, path)
        averager.client.leave()
        out_queue.put((rank, {s: [t.double().flatten().tolist() for t in v]
                              for s, v in trace.items()}, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank} ({phase}): {type(e).__name__}: {e}"))


def run(name, args):
    config = CONFIGS[name]
    world = config[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()  # forked from a server that imported torch once
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin,
                                     extra_flags=["--default_heartbeat_timeout_ms=15000"])
        if config[5] == "checkpoint":
            state_dir = group.temp_dir("modelavg-diloco-")
            traces = {}
            for phase in ("whole", "first", "second"):
                done, errors = mt.start_ranks(
                    ctx, world, run_checkpoint_rank,
                    lambda r, q: (r, name, config, coordinator.address, 0, args.python_dir, q,
                                  phase, state_dir), args.timeout_s)
                if errors:
                    mt.fail(f"{name} ({phase}): {errors[0]}\ncoordinator log:\n"
                            f"{coordinator.log_tail()}")
                traces[phase] = done
            compared = 0
            for r in range(world):
                for step, values in traces["second"][r].items():
                    if values != traces["whole"][r][step]:
                        mt.fail(f"{name}: rank {r} step {step}: the resumed run differs from the "
                                f"uninterrupted one:\n resumed {values[0][:4]}\n whole   "
                                f"{traces['whole'][r][step][0][:4]}")
                    compared += 1
            if coordinator.stop() != 0:
                mt.fail(f"{name}: the coordinator did not stop cleanly:\n{coordinator.log_tail()}")
            print(f"PASS {name}: {world} ranks resumed at step {CHECKPOINT_AT} from state_dict in "
                  f"new processes equal an uninterrupted run ({compared} rank-steps, exactly)")
            return
        done = mt.run_world(ctx, world, run_rank, name, config, coordinator, args.python_dir,
                            args.timeout_s)
    if done[0] == 0:
        mt.fail(f"{name}: no outer-level step: the configuration proves nothing")
    print(f"PASS {name}: {world} ranks x {config[4]} steps follow the PyTorch reference "
          f"({done[0]} outer-level averaging steps on rank 0)")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_diloco(name, suite_args):
    run(name, suite_args)
