"""Plot ``memory_curve`` results: RSS (MiB) against requests served, one line per JSON file,
and the server's heap bytes in use (dashed, same colour) where the run sampled them.

    python -m examples.benchmarks.memory_plot out.png run1.json [run2.json ...]
        [--label NAME ...]

Needs matplotlib (the ``bench`` extra). Raises SystemExit when a file lacks ``rss_kib``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("runs", nargs="+", help="memory_curve --json files")
    parser.add_argument("--label", action="append", default=[], help="one per run, in order")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    for i, path in enumerate(args.runs):
        run = json.loads(Path(path).read_text())
        if "rss_kib" not in run:
            raise SystemExit(f"{path}: no rss_kib (not a memory_curve result)")
        xs = [x for x, _ in run["rss_kib"]]
        ys = [y / 1024 for _, y in run["rss_kib"]]
        slope = run.get("slope_kb_per_request_second_half", 0.0)
        name = args.label[i] if i < len(args.label) else Path(path).stem
        (line,) = ax.plot(xs, ys, marker=".", label=f"{name} ({slope:+.2f} KB/request, 2nd half)")
        heap = run.get("heap_bytes") or []
        if heap:
            ax.plot(
                [x for x, _ in heap],
                [y / 2**20 for _, y in heap],
                ls="--",
                color=line.get_color(),
                label=f"{name}: heap in use",
            )
    ax.set_xlabel("requests served")
    ax.set_ylabel("server RSS / heap in use (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)


if __name__ == "__main__":
    main()
