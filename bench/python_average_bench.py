#!/usr/bin/python3
"""The Python package's averaging next to PyTorch's own, on the same tensors in the same run.

Starts a coordinator and `--world` processes (CPU, Gloo process group on 127.0.0.1). Each holds
`--tensors` float32 parameters of `--mib` MiB in all and, alternating iteration by iteration,
averages them with

  * modelavg:  modelavg.torch.PeriodicModelAverager(period=1).average_parameters(params)
  * PyTorch:   torch.distributed.algorithms.model_averaging.utils.average_parameters(params,
               group.WORLD) — what PyTorch's averagers call on an averaging step

with a barrier before each call; a call's time is the slowest rank's. Then it measures the cost
of a skip step (no averaging) of modelavg's Python layer, of the C++ binding alone, and of
PyTorch's averager. Prints one JSON line:

  world, tensors, mib, iters, modelavg_average_s, torch_average_s (medians),
  speedup (torch / modelavg), modelavg_outer_s (an outer step of a DiLoCo job on the same
  tensors: modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True)), outer_over_plain, skip_us (modelavg.torch averager), skip_core_us (the binding's
  take_skip alone), torch_skip_us (PyTorch's PeriodicModelAverager)

  PYTHONPATH=build/python python3 bench/python_average_bench.py \\
      --coordinator_bin=build/server/modelavg-coordinator
"""

import argparse
import json
import os
import queue as queue_module
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "tools"))
import modelavg_testing as mt  # noqa: E402


def run_rank(rank, args, address, store_port, out):
    try:
        os.environ.update({"MODELAVG_COORDINATOR": address, "MODELAVG_JOB": "bench-average",
                           "RANK": str(rank), "WORLD_SIZE": str(args.world)})
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.model_averaging import averagers, utils
        import modelavg
        import modelavg.torch
        import warnings
        warnings.simplefilter("ignore")  # period 1 warns, as in PyTorch

        store = dist.TCPStore("127.0.0.1", store_port, args.world + 1, False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world)
        numel = max(1, args.kib * 1024 // 4 // args.tensors)
        params = [torch.nn.Parameter(torch.full((numel,), float(rank + i % 7)))
                  for i in range(args.tensors)]
        for p in params:
            p.grad = torch.zeros(1).expand(numel)  # only "is not None" matters; no memory

        modes = args.modes.split(",")
        calls = {}
        if "modelavg" in modes:
            ours = modelavg.torch.PeriodicModelAverager(period=1)
            calls["modelavg"] = lambda: ours.average_parameters(params)
        if "elastic" in modes:
            # An elastic job (min_world_size 1): every round is committed.
            modelavg.torch.set_options(job_id="bench-elastic", min_world_size=1)
            elastic = modelavg.torch.PeriodicModelAverager(period=1)
            calls["elastic"] = lambda: elastic.average_parameters(params)
            modelavg.torch.set_options(min_world_size=0)
        if "outer" in modes:
            # DiLoCo on the same tensors: a job whose level has an outer optimizer (its first
            # call, in the warm-up, is the plain average that sets the anchor).
            modelavg.torch.set_options(job_id="bench-outer")
            outer = modelavg.torch.PeriodicModelAverager(
                period=1, outer=modelavg.OuterSGD(0.7, momentum=0.9, nesterov=True))
            calls["outer"] = lambda: outer.average_parameters(params)
        if "torch" in modes:
            calls["torch"] = lambda: utils.average_parameters(iter(params), dist.group.WORLD)
        if "raw" in modes:
            flat = torch.zeros(numel * args.tensors)
            calls["raw"] = lambda: dist.all_reduce(flat)
        times = {name: [] for name in calls}
        for it in range(args.warmup + args.iters):
            for name, call in calls.items():
                dist.barrier()
                start = time.perf_counter()
                call()
                took = time.perf_counter() - start
                if it >= args.warmup:
                    times[name].append(took)
        # The slowest rank per iteration.
        for name in times:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name] = t.tolist()

        skips = {}
        if args.skip_calls > 0:
            # Skip steps: an averager whose warm-up never ends.
            modelavg.torch.set_options(job_id="bench-skip")
            skip = modelavg.torch.PeriodicModelAverager(period=4, warmup_steps=10 ** 12)
            theirs = averagers.PeriodicModelAverager(period=4, warmup_steps=10 ** 12)
            n = args.skip_calls

            def per_call_us(fn):
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(n):
                        fn()
                    best = min(best, (time.perf_counter() - start) / n * 1e6)
                return best

            skips = {"skip_us": per_call_us(lambda: skip.average_parameters(params)),
                     "skip_core_us": per_call_us(skip._core.take_skip),
                     "torch_skip_us": per_call_us(lambda: theirs.average_parameters(params))}
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, dict(times=times, **skips), None))
    except Exception as e:
        traceback.print_exc()
        out.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator_bin", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--kib", type=int, default=0, help="the size in KiB instead of --mib")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip_calls", type=int, default=20000,
                   help="calls per measurement of a skip step's cost (0: not measured)")
    p.add_argument("--modes", default="modelavg,torch,outer",
                   help="comma-separated, timed in this order each iteration: modelavg (the "
                        "drop-in, strict job), elastic (the drop-in in an elastic job: committed "
                        "rounds), outer (DiLoCo), torch (PyTorch's average_parameters), raw "
                        "(torch.distributed.all_reduce of one flat buffer of the same size)")
    args = p.parse_args()
    if args.kib <= 0:
        args.kib = args.mib * 1024
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    with mt.ProcessGroup() as group:
        coordinator = mt.Coordinator(group, args.coordinator_bin)
        store = dist.TCPStore("127.0.0.1", 0, args.world + 1, True, wait_for_workers=False)
        ctx = mt.rank_context()  # not a fork of this process: its store server runs threads
        out = ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, args, coordinator.address, store.port,
                                                    out), daemon=True)
                 for r in range(args.world)]
        for proc in procs:
            proc.start()
        results = {}
        try:
            for _ in procs:
                rank, result, error = out.get(timeout=600)
                if error:
                    mt.fail(error)
                results[rank] = result
        except queue_module.Empty:
            mt.fail("the benchmark's ranks did not finish within 600 s")
        for proc in procs:
            proc.join(timeout=10)
        coordinator.stop()
    r0 = results[0]
    med = {name: statistics.median(t) for name, t in r0["times"].items()}
    out = {"world": args.world, "tensors": args.tensors, "mib": args.kib / 1024, "iters": args.iters}
    for name, key in (("modelavg", "modelavg_average_s"), ("torch", "torch_average_s"),
                      ("elastic", "elastic_average_s"), ("outer", "modelavg_outer_s"),
                      ("raw", "raw_allreduce_s")):
        if name in med:
            out[key] = round(med[name], 6)
    if "modelavg" in med and "torch" in med:
        out["speedup"] = round(med["torch"] / med["modelavg"], 3)
    if "modelavg" in med and "elastic" in med:
        out["elastic_over_plain"] = round(med["elastic"] / med["modelavg"], 3)
    if "modelavg" in med and "outer" in med:
        out["outer_over_plain"] = round(med["outer"] / med["modelavg"], 3)
    if "modelavg" in med and "raw" in med:
        out["raw_over_modelavg"] = round(med["raw"] / med["modelavg"], 3)
    if args.skip_calls > 0:
        for key in ("skip_us", "skip_core_us", "torch_skip_us"):
            out[key] = round(max(r[key] for r in results.values()), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
