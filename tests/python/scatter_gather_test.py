"""``gloo_scatter_max_bytes`` reaches the averaging rounds (one CTest test).

Starts a coordinator and, twice, a PERIODIC job of three workers (the explicit API:
modelavg.connect + PeriodicModelAverager, one float32 tensor of 200,003 random values each, about
800 KB: above the 256 KiB of the direct exchange, Gloo on 127.0.0.1), each averaging twice. With
``gloo_scatter_max_bytes=16 MiB`` the rounds go through the scatter-gather exchange, whose mean is
the checked sum in member order (``check_finite``, on by default: each contribution divided,
then added), in float32: every rank's result must equal ``(x0 / 3 + x1 / 3) + x2 / 3`` restated
with torch, bit for bit. Without it (the default) they go through
Gloo's ring, which sums in another order: the result is the mean within float32 rounding, the same
on every rank, and (this test's proof that it tells the two apart) not that restatement in every
element.

  pytest tests/python/scatter_gather_test.py      (conftest.py: which build)
"""

import os
import sys
import textwrap

import modelavg_testing as mt

WORLD = 3
NUMEL = 200003
ROUNDS = 2

WORKER = """
    import os, time
    import torch
    import modelavg

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    scatter = int(os.environ["SCATTER"])
    client = modelavg.connect(os.environ["ADDR"], os.environ["JOB"], rank=rank,
                              collective_timeout=30, gloo_scatter_max_bytes=scatter)
    averager = modelavg.PeriodicModelAverager(client)
    g = torch.Generator().manual_seed(100 + rank)
    p = torch.nn.Parameter(torch.randn(int(os.environ["NUMEL"]), generator=g,
                                       dtype=torch.float32))
    p.grad = torch.zeros_like(p)
    saved = []
    for step in range(int(os.environ["ROUNDS"])):
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32))
        pre = p.detach().clone()
        d = averager.average_parameters([p])
        assert d.average, f"step {d.step} did not average"
        saved.append((pre, p.detach().clone()))
    torch.save(saved, os.environ["OUT"])
    time.sleep(0.5)
    client.leave()
"""


def run_job(args, group, addr, job, scatter):
    import modelavg
    import torch
    modelavg.create_job(job, WORLD, "PERIODIC", period=1, heartbeat_timeout_ms=3000,
                        coordinator=addr)
    work = group.temp_dir("modelavg-scatter-py-")
    code = textwrap.dedent(WORKER)
    procs, outs, logs = [], [], []
    for r in range(WORLD):
        outs.append(os.path.join(work, f"rank{r}.pt"))
        logs.append(os.path.join(work, f"rank{r}.log"))
        env = dict(os.environ, PYTHONPATH=args.python_dir, ADDR=addr, JOB=job, RANK=str(r),
                   SCATTER=str(scatter), NUMEL=str(NUMEL), ROUNDS=str(ROUNDS), OUT=outs[r])
        log = open(logs[r], "w")
        procs.append(group.start([sys.executable, "-c", code], f"{job}-rank{r}", env=env,
                                 stdout=log, stderr=log))
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=args.timeout_s)
        except Exception:  # subprocess.TimeoutExpired
            mt.fail(f"{job}: rank {r} did not finish within {args.timeout_s} s:\n"
                    f"{open(logs[r]).read()[-3000:]}")
        if p.returncode != 0:
            mt.fail(f"{job}: rank {r} exited {p.returncode}:\n{open(logs[r]).read()[-3000:]}")
    return [torch.load(o) for o in outs]


def member_order_mean(pres):
    """The checked rule restated: (x0 / 3 + x1 / 3) + x2 / 3, each operation in float32."""
    n = len(pres)
    acc = pres[0] / n + pres[1] / n
    for x in pres[2:]:
        acc = acc + x / n
    return acc


def test_scatter_gather_option(suite_args):
    import torch
    if "MODELAVG_TEST_TIMEOUT_S" not in os.environ:
        suite_args.timeout_s = 60
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, suite_args.coordinator_bin)
        addr = coordinator.address
        exchange = run_job(suite_args, group, addr, "scatter-on", 16 << 20)
        ring = run_job(suite_args, group, addr, "scatter-off", 0)
        if coordinator.stop() != 0:
            mt.fail("the coordinator did not stop cleanly")
    differing = 0
    for name, results in (("scatter-gather", exchange), ("ring", ring)):
        for step in range(ROUNDS):
            pres = [results[r][step][0] for r in range(WORLD)]
            want = member_order_mean(pres)
            for r in range(WORLD):
                got = results[r][step][1]
                if not torch.equal(got, results[0][step][1]):
                    mt.fail(f"{name}, round {step}: rank {r}'s result differs from rank 0's")
                if name == "scatter-gather":
                    if not torch.equal(got, want):
                        bad = (got != want).nonzero()[0].item()
                        mt.fail(f"scatter-gather, round {step}, rank {r}: element {bad} is "
                                f"{got[bad].item()!r}, the checked sum in member order is "
                                f"{want[bad].item()!r}")
                elif not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    mt.fail(f"ring, round {step}, rank {r}: not the mean of the ranks' values")
            if name == "ring":
                differing += int((results[0][step][1] != want).sum().item())
    if differing == 0:
        mt.fail("Gloo's ring gave the member-order sum in every element: this test cannot tell "
                "the scatter-gather exchange from it")
    print(f"PASS gloo_scatter_max_bytes: scatter-gather bit for bit on {WORLD} ranks, "
          f"{ROUNDS} rounds; the ring differs from it in {differing} elements")
