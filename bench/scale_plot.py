#!/usr/bin/python3
"""Plots bench/scale.sh's lines against the world size, log-log, as a PNG.

Four panels: the time to join all ranks, divided by the ranks (the cost of one Join: flat when
joining the world costs O(N)); the coordinator's CPU per beat; Step's p50 and p99; the
coordinator's RSS per rank. Each panel's dashed line is the ideal: flat at the smallest world's
figure.

  bash bench/scale.sh --out=scale.jsonl
  /usr/bin/python3 bench/scale_plot.py scale.jsonl --out=docs/images/scale.png --note="2 cores"

Needs matplotlib (Debian's python3-matplotlib).
"""

import argparse
import sys

from json_lines import json_rows  # bench/, beside this script


def read_rows(lines):
    """bench/scale.sh's lines that measured something, by world size."""
    rows = json_rows(lines, lambda row: "error" not in row and "join_all_s" in row)
    return sorted(rows, key=lambda r: r["workers"])


# (title, y label, [(label, value of a row)])
PANELS = (
    ("Joining: time to join all / ranks", "µs per rank",
     [("join_all_s / N", lambda r: r["join_all_s"] / r["workers"] * 1e6),
      ("coordinator CPU / N", lambda r: r["join_cpu_us_per_rank"])]),
    ("Coordinator CPU per beat (host streams)", "µs",
     [("heartbeat_cpu_us", lambda r: r["heartbeat_cpu_us"])]),
    ("Step latency (64 in flight)", "µs",
     [("p50", lambda r: r["step_p50_us"]), ("p99", lambda r: r["step_p99_us"]),
      ("Ping p99", lambda r: r["trivial_p99_us"])]),
    ("Coordinator RSS / ranks", "KiB per rank",
     [("RSS / N", lambda r: r["coordinator_rss_mb"] * 1024 / r["workers"])]),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", help="scale.sh's lines (default: stdin)")
    parser.add_argument("--out", default="scale.png")
    parser.add_argument("--note", default="", help="appended to the title (the machine)")
    args = parser.parse_args()
    lines = open(args.input).readlines() if args.input else sys.stdin.readlines()
    rows = read_rows(lines)
    if not rows:
        sys.exit("scale_plot.py: no rows")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["workers"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (title, ylabel, series) in zip(axes.flat, PANELS):
        for label, value in series:
            points = [(r["workers"], value(r)) for r in rows if value(r) > 0]
            if not points:
                continue
            xs, ys = zip(*points)
            line, = ax.plot(xs, ys, marker="o", label=label)
            ax.plot([xs[0], xs[-1]], [ys[0], ys[0]], linestyle="--", color=line.get_color(),
                    alpha=0.5, linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([f"{n // 1024}k" for n in sizes])
        ax.set_xlabel("ranks (log)")
        ax.set_ylabel(ylabel + " (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("modelavg-coordinator against world size (dashed: flat, the ideal)"
                 + (f" — {args.note}" if args.note else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
