#!/usr/bin/python3
"""The reference trace: PyTorch's own model averagers on the synthetic update.

Runs torch.distributed.algorithms.model_averaging's PeriodicModelAverager or
HierarchicalModelAverager with the Gloo backend in `world_size` processes on 127.0.0.1 and
applies the same synthetic update as `modelavg-trace-worker`:

  * every parameter of rank r starts at r;
  * before the averaging call of step s, (r + 1) * (s + 1) * 0.5 is added to every parameter;
  * after the call, one JSON line is printed:
      {"step": s, "rank": r, "value": <first parameter>, "action": "AVERAGE"|"SKIP", "level": l}
    (level is -1 for SKIP). Lines are sorted by (step, rank).

PyTorch's averagers decide what happens at every step; this script only observes them. Two things
in the installed PyTorch need working around without patching it:

  * `dist.new_subgroups` of PyTorch before 2.x refuses to run without CUDA. With such a PyTorch,
    inside this script only, it is replaced by an equivalent that builds the same consecutive-rank
    subgroups with `dist.new_group` on Gloo; a PyTorch without the check runs its own.
  * `average_parameters` skips parameters whose `.grad` is None, so every parameter gets a zero
    gradient.

Usage:
  torch_reference.py --mode=periodic --world_size=4 --steps=10 --numel=3 \
      --warmup_steps=2 --levels=3:4
  torch_reference.py --mode=hierarchical --world_size=8 --steps=16 --numel=3 \
      --warmup_steps=1 --levels=2:2,4:4,8:8
--levels lists period:group_size pairs in the averager's order (the OrderedDict's order).
"""

import argparse
import collections
import inspect
import json
import multiprocessing
import os
import sys
import traceback
import warnings


def parse_levels(text):
    levels = []
    for item in text.split(","):
        try:
            period, group_size = item.split(":")
            levels.append((int(period), int(group_size)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--levels: '{item}' is not period:group_size (e.g. --levels=2:2,4:4)")
    if not levels:
        raise argparse.ArgumentTypeError("--levels: at least one period:group_size is needed")
    return levels


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["periodic", "hierarchical"], required=True)
    p.add_argument("--world_size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--numel", type=int, default=3)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--levels", type=parse_levels, required=True)
    p.add_argument("--timeout_s", type=float, default=60.0,
                   help="give up (exit 1) if the ranks have not finished by then")
    args = p.parse_args(argv)
    if args.world_size < 1 or args.steps < 0 or args.numel < 1:
        p.error("--world_size and --numel must be >= 1, --steps >= 0")
    if args.mode == "periodic":
        if len(args.levels) != 1 or args.levels[0][1] != args.world_size:
            p.error("--mode=periodic takes exactly one level whose group size is --world_size")
    return args


def gloo_new_subgroups(group_size=None, group=None, timeout=None, backend=None,
                       pg_options=None):
    """What dist.new_subgroups does, without its CUDA check: consecutive blocks of ranks."""
    import torch.distributed as dist
    world = dist.get_world_size()
    if group_size is None or group_size <= 0 or world % group_size != 0:
        raise ValueError(f"group_size {group_size} must divide the world size {world}")
    rank = dist.get_rank()
    mine = None
    subgroups = []
    # Every process must create every group, in the same order.
    for first in range(0, world, group_size):
        ranks = list(range(first, first + group_size))
        sub = dist.new_group(ranks=ranks, backend="gloo")
        subgroups.append(sub)
        if rank in ranks:
            mine = sub
    return mine, subgroups


class RecordingDict(collections.OrderedDict):
    """period -> process group; remembers which period PyTorch's averager looked up last."""

    last_key = None

    def __getitem__(self, key):
        RecordingDict.last_key = key
        return super().__getitem__(key)


def run_rank(rank, args, store_port, out_queue):
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.distributed.algorithms.model_averaging import hierarchical_model_averager
        from torch.distributed.algorithms.model_averaging import utils

        torch.set_num_threads(1)
        warnings.simplefilter("ignore")  # largest period 1 warns, as documented
        store = dist.TCPStore("127.0.0.1", store_port, args.world_size + 1, False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size)
        if "Subgroups can only be created when CUDA" in inspect.getsource(dist.new_subgroups):
            dist.new_subgroups = gloo_new_subgroups  # this process only; PyTorch is untouched

        averaged = []
        original_average = utils.average_parameters_or_parameter_groups

        def recording_average(params, process_group):
            averaged.append(True)
            return original_average(params, process_group)

        utils.average_parameters_or_parameter_groups = recording_average

        if args.mode == "periodic":
            averager = averagers.PeriodicModelAverager(
                period=args.levels[0][0], warmup_steps=args.warmup_steps)
        else:
            averager = hierarchical_model_averager.HierarchicalModelAverager(
                period_group_size_dict=collections.OrderedDict(args.levels),
                warmup_steps=args.warmup_steps)
            recording = RecordingDict(averager.period_process_group_dict)
            averager.period_process_group_dict = recording
        periods = [p for p, _ in args.levels]

        param = torch.nn.Parameter(torch.full((args.numel,), float(rank), dtype=torch.float32))
        param.grad = torch.zeros_like(param)  # else average_parameters skips it
        model_params = [param]
        lines = []
        for step in range(args.steps):
            with torch.no_grad():
                param.add_((rank + 1) * (step + 1) * 0.5)
            averaged.clear()
            RecordingDict.last_key = None
            averager.average_parameters(model_params)
            if averaged:
                if args.mode == "periodic":
                    level = 0
                else:
                    level = periods.index(RecordingDict.last_key)
                action = "AVERAGE"
            else:
                level, action = -1, "SKIP"
            lines.append({"step": step, "rank": rank, "value": float(param.data[0]),
                          "action": action, "level": level})
        dist.barrier()
        dist.destroy_process_group()
        out_queue.put((rank, lines, None))
    except Exception as e:  # reported by the parent as one line
        traceback.print_exc()
        out_queue.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}"))


def main(argv):
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    # The parent holds the rendezvous store on a port the kernel picked: no port races.
    store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, True, wait_for_workers=False)
    # forkserver, its server importing torch once: not a fork of this process, whose store
    # server runs threads (a rank forked while one of them held a lock hung, now and then, before
    # it printed anything).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args, store.port, queue), daemon=True)
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = {}
    errors = []
    import queue as queue_module
    try:
        for _ in procs:
            rank, lines, error = queue.get(timeout=args.timeout_s)
            if error:
                errors.append(error)
                break
            results[rank] = lines
    except queue_module.Empty:
        errors.append(f"timed out after {args.timeout_s} s waiting for the ranks "
                      f"(finished: {sorted(results)})")
    for p in procs:
        p.join(timeout=5 if not errors else 0.5)
        if p.is_alive():
            p.kill()
    if errors:
        print("torch_reference: " + errors[0], file=sys.stderr)
        return 1
    all_lines = [line for r in sorted(results) for line in results[r]]
    all_lines.sort(key=lambda d: (d["step"], d["rank"]))
    for line in all_lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
