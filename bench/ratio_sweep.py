#!/usr/bin/python3
"""Averaging against its baselines over sizes and tensor counts, in one run.

For each world size of --worlds and each (size, tensors) of --grid it runs

  * modelavg-bench-average --phases=average,raw: the C++ call against one raw Gloo all-reduce
    of a flat buffer of the same size (the ratio printed: raw's time / the call's);
  * python_average_bench.py --modes=modelavg,torch,raw: the Python drop-in against PyTorch's
    average_parameters (torch's time / the drop-in's) and a raw torch all_reduce (raw's time /
    the drop-in's);

prints one JSON line per run, then a table of the ratios against size with a bar per ratio (one
'#' per 0.1; '|' marks 1.0). A ratio above 1.0: modelavg is the faster. Each grid point also
gets a "ratios" JSON line, which bench/ratio_plot.py reads; --png=PATH draws the plot at the end
(matplotlib).

  python3 bench/ratio_sweep.py --build=build [--worlds=2,4] [--grid=4:1,1024:16,131072:64] \
      [--png=ratio_sweep.png [--png_note="load average ..."]]

Grid entries are KIB:TENSORS. The Python runs need torch (Debian's python3-torch: run this with
/usr/bin/python3 where another python3 comes first).
"""

import argparse
import json
import os
import subprocess
import sys

import ratio_plot

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GRID = ("4:1,64:1,64:16,1024:1,1024:16,1024:256,16384:16,16384:256,"
                "131072:64,262144:64")


def last_json(cmd, env=None):
    """The last JSON line `cmd` prints, or {"error": ...}."""
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                             check=False)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}


def iters_for(kib):
    """Enough calls for a median at small sizes, few at large ones."""
    if kib <= 1024:
        return 60
    if kib <= 16384:
        return 15
    return 4


def bar(ratio):
    """'#' per 0.1 of `ratio` (at most 4.0), with '|' after the tenth: 1.0."""
    if not isinstance(ratio, (int, float)) or ratio <= 0:
        return "-"
    n = min(int(round(ratio * 10)), 40)
    cells = list("#" * n + " " * max(0, 10 - n))
    cells.insert(10, "|")
    return "".join(cells).rstrip()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--grid", default=DEFAULT_GRID)
    p.add_argument("--no_python", action="store_true", help="the C++ runs only")
    p.add_argument("--png", default="", help="also plot the ratios against size to this PNG")
    p.add_argument("--png_note", default="", help="a line under the plot's title")
    args = p.parse_args()
    grid = [tuple(int(x) for x in e.split(":")) for e in args.grid.split(",")]
    bench = os.path.join(args.build, "bench", "modelavg-bench-average")
    coordinator = os.path.join(args.build, "server", "modelavg-coordinator")
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build, "python"))
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        for kib, tensors in grid:
            numel = max(tensors, kib * 1024 // 4)
            iters = iters_for(kib)
            cpp = last_json([bench, f"--world={world}", f"--numel={numel}",
                             f"--tensors={tensors}", f"--iters={iters}", "--warmup=3",
                             "--phases=average,raw"])
            print(json.dumps({"run": "cpp", **cpp}), flush=True)
            py = {}
            if not args.no_python:
                py = last_json([sys.executable, os.path.join(HERE, "python_average_bench.py"),
                                f"--coordinator_bin={coordinator}", f"--world={world}",
                                f"--kib={kib}", f"--tensors={tensors}", f"--iters={iters}",
                                "--warmup=3", "--skip_calls=0", "--modes=modelavg,torch,raw"],
                               env=env)
                print(json.dumps({"run": "python", **py}), flush=True)
            rows.append((world, kib, tensors, cpp.get("raw_over_average"), py.get("speedup"),
                         py.get("raw_over_modelavg")))
            print(json.dumps({"run": "ratios", "world": world, "kib": kib, "tensors": tensors,
                              "cpp_raw_over_average": rows[-1][3],
                              "python_torch_over_modelavg": rows[-1][4],
                              "python_raw_over_modelavg": rows[-1][5]}), flush=True)
    print()
    print("W  size      tensors  C++/raw  Python/PyTorch  Python/raw")
    for world, kib, tensors, c, s, r in rows:
        size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
        fmt = lambda v: f"{v:5.2f}" if isinstance(v, (int, float)) else "  -  "
        print(f"{world}  {size:9} {tensors:7}  {fmt(c)}    {fmt(s)}           {fmt(r)}")
        print(f"     C++/raw        {bar(c)}")
        print(f"     Python/PyTorch {bar(s)}")
    if args.png:
        ratio_plot.plot([{"world": w, "kib": k, "tensors": t, "cpp_raw_over_average": c,
                          "python_torch_over_modelavg": s, "python_raw_over_modelavg": r}
                         for w, k, t, c, s, r in rows], args.png, args.png_note)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
