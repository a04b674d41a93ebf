"""Error feedback from Python (``modelavg.Level(..., payload="TOPK", topk_density=...,
error_feedback=...)``, docs/streaming.md "Error feedback"): what it is for, shown.

Each of W processes holds one float32 tensor of 256 coordinates of three magnitudes: 64 of
scale 1, 96 of 1e-2 and 96 of 1e-3. For the first 16 steps every rank adds to each coordinate a
fixed delta of the coordinate's scale (different per rank, step and coordinate); then nothing,
for 80 steps more. The job, one outer level of the world every 2 steps with lr 1 and momentum 0
(the anchor steps by the mean of what is sent), runs four times in the same processes: FP32,
TOPK at density 32/1024 (the 32 largest |U| of the tensor's one block a sync) without feedback,
TOPK with error feedback 1, and INT4 with error feedback 1. Each rank records its parameters
after every sync (the anchor: mix 0), its residual from ``state_dict()`` at the end, and
``traffic()``.

* Without feedback the top-k is taken from the scale-1 coordinates at every sync: the anchors of
  the 192 smaller coordinates stay exactly at their first sync's values, every sync, every rank,
  while the FP32 run moves every one of them.
* With feedback every coordinate's final anchor is within the documented bound of the FP32
  run's: |A - A_fp32| <= mean over the members of |E| (their final residuals) + 2^-8 * the sum
  over the syncs of |D^| (D^ the averaged pseudo-gradient, read off the anchors: the bfloat16
  rounding of the mean is not fed back), plus float32 rounding; and within 1% of how far the
  FP32 run moved it.
* ``traffic()`` counts the compressed bytes: after the first sync (FP32 in every run) TOPK sends
  at most 0.5x and INT4 at most 0.2x of FP32's bytes.

  pytest tests/python/feedback_test.py ["-k NAME"]      (conftest.py: which build)
"""

import os
import traceback

import pytest

import modelavg_testing as mt

N, BIG, SMALL_SCALES = 256, 64, (1e-2, 1e-3)
PERIOD, MOVING_STEPS, STEPS = 2, 16, 96
K = 32  # entries a block: topk_density K / 1024 of the 1024-element block; the tensor is shorter
RUNS = [("fp32", dict(payload="FP32")),
        ("topk", dict(payload="TOPK", topk_density=K / 1024)),
        ("topk_ef", dict(payload="TOPK", topk_density=K / 1024, error_feedback=1.0)),
        ("int4_ef", dict(payload="INT4", error_feedback=1.0))]
CONFIGS = {"w2": 2, "w4": 4}


def scales():
    return [1.0] * BIG + [SMALL_SCALES[i % 2] for i in range(N - BIG)]


def delta(torch, rank, step):
    """Rank `rank`'s update before the call of `step` (float64)."""
    if step >= MOVING_STEPS:
        return torch.zeros(N, dtype=torch.float64)
    i = torch.arange(N, dtype=torch.float64)
    sign = 1 - 2 * (torch.arange(N) % 3 == 0).double()
    return (torch.tensor(scales(), dtype=torch.float64) * (1 + 0.5 * rank) *
            (1 + torch.remainder(7 * i + step, 5) / 5) * sign)


def run_rank(rank, name, world, address, out_queue):
    """Reports {run: (anchors after each sync [[float]], residual [float] or None, bytes sent
    after the first sync)}."""
    try:
        import torch
        import modelavg
        torch.set_num_threads(1)
        out = {}
        for run, fields in RUNS:
            job_id = f"feedback-{name}-{run.replace('_', '-')}"
            if rank == 0:
                level = modelavg.Level(PERIOD, world, outer=modelavg.OuterSGD(1.0), **fields)
                modelavg.create_job(job_id, world, "periodic", [level], coordinator=address)
            averager = modelavg.PeriodicModelAverager(
                mt.connect_rank(modelavg, address, job_id, rank))
            x = torch.zeros(N, dtype=torch.float32)
            params = mt.as_parameters(torch, {"x": x})
            anchors, after_first = [], None
            for step in range(STEPS):
                with torch.no_grad():
                    params[0].add_(delta(torch, rank, step).float())
                decision = averager.average_parameters(params)
                if decision.average != (step % PERIOD == 0):
                    raise AssertionError(f"rank {rank} {run} step {step}: {decision}")
                if decision.average:
                    anchors.append(params[0].detach().double().tolist())
                if step == 0:
                    after_first = averager.traffic()[0].bytes_sent
            state = averager.state_dict()
            residual = None
            if fields.get("error_feedback"):
                (entry,) = state["fragments"][0].values()
                (e,) = entry["residual"]
                residual = e.double().tolist()
            out[run] = (anchors, residual, averager.traffic()[0].bytes_sent - after_first)
            averager.client.leave()
        out_queue.put((rank, out, None))
    except Exception as e:
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))


def check(name, world, done):
    scale = scales()
    fp32 = done[0]["fp32"][0]
    first, last = fp32[0], fp32[-1]
    moved = [abs(last[i] - first[i]) for i in range(N)]
    if min(moved[BIG:]) < 1e-3 * min(SMALL_SCALES):
        mt.fail(f"{name}: the FP32 run hardly moved a small coordinate: the test proves nothing")
    # Every member ends each sync with the same anchor, whatever the payload.
    for run, _ in RUNS:
        for r in range(1, world):
            if done[r][run][0] != done[0][run][0]:
                mt.fail(f"{name}: {run}: rank {r}'s anchors differ from rank 0's")
    # Without feedback the smaller coordinates never move; the largest do.
    plain = done[0]["topk"][0]
    for t, anchor in enumerate(plain):
        for i in range(BIG, N):
            if anchor[i] != plain[0][i]:
                mt.fail(f"{name}: topk without feedback: coordinate {i} (scale {scale[i]}) moved "
                        f"from {plain[0][i]} to {anchor[i]} at sync {t}: its |U| made the top "
                        f"{K} of the block")
    if not any(plain[-1][i] != plain[0][i] for i in range(BIG)):
        mt.fail(f"{name}: topk without feedback moved nothing")
    # With feedback: within the documented bound of the FP32 run, every coordinate.
    ef = done[0]["topk_ef"][0]
    worst = 0.0
    for i in range(N):
        sent = sum(abs(ef[t - 1][i] - ef[t][i]) for t in range(1, len(ef)))
        residual = sum(abs(done[r]["topk_ef"][1][i]) for r in range(world)) / world
        rounding = 2.0 ** -23 * len(ef) * max(abs(a[i]) for a in ef + fp32)
        bound = 1.01 * (residual + 2.0 ** -8 * sent) + rounding
        gap = abs(ef[-1][i] - last[i])
        if gap > bound or gap > 0.01 * moved[i]:
            mt.fail(f"{name}: topk with feedback: coordinate {i} (scale {scale[i]}) ends at "
                    f"{ef[-1][i]}, the FP32 run at {last[i]} (moved {moved[i]} from {first[i]}):"
                    f" {gap} apart, the bound {bound} (residual {residual}, sum |D^| {sent}), "
                    f"1% of the move {0.01 * moved[i]}")
        worst = max(worst, gap / moved[i])
    # traffic(): the compressed bytes.
    ratios = {}
    for run in ("topk", "topk_ef", "int4_ef"):
        sent = sum(done[r][run][2] for r in range(world))
        base = sum(done[r]["fp32"][2] for r in range(world))
        ratios[run] = sent / base
        limit = 0.2 if run.startswith("int4") else 0.5
        if base <= 0 or sent <= 0 or ratios[run] > limit:
            mt.fail(f"{name}: {run} sent {sent} bytes after the first sync, FP32 {base}: "
                    f"expected more than 0 and at most {limit}x")
    return (f"without feedback {N - BIG} small coordinates stayed at their first anchor; with "
            f"feedback every coordinate within the bound of the FP32 run (at most "
            f"{100 * worst:.3f}% of its move); bytes vs FP32: "
            + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_feedback(name, suite_args):
    world = CONFIGS[name]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mt.rank_context()
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, suite_args.coordinator_bin)
        done, errors = mt.start_ranks(
            ctx, world, run_rank, lambda r, q: (r, name, world, coordinator.address, q),
            suite_args.timeout_s)
        if errors:
            mt.fail(f"{name}: {errors[0]}\ncoordinator log:\n{coordinator.log_tail()}")
        summary = check(name, world, done)
        if coordinator.stop() != 0:
            mt.fail(f"{name}: the coordinator did not stop cleanly:\n{coordinator.log_tail()}")
    print(f"PASS {name}: {summary}")
