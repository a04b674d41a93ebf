"""The model's and the inner optimizer's arguments that the benchmarks' drivers (bench/lm/run.py,
bench/peers/run.py) take and hand on to bench/lm/worker.py: one definition, so that both
benchmarks train the same work by default."""


def add(p):
    """Adds --d_model, --layers, --context, --batch and --lr to the argparse parser `p`."""
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner optimizer's (AdamW)")


def worker_flags(args):
    """Those arguments as bench/lm/worker.py's flags."""
    return [f"--d_model={args.d_model}", f"--layers={args.layers}", f"--context={args.context}",
            f"--batch={args.batch}", f"--lr={args.lr}"]
