#!/usr/bin/python3
"""Plots ratio_sweep.py's ratios against size as a PNG.

Reads the sweep's output (its JSON lines; the "ratios" lines are used, one per world size, size
and tensor count) and draws one panel per ratio: the C++ call against a raw Gloo all-reduce of
one flat buffer, and the Python drop-in against PyTorch's average_parameters and against a raw
torch all_reduce. Above 1.0 (the dashed line) modelavg is the faster. One line per world size;
the marker says how many tensors the call averaged.

  /usr/bin/python3 bench/ratio_sweep.py --build=build | tee sweep.jsonl
  /usr/bin/python3 bench/ratio_plot.py sweep.jsonl --out=docs/images/ratio_sweep.png \
      --note="load average 1.2"

Needs matplotlib (Debian's python3-matplotlib).
"""

import argparse
import sys

from json_lines import json_rows  # bench/, beside this script

# (key in a "ratios" line, panel title)
PANELS = (
    ("cpp_raw_over_average", "C++ call: raw Gloo all-reduce's time / the call's"),
    ("python_torch_over_modelavg", "Python drop-in: PyTorch average_parameters' time / the drop-in's"),
    ("python_raw_over_modelavg", "Python drop-in: raw torch all_reduce's time / the drop-in's"),
)
MARKERS = "os^Dv<>p*h"


def read_rows(lines):
    """The "ratios" lines of a sweep's output, in order."""
    return json_rows(lines, lambda row: row.get("run") == "ratios")


def size_label(kib):
    if kib < 1024:
        return f"{kib} KiB"
    return f"{kib // 1024} MiB"


def plot(rows, out, note=""):
    """Writes the panels of `rows` (ratios lines) to the PNG `out`; returns the panels drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in PANELS
              if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not panels:
        raise ValueError("no ratios to plot: the output holds no \"ratios\" line with a figure "
                         "(run bench/ratio_sweep.py and pass its output)")
    worlds = sorted({r["world"] for r in rows})
    tensor_counts = sorted({r["tensors"] for r in rows})
    marker = {t: MARKERS[i % len(MARKERS)] for i, t in enumerate(tensor_counts)}
    sizes = sorted({r["kib"] for r in rows})

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True,
                             squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        for wi, world in enumerate(worlds):
            color = f"C{wi}"
            pts = sorted((r["kib"], r["tensors"], r[key]) for r in rows
                         if r["world"] == world and isinstance(r.get(key), (int, float)))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[2] for p in pts], color=color, alpha=0.5,
                    label=f"W = {world}")
            for kib, tensors, ratio in pts:
                ax.plot(kib, ratio, marker=marker[tensors], color=color, linestyle="none")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("ratio (> 1: modelavg faster)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax = axes[-1, 0]
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(k) for k in sizes], rotation=30)
    ax.set_xlabel("size of the averaging call")
    # Legend: colours for world sizes, markers for tensor counts.
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=f"C{i}", label=f"W = {w}") for i, w in enumerate(worlds)]
    handles += [Line2D([], [], color="black", marker=marker[t], linestyle="none",
                       label=f"{t} tensor{'s' if t != 1 else ''}") for t in tensor_counts]
    axes[0, 0].legend(handles=handles, fontsize=8, ncol=2)
    fig.suptitle("modelavg against its baselines (Gloo on loopback, CPU; medians)"
                 + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [k for k, _ in panels]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_output", nargs="?", default="-",
                   help="a file of ratio_sweep.py's output ('-': standard input)")
    p.add_argument("--out", default="ratio_sweep.png")
    p.add_argument("--note", default="", help="a line under the title (the machine, its load)")
    args = p.parse_args()
    if args.sweep_output == "-":
        rows = read_rows(sys.stdin)
    else:
        with open(args.sweep_output, encoding="utf-8") as f:
            rows = read_rows(f)
    try:
        plot(rows, args.out, args.note)
    except ValueError as e:
        print(f"ratio_plot: {e}", file=sys.stderr)
        return 1
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
