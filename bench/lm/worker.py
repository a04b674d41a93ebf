#!/usr/bin/python3
"""One worker of the language-model benchmark (bench/lm/run.py starts four, one per host).

Trains a small character-level transformer on the training split of the corpus, communicating
as its mode says (modes.py), and writes one JSON line per evaluation to --out:
``{"step", "seconds", "val_loss", "train_loss", "after_step_seconds", "bytes_sent", "round"}``
where seconds is the training time so far (wall clock since the first step, less the time this
rank spent evaluating), after_step_seconds the part of it spent in the mode's after-step call
(the averagers' whole cost; DDP communicates inside backward, so 0 there), bytes_sent the bytes
this rank handed to the transport per averaging level (modelavg's traffic(); null for the other
modes) and round the last level's last round (below). Only rank 0
evaluates; the others write their step times. It stops before the step named in the stop file
(--stop_file, written by rank 0 once the target is reached, see run.py) or at --max_steps.

A paced mode (modes.py: ``paced``; docs/paced.md) gives each group of ranks its own sync steps,
so no step count is reached by every rank: there the stop file names a ROUND of the paced level
(rank 0's last round + 1, written once the target is reached or rank 0 has run --max_steps),
and every rank stops right after the averaging call whose decision's ``round`` is that one
(every member ends after the same round; none waits for a round that never comes). No rank can
finish that round before the file exists: rank 0 writes it before it enters the round.

--slow_factor F > 1 makes the rank F times slower: after each optimizer step it sleeps F - 1
times that step's own compute (forward, backward, optimizer step). With --util_out, every rank
appends a JSON line every --util_every of its steps, after each round of the last level and at
its end: ``{"step", "wall", "compute", "round"}``: wall the seconds since its first step less its
own evaluations, compute the part of it outside the mode's after-step call (the injected sleep
included: it stands for a slower machine), round the last level's last round from 0 (paced:
Decision.round; step-locked modelavg modes: its averages counted; -1: none yet, or a mode
without decisions); compute / wall is the rank's utilization.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import model as lm  # noqa: E402
import modes  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", required=True, choices=sorted(modes.MODES))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world_size", type=int, required=True)
    p.add_argument("--address", required=True, help="this host's data address")
    p.add_argument("--master", required=True, help="rank 0's data address (torch.distributed)")
    p.add_argument("--coordinator", default="", help="modelavg coordinator HOST:PORT")
    p.add_argument("--job", default="lm-bench")
    p.add_argument("--corpus", required=True, help="the corpus cache (corpus.py)")
    p.add_argument("--out", required=True)
    p.add_argument("--stop_file", required=True)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--eval_every", type=int, default=32)
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--target_loss", type=float, required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--diloco_period", type=int, default=32, help="diloco mode's outer period")
    p.add_argument("--diloco_site_period", type=int, default=2,
                   help="diloco mode's period inside a site")
    p.add_argument("--outer_lr", type=float, default=0.7, help="diloco mode's outer lr")
    p.add_argument("--outer_momentum", type=float, default=0.9,
                   help="diloco mode's outer Nesterov momentum")
    p.add_argument("--topk_density", type=float, default=0.02,
                   help="the diloco_topk* modes' Level.topk_density")
    p.add_argument("--stop_period", type=int, default=32,
                   help="stop at a multiple of this (the largest averaging period)")
    p.add_argument("--slow_factor", type=float, default=1.0,
                   help="run this many times slower: sleep (F - 1) x each step's compute")
    p.add_argument("--util_out", default="",
                   help="append {step, wall, compute, round} lines here (utilization)")
    p.add_argument("--util_every", type=int, default=16, help="a --util_out line every N steps")
    args = p.parse_args()

    torch.set_num_threads(1)
    data = corpus.load(args.corpus)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    net = lm.CharTransformer(vocab=corpus.VOCAB, context=args.context, d_model=args.d_model,
                             layers=args.layers, heads=args.heads)
    mode = modes.MODES[args.mode](args)
    net = mode.wrap(net)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    mode.attach(net, opt)  # modes that hook the optimizer (torchft's DiLoCo, bench/peers)
    # Each rank its own batches; the seed moves them too (seed 1: the streams of earlier runs).
    gen = torch.Generator().manual_seed(1000 * args.seed + args.rank)
    val = corpus.batches(data["val"], args.eval_batches, args.batch, args.context,
                         torch.Generator().manual_seed(7))

    out = open(args.out, "w")

    def emit(**kv):
        out.write(json.dumps(kv) + "\n")
        out.flush()

    util = open(args.util_out, "w") if args.util_out else None
    util_last = [-1]  # the step of the last --util_out line

    def emit_util():
        util_last[0] = done
        wall = time.monotonic() - start - eval_seconds
        util.write(json.dumps(dict(step=done, wall=wall, compute=wall - after_seconds,
                                   round=last_round)) + "\n")
        util.flush()

    def write_stop(value):
        tmp = args.stop_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(value))
        os.replace(tmp, args.stop_file)

    paced = getattr(mode, "paced", False)
    start = time.monotonic()
    eval_seconds = 0.0
    after_seconds = 0.0
    # Paced: no step count is common to the ranks; the stop is a round (stop_round), and
    # stop_at is set to the step after which that round was taken.
    stop_at = (1 << 62) if paced else args.max_steps  # steps to run (a count)
    stop_round = None
    # The last level's last round taken: paced, Decision.round; step-locked, the last level's
    # averages counted from 0 (modelavg's modes). -1: none yet.
    last_round = -1
    top_level = len(mode.levels(args)) - 1
    done = 0
    while done < stop_at:
        i = done  # this step's index, from 0; the averagers average after index i's update
        x, y = corpus.batch(data["train"], args.batch, args.context, gen)
        c0 = time.monotonic()
        loss = net(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.slow_factor > 1:
            time.sleep((args.slow_factor - 1) * (time.monotonic() - c0))
        a0 = time.monotonic()
        decision = mode.after_step(net, i)
        after_seconds += time.monotonic() - a0
        if i == 0:
            first_bytes = mode.bytes_sent()  # step 0's rounds: an outer level's first sync
        done += 1
        if paced:
            taken = getattr(decision, "round", -1)
        elif getattr(decision, "average", False) and decision.level == top_level:
            taken = last_round + 1  # step-locked: the last level's averages, counted
        else:
            taken = -1
        if taken >= 0:
            last_round = taken
        if paced:
            if stop_round is None and args.rank != 0 and os.path.exists(args.stop_file):
                with open(args.stop_file) as f:
                    stop_round = int(f.read())
            if stop_round is not None and taken >= 0 and taken >= stop_round:
                if taken > stop_round:
                    raise SystemExit(f"rank {args.rank}: took round {taken}, past the stop "
                                     f"after round {stop_round}")
                stop_at = done
            if args.rank == 0 and stop_round is None and done >= args.max_steps:
                stop_round = last_round + 1  # not reached: the run ends at the next round
                write_stop(stop_round)
        if util is not None and (done % args.util_every == 0 or taken >= 0):
            emit_util()  # and at each outer round: its steps and times exactly
        if args.rank == 0 and ((i > 0 and i % args.eval_every == 0) or done == stop_at):
            e0 = time.monotonic()
            v = lm.evaluate(mode.module(net), val)
            eval_seconds += time.monotonic() - e0
            emit(step=done, seconds=time.monotonic() - start - eval_seconds, val_loss=v,
                 train_loss=float(loss), after_step_seconds=after_seconds,
                 bytes_sent=mode.bytes_sent(), bytes_at_step0=first_bytes, round=last_round)
            if not math.isfinite(v):
                raise SystemExit(f"rank 0: validation loss is {v} at step {done}")
            if paced and v <= args.target_loss and stop_round is None:
                # Every rank stops after the paced level's next round: rank 0 has not entered
                # it yet, so no rank can have finished it before this file exists.
                stop_round = last_round + 1
                write_stop(stop_round)
            elif not paced and v <= args.target_loss and stop_at == args.max_steps:
                # Every rank stops at the same count, just after the next step that
                # synchronises all ranks (index i + stop_period): no rank can pass that step
                # before this file exists, and every rank reads it after each step.
                stop_at = min(args.max_steps, done + args.stop_period)
                write_stop(stop_at)
        elif (not paced and args.rank != 0 and stop_at == args.max_steps
              and os.path.exists(args.stop_file)):
            with open(args.stop_file) as f:
                stop_at = int(f.read())
            if stop_at < done:
                if mode.synchronous:
                    raise SystemExit(f"rank {args.rank}: already {done} steps done, past the "
                                     f"stop at {stop_at}")
                stop_at = done  # no communication: stop where it is
    if util is not None and util_last[0] != done:
        emit_util()  # the last line: the whole run
    if args.rank != 0:
        emit(step=done, seconds=time.monotonic() - start, round=last_round)
    mode.close()


if __name__ == "__main__":
    main()
