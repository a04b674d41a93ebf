"""Streaming sync (Level.fragments, sync_delay, mix, payload) from Python against plain PyTorch,
every rank, every step.

For one named configuration: starts a coordinator, then W processes (from a fork server). Each
keeps two copies of the same parameters (float32 and float64 tensors of different sizes; float32
only with a compressed payload) and applies the same local update to both before every step.
One copy goes through modelavg (``average_parameters`` on a job whose levels are
``modelavg.Level(..., fragments=, sync_delay=, mix=, payload=)``); the other through a reference written here from the rule alone
(docs/streaming.md), on a Gloo process group with blocking ``dist.all_reduce``:

  * the schedule: a level of period H and F fragments takes part in PyTorch's walk with period
    H / F and syncs fragment (s / (H / F)) mod F (s - warmup in a periodic job);
  * the split: tensor i, bytes [c, c + b) of T, is in fragment floor((c + b / 2) F / T);
  * a plain level: the fragment's tensors become the block's mean;
  * an outer level, per fragment: the first sync A := mean of x, later D := mean of (A - x)
    given to ``torch.optim.SGD`` on A; the fragment then becomes (1 - mix) A + mix x_local;
    with sync_delay tau the mean is taken from the values at step s and applied at step
    s + tau (before that step's own decision), x_local being the values passed then.

FP32: both copies agree to float32 rounding. BF16 and INT8 (lr 1, momentum 0): within the
documented bound of the averaged pseudo-gradient (BF16 2^-7 M, M the largest |A - x| of the
tensor over the block; INT8 2 M / 254, M that of the fragment), summed over the fragment's outer
steps. ``traffic()`` is checked too:
bytes on exactly the levels that averaged, and with a peer that sleeps before its sync step the
others' calls at s + tau wait for it (``waited_s``).

Configurations ``payload_bytes_*`` run an FP32, a BF16 and an INT8 job and compare the bytes
their outer steps sent (BF16 <= 0.55x, INT8 <= 0.30x of FP32). Configurations ``checkpoint_*``
run the job in two halves: the first processes stop at a step where a background all-reduce is
in flight and save ``averager.state_dict()`` with the parameters; new processes, in a new job of
the same spec, load them and go on. Their values must equal, exactly, an uninterrupted run's
(with error feedback, INT4 and TOPK, the residual travels in the state).

  pytest tests/python/streaming_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import time
import traceback

import pytest

import modelavg_testing as mt

# A level: dict with period, group, and optionally outer (lr, momentum, nesterov), fragments,
# sync_delay, mix, payload.
def L(period, group, outer=None, **streaming):
    return dict(period=period, group=group, outer=outer, fragments=streaming.get("fragments", 1),
                sync_delay=streaming.get("sync_delay", 0), mix=streaming.get("mix", 0.0),
                payload=streaming.get("payload", "FP32"),
                error_feedback=streaming.get("error_feedback", 0.0),
                topk_density=streaming.get("topk_density", 0.0))


DILOCO = (0.7, 0.9, True)
# name: (mode, world, warmup, levels, steps, how); how: "explicit" (create_job + averager),
# "dropin" (modelavg.torch with a Level in its outer keyword), "payload_bytes", "checkpoint".
CONFIGS = {
    "fragments_mix_periodic_w4": ("periodic", 4, 3, [L(8, 4, DILOCO, fragments=4, mix=0.3)],
                                  40, "explicit"),
    "delay_mix_hierarchical_w4": ("hierarchical", 4, 1,
                                  [L(2, 2), L(8, 4, (0.8, 0.9, False), fragments=2,
                                                sync_delay=2, mix=0.5)], 42, "explicit"),
    "delay_plain_fragments_outranked_w4": ("hierarchical", 4, 0,
                                           [L(6, 2, fragments=3),
                                            L(12, 4, DILOCO, fragments=2, sync_delay=3)],
                                           50, "explicit"),
    "delay_dropin_w2": ("periodic", 2, 0, [L(6, 2, DILOCO, fragments=3, sync_delay=1, mix=0.2)],
                        30, "dropin"),
    "bf16_w4": ("hierarchical", 4, 0, [L(2, 2), L(8, 4, (1.0, 0.0, False), fragments=2,
                                                   payload="BF16")], 40, "explicit"),
    "int8_delay_w4": ("periodic", 4, 2, [L(6, 4, (1.0, 0.0, False), fragments=3, sync_delay=1,
                                              payload="INT8")], 44, "explicit"),
    "payload_bytes_w4": ("periodic", 4, 0, [L(2, 4, (1.0, 0.0, False), sync_delay=1)], 16,
                         "payload_bytes"),
    "checkpoint_delay_w4": ("hierarchical", 4, 1,
                            [L(2, 2), L(8, 4, (0.8, 0.9, True), fragments=2, sync_delay=2,
                                        mix=0.25)], 40, "checkpoint"),
    "checkpoint_int8_first_sync_pending_w2": ("periodic", 2, 0,
                                              [L(12, 2, (1.0, 0.0, False), fragments=3,
                                                 sync_delay=2, payload="INT8")], 30,
                                              "checkpoint"),
    # Error feedback: the residual is part of state_dict; resumed with an outer sync in flight.
    "checkpoint_int4_feedback_w2": ("periodic", 2, 0,
                                    [L(12, 2, (1.0, 0.0, False), fragments=3, sync_delay=2,
                                       payload="INT4", error_feedback=0.9)], 30, "checkpoint"),
    "checkpoint_topk_feedback_w4": ("periodic", 4, 0,
                                    [L(8, 4, (0.7, 0.9, True), fragments=2, sync_delay=1,
                                       payload="TOPK", topk_density=0.05, error_feedback=1.0)],
                                    30, "checkpoint"),
}
# The step the checkpoint runs stop before: a background all-reduce is in flight there.
CHECKPOINT_AT = {"checkpoint_delay_w4": 13, "checkpoint_int8_first_sync_pending_w2": 5,
                 "checkpoint_int4_feedback_w2": 17, "checkpoint_topk_feedback_w4": 13}
# The rank that sleeps before its sync steps in the payload_bytes configuration, and how long.
SLEEPER, SLEEP_S = 3, 0.6

SHAPES = [("w", (5, 6), "float32"), ("b", (7,), "float32"), ("d", (4, 3), "float64"),
          ("e", (20,), "float32"), ("g", (2,), "float64"), ("h", (9, 2), "float32")]


def make_params(torch, rank, levels):
    """float32 and float64 tensors; float32 only where a level compresses its payload (BF16 and
    INT8 take float32, float16 and bfloat16 tensors)."""
    compressed = any(lv["payload"] != "FP32" for lv in levels)
    g = torch.Generator().manual_seed(4321 + rank)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64).to(
                torch.float32 if compressed else getattr(torch, dt))
            for name, shape, dt in SHAPES}


def split(tensors, fragments):
    """Fragment of each tensor: the fragment its middle byte falls in."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    out, start = [], 0
    for i, b in enumerate(sizes):
        f = (i * fragments // len(sizes)) if total == 0 else (2 * start + b) * fragments // (2 * total)
        out.append(min(f, fragments - 1))
        start += b
    return out


def decide(mode, warmup, levels, step, rank):
    """(level, fragment, first rank of the block, block size) or None."""
    if step < warmup:
        return None
    order = [0] if mode == "periodic" else range(len(levels) - 1, -1, -1)
    for i in order:
        lv = levels[i]
        sp = lv["period"] // lv["fragments"]
        s = step - warmup if mode == "periodic" else step
        if s % sp == 0:
            return (i, (s // sp) % lv["fragments"], rank // lv["group"] * lv["group"], lv["group"])
    return None


def state_dtype(torch, x):
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class Reference:
    """The rule on plain PyTorch: blocking dist.all_reduce and torch.optim.SGD."""

    def __init__(self, torch, dist, world, levels):
        self.torch, self.dist, self.levels = torch, dist, levels
        self.groups = {}  # (level, first) -> process group; every rank creates every group
        for i, lv in enumerate(levels):
            for first in range(0, world, lv["group"]):
                self.groups[(i, first)] = dist.new_group(list(range(first, first + lv["group"])),
                                                         backend="gloo")
        self.anchors = {}     # (level, fragment) -> [anchor Parameter]
        self.optimizers = {}  # (level, fragment) -> torch.optim.SGD
        self.pending = []     # (apply step, level, fragment, first, [mean])
        # Per tensor: the bound on |modelavg - reference| so far (compressed payloads).
        self.bound = None

    def mean(self, t, group, n):
        t = t.clone()
        self.dist.all_reduce(t, group=group)
        return t / n

    def largest(self, t, group):
        m = t.abs().max().clone().double().reshape(1)
        self.dist.all_reduce(m, op=self.dist.ReduceOp.MAX, group=group)
        return m.item()

    def set_anchor(self, key, values):
        state = [self.torch.nn.Parameter(v.detach().clone()) for v in values]
        lr, momentum, nesterov = self.levels[key[0]]["outer"]
        self.anchors[key] = state
        self.optimizers[key] = self.torch.optim.SGD(state, lr=lr, momentum=momentum,
                                                    nesterov=nesterov)

    def mix_into(self, level, xs, local):
        a = self.levels[level]["mix"]
        if a == 0:
            return
        for x, xl in zip(xs, local):
            x.copy_(((1 - a) * x.double() + a * xl.double()).to(x.dtype))

    def apply(self, level, fragment, first, means, xs):
        """A' from the group's mean (first sync: of x; else of A - x), then the mix."""
        torch = self.torch
        key = (level, fragment)
        local = [x.detach().clone() for x in xs]
        with torch.no_grad():
            if first:
                self.set_anchor(key, means)
                for x, m in zip(xs, means):
                    x.copy_(m.to(x.dtype))
            else:
                for a, m in zip(self.anchors[key], means):
                    a.grad = m
        if not first:
            self.optimizers[key].step()
            with torch.no_grad():
                for a, x in zip(self.anchors[key], xs):
                    x.copy_(a.detach().to(x.dtype))
        with torch.no_grad():
            self.mix_into(level, xs, local)

    def step(self, params, step, decision):
        torch = self.torch
        all_xs = list(params.values())
        if self.bound is None:
            self.bound = [0.0] * len(all_xs)
        for p in [p for p in self.pending if p[0] == step]:
            self.pending.remove(p)
            _, level, fragment, first, means = p
            owner = split(all_xs, self.levels[level]["fragments"])
            self.apply(level, fragment, first, means,
                       [x for x, f in zip(all_xs, owner) if f == fragment])
        if decision is None:
            return
        level, fragment, first_rank, n = decision
        lv = self.levels[level]
        group = self.groups[(level, first_rank)]
        owner = split(all_xs, lv["fragments"])
        index = [i for i, f in enumerate(owner) if f == fragment]
        xs = [all_xs[i] for i in index]
        with torch.no_grad():
            if lv["outer"] is None:
                for x in xs:
                    x.copy_(self.mean(x, group, n))
                return
            key = (level, fragment)
            first = key not in self.anchors and not any(
                p[1:3] == (level, fragment) for p in self.pending)
            if first:
                means = [self.mean(x.to(state_dtype(torch, x)), group, n) for x in xs]
            else:
                deltas = [a.detach() - x.to(a.dtype) for a, x in zip(self.anchors[key], xs)]
                means = [self.mean(d, group, n) for d in deltas]
                if lv["payload"] != "FP32":
                    # modelavg's deltas differ from these by up to twice the error so far. An
                    # INT8 block may hold several tensors of the fragment: its scale is at most
                    # the fragment's largest |A - x|.
                    m = [self.largest(d, group) + 2 * self.bound[i] for i, d in zip(index, deltas)]
                    for k, i in enumerate(index):
                        if lv["payload"] == "BF16":
                            self.bound[i] += 2.0 ** -7 * m[k]
                        else:
                            self.bound[i] += 2.0 / 254 * max(m)
        if lv["sync_delay"] == 0:
            self.apply(level, fragment, first, means, xs)
        else:
            self.pending.append((step + lv["sync_delay"], level, fragment, first, means))


def job_levels(modelavg, levels):
    out = []
    for lv in levels:
        streaming = {k: lv[k] for k in ("fragments", "sync_delay", "mix", "payload",
                                        "error_feedback", "topk_density")}
        if lv["outer"] is None and streaming == {"fragments": 1, "sync_delay": 0, "mix": 0.0,
                                                 "payload": "FP32", "error_feedback": 0.0,
                                                 "topk_density": 0.0}:
            out.append((lv["period"], lv["group"]))
            continue
        o = lv["outer"]
        sgd = None if o is None else modelavg.OuterSGD(o[0], momentum=o[1], nesterov=o[2])
        out.append(modelavg.Level(lv["period"], lv["group"], outer=sgd, **streaming))
    return out


def make_averager(modelavg, mode, world, warmup, levels, how, job_id, address, rank):
    if how == "dropin":
        import modelavg.torch
        os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": job_id,
                           "RANK": str(rank), "WORLD_SIZE": str(world)})
        (level,) = job_levels(modelavg, levels)
        return modelavg.torch.PeriodicModelAverager(period=level.period, warmup_steps=warmup,
                                                    outer=level)
    if rank == 0:
        job = modelavg.create_job(job_id, world, mode, job_levels(modelavg, levels),
                                  warmup_steps=warmup, coordinator=address)
        if job.spec.levels != job_levels(modelavg, levels):
            raise AssertionError(f"the job's levels came back as {job.spec.levels}")
    client = mt.connect_rank(modelavg, address, job_id, rank)
    cls = (modelavg.PeriodicModelAverager if mode == "periodic"
           else modelavg.HierarchicalModelAverager)
    return cls(client)


def check(torch, step, rank, ours, ref, bound):
    for i, ((name, x), (_, y)) in enumerate(zip(ours.items(), ref.items())):
        diff = (x.double() - y.double()).abs().max().item()
        scale = max(1.0, y.double().abs().max().item())
        allowed = bound[i] * 1.01 + 2e-5 * scale
        if diff > allowed:
            raise AssertionError(f"rank {rank} step {step}: {name} ({x.dtype}) differs from the "
                                 f"PyTorch reference by {diff} (allowed {allowed}):\n modelavg "
                                 f"{x.flatten()[:4].tolist()}\n PyTorch  "
                                 f"{y.flatten()[:4].tolist()}")


def run_rank(rank, name, config, address, store_port, python_dir, out_queue):
    """Compares modelavg with the reference on every step; reports (outer steps, traffic)."""
    try:
        mode, world, warmup, levels, steps, how = config
        import torch
        import torch.distributed as dist
        import modelavg
        mt.join_rank_group(torch, dist, store_port, rank, world)
        reference = Reference(torch, dist, world, levels)
        ours_t, ref_t = make_params(torch, rank, levels), make_params(torch, rank, levels)
        ours_p = mt.as_parameters(torch, ours_t)
        averager = make_averager(modelavg, mode, world, warmup, levels, how,
                                 name.replace("_", "-"), address, rank)
        outer_steps, averaged = 0, set()
        for step in range(steps):
            mt.local_update(torch, ours_t, rank, step)
            mt.local_update(torch, ref_t, rank, step)
            decision = averager.average_parameters(ours_p)
            want = decide(mode, warmup, levels, step, rank)
            got = (decision.level, decision.fragment) if decision.average else None
            if got != (want[:2] if want else None):
                raise AssertionError(f"rank {rank} step {step}: modelavg {decision} (fragment "
                                     f"{decision.fragment}), the rule {want}")
            if want is not None:
                averaged.add(want[0])
                outer_steps += levels[want[0]]["outer"] is not None
            reference.step(ref_t, step, want)
            check(torch, step, rank, ours_t, ref_t, reference.bound)
        if reference.pending and not any(levels[i]["sync_delay"] for i in averaged):
            raise AssertionError("the reference kept a pending sync")
        traffic = averager.traffic()
        if [t.level for t in traffic] != list(range(len(levels))):
            raise AssertionError(f"traffic() has levels {[t.level for t in traffic]}")
        for t in traffic:
            if (t.bytes_sent > 0) != (t.level in averaged) or t.waited_s < 0:
                raise AssertionError(f"rank {rank}: traffic {t}, levels that averaged "
                                     f"{sorted(averaged)}")
            if t.waited_s > 0 and levels[t.level]["sync_delay"] == 0:
                raise AssertionError(f"rank {rank}: {t} waited without a sync_delay")
        dist.barrier()
        dist.destroy_process_group()
        averager.client.leave()
        out_queue.put((rank, outer_steps, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, 0, f"rank {rank}: {type(e).__name__}: {e}"))


def run_payload_rank(rank, name, config, address, store_port, python_dir, out_queue):
    """One job per payload; reports {payload: (bytes after the first sync, waited_s)}."""
    try:
        mode, world, warmup, levels, steps, _ = config
        import torch
        import modelavg
        torch.set_num_threads(1)
        out = {}
        for payload in ("FP32", "BF16", "INT8"):
            lv = [dict(levels[0], payload=payload)]
            params = make_params(torch, rank, lv)
            ps = mt.as_parameters(torch, params)
            averager = make_averager(modelavg, mode, world, warmup, lv, "explicit",
                                     f"{name.replace('_', '-')}-{payload.lower()}", address, rank)
            after_first = None
            for step in range(steps):
                mt.local_update(torch, params, rank, step)
                if rank == SLEEPER and decide(mode, warmup, lv, step, rank) and step > 0:
                    time.sleep(SLEEP_S)  # the others wait for this rank at step + sync_delay
                averager.average_parameters(ps)
                if step == lv[0]["sync_delay"]:  # the first sync (FP32) has been applied
                    after_first = averager.traffic()[0].bytes_sent
            t = averager.traffic()[0]
            out[payload] = (t.bytes_sent - after_first, t.waited_s)
            averager.client.leave()
        out_queue.put((rank, out, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))


def run_checkpoint_rank(rank, name, config, address, store_port, python_dir, out_queue, phase,
                        state_dir):
    """phase "whole": steps 0..steps-1; "first": 0..CHECKPOINT_AT-1, then save; "second": load,
    then CHECKPOINT_AT..steps-1. Reports every step's parameters (as lists)."""
    try:
        mode, world, warmup, levels, steps, _ = config
        at = CHECKPOINT_AT[name]
        import torch
        import modelavg
        torch.set_num_threads(1)
        params = make_params(torch, rank, levels)
        ps = mt.as_parameters(torch, params)
        averager = make_averager(modelavg, mode, world, warmup, levels, "explicit",
                                 f"{name.replace('_', '-')}-{phase}", address, rank)
        path = os.path.join(state_dir, f"rank{rank}.pt")
        first, last = 0, steps
        if phase == "first":
            last = at
        if phase == "second":
            saved = torch.load(path)
            averager.load_state_dict(saved["averager"])
            with torch.no_grad():
                for p, v in zip(ps, saved["params"]):
                    p.copy_(v)
            first = averager.step
            if first != at:
                raise AssertionError(f"rank {rank}: restored step {first}, saved at {at}")
        trace = {}
        for step in range(first, last):
            mt.local_update(torch, params, rank, step)
            averager.average_parameters(ps)
            trace[step] = [p.detach().clone() for p in ps]
        if phase == "first":
            state = averager.state_dict()
            if any(lv["error_feedback"] for lv in levels) and not any(
                    entry.get("residual") for per in state["fragments"].values()
                    for entry in per.values()):
                raise AssertionError(f"rank {rank}: no residual in state_dict at step {at}")
            if not state.get("pending"):
                raise AssertionError(f"rank {rank}: no background all-reduce in flight at step "
                                     f"{at}: the checkpoint proves less than it should")
            if not state.get("fragments") and not any(p["first"] for p in state["pending"]):
                raise AssertionError(f"rank {rank}: state_dict has no fragment state")
            torch.save({"averager": state, "params": [p.detach().clone() for p in ps]}, path)
        averager.client.leave()
        out_queue.put((rank, {s: [t.double().flatten().tolist() for t in v]
                              for s, v in trace.items()}, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank} ({phase}): {type(e).__name__}: {e}"))


def run_checkpoint(name, config, coordinator, group, ctx, args):
    world = config[1]
    state_dir = group.temp_dir("modelavg-streaming-")
    traces = {}
    for phase in ("whole", "first", "second"):
        done, errors = mt.start_ranks(
            ctx, world, run_checkpoint_rank,
            lambda r, q: (r, name, config, coordinator.address, 0, args.python_dir, q, phase,
                          state_dir), args.timeout_s)
        if errors:
            mt.fail(f"{name} ({phase}): {errors[0]}\ncoordinator log:\n{coordinator.log_tail()}")
        traces[phase] = done
    compared = 0
    for r in range(world):
        for step, values in traces["second"][r].items():
            if values != traces["whole"][r][step]:
                mt.fail(f"{name}: rank {r} step {step}: the resumed run differs from the "
                        f"uninterrupted one:\n resumed {values[0][:4]}\n whole   "
                        f"{traces['whole'][r][step][0][:4]}")
            compared += 1
    return (f"{world} ranks resumed at step {CHECKPOINT_AT[name]} (a background all-reduce in "
            f"flight) from state_dict in new processes equal an uninterrupted run ({compared} "
            "rank-steps, exactly)")


def run_payload_bytes(name, config, coordinator, ctx, args):
    world = config[1]
    done, errors = mt.start_ranks(
        ctx, world, run_payload_rank,
        lambda r, q: (r, name, config, coordinator.address, 0, args.python_dir, q),
        args.timeout_s)
    if errors:
        mt.fail(f"{name}: {errors[0]}\ncoordinator log:\n{coordinator.log_tail()}")
    lines = []
    for r in range(world):
        fp32, bf16, int8 = (done[r][p][0] for p in ("FP32", "BF16", "INT8"))
        if fp32 <= 0 or bf16 > 0.55 * fp32 or int8 > 0.30 * fp32:
            mt.fail(f"{name}: rank {r} sent FP32 {fp32}, BF16 {bf16}, INT8 {int8} bytes in its "
                    "outer steps: expected BF16 <= 0.55x and INT8 <= 0.30x of FP32")
        for payload, (_, waited) in done[r].items():
            # The others' calls at s + sync_delay wait out most of the sleeper's sleeps.
            syncs = (config[4] - 1) // config[3][0]["period"]
            if r != SLEEPER and waited < 0.5 * SLEEP_S * syncs:
                mt.fail(f"{name}: rank {r} ({payload}) waited {waited:.2f} s in all for "
                        f"background all-reduces; rank {SLEEPER} slept {SLEEP_S} s before each "
                        f"of its {syncs} sync steps, so it should have waited most of that")
        lines.append(f"rank {r}: FP32 {fp32} B, BF16 {bf16 / fp32:.3f}x, INT8 "
                     f"{int8 / fp32:.3f}x, waited {done[r]['FP32'][1]:.2f} s")
    return "; ".join(lines)


def run(name, args):
    config = CONFIGS[name]
    world = config[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()  # forked from a server that imported torch once
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin,
                                     extra_flags=["--default_heartbeat_timeout_ms=15000"])
        how = config[5]
        if how == "checkpoint":
            summary = run_checkpoint(name, config, coordinator, group, ctx, args)
        elif how == "payload_bytes":
            summary = run_payload_bytes(name, config, coordinator, ctx, args)
        else:
            done = mt.run_world(ctx, world, run_rank, name, config, coordinator,
                                args.python_dir, args.timeout_s, stop_coordinator=False)
            if done[0] == 0:
                mt.fail(f"{name}: no outer-level step: the configuration proves nothing")
            summary = (f"{world} ranks x {config[4]} steps follow the PyTorch reference "
                       f"({done[0]} outer-level averaging steps on rank 0)")
        if coordinator.stop() != 0:
            mt.fail(f"{name}: the coordinator did not stop cleanly:\n{coordinator.log_tail()}")
    print(f"PASS {name}: {summary}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streaming(name, suite_args):
    run(name, suite_args)
