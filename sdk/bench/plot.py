"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from prefixgate.sdk.bench.stats import RequestResult, lookup

# Panels of a comparison: (title, path in a summary, unit, scale, higher is better). TPOT is
# left to the table: the transformers baseline emits its tokens at once, so its TPOT is ~0.
COMPARE_PANELS = (
    ("Output throughput", ("output_throughput",), "tokens/s", 1.0, True),
    ("Mean TTFT", ("ttft_ms", "mean"), "s", 1e-3, False),
    ("p99 TTFT", ("ttft_ms", "p99"), "s", 1e-3, False),
    ("p99 E2E latency", ("e2e_ms", "p99"), "s", 1e-3, False),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(
    results: list[RequestResult], path: str | Path, title: str = "prefixgate bench serve"
) -> Path:
    """Empirical CDFs of TTFT and E2E latency (seconds) of one run, written to ``path`` (PNG)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, name in zip(axes, ("ttft", "e2e"), strict=True):
        xs = sorted(getattr(r, name) for r in results if r.ok and getattr(r, name) is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        ax.set_xlabel(f"{name.upper()} (s)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_compare(
    summaries: dict[str, dict], path: str | Path, title: str = "prefixgate bench compare"
) -> Path:
    """Bar charts of the headline figures per target, each bar labelled with its ratio to the first.

    Args:
        summaries: target label → summary (see ``stats.summarize``); the first is the reference.
        path: the PNG to write.
    """
    plt = _pyplot()
    labels = list(summaries)
    fig, axes = plt.subplots(1, len(COMPARE_PANELS), figsize=(4.2 * len(COMPARE_PANELS), 4.2))
    colors = ["#2a7ab0", "#8fb8d8", "#f0a04b", "#c44e52", "#6b6b6b"]
    for ax, (name, key, unit, scale, higher) in zip(axes, COMPARE_PANELS, strict=True):
        values = [
            v * scale if (v := lookup(summaries[t], key)) is not None else None for t in labels
        ]
        ref = values[0]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(
            range(len(labels)), heights, color=[colors[i % len(colors)] for i in range(len(labels))]
        )
        for bar, v in zip(bars, values, strict=True):
            text = "-" if v is None else (f"{v / ref:.2f}x" if ref else f"{v:.3g}")
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(f"{name} ({'higher' if higher else 'lower'} is better)", fontsize=9)
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
