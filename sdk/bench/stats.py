"""Per-request results of a load run and their summary (TTFT, TPOT, ITL, E2E, throughput).

Definitions (those of vLLM's ``benchmark_serving`` and the OpenAI streaming API):

* TTFT, time to first token: from sending the request to the first chunk that carries content.
* ITL, inter-token latency: the gap between two consecutive content chunks.
* TPOT, time per output token: ``(E2E - TTFT) / (output_tokens - 1)`` for requests with more
  than one output token.
* E2E latency: from sending the request to the end of its stream.
* Output tokens are ``usage.completion_tokens`` (the stream's usage chunk) when the server
  sends it, else the number of content chunks.
* Cached-token share: ``sum(usage.prompt_tokens_details.cached_tokens) / sum(prompt_tokens)``.

Percentiles interpolate linearly between order statistics (Hyndman & Fan type 7, numpy's
default), so they equal ``numpy.percentile`` without depending on numpy.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds (``time.perf_counter`` differences).

    Attributes:
        index: the request's index in the workload.
        ok: the stream ended normally.
        start: send time, seconds after the run started.
        ttft: time to first content chunk, or ``None``.
        e2e: end-to-end latency, or ``None`` when the request failed.
        itl: gaps between consecutive content chunks.
        output_tokens: completion tokens (usage, else content chunks).
        prompt_tokens: ``usage.prompt_tokens``, or ``None`` when the server sent no usage.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``, or ``None``.
        error: the error's kind (exception class, with the HTTP status when there is one).
        error_message: the error's text, shortened.
    """

    index: int
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_message: str | None = None

    @property
    def tpot(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)`` seconds, or ``None`` (< 2 tokens, failed)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        """A JSON-ready dict (with ``tpot``)."""
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation (numpy's default).

    Raises:
        ValueError: ``values`` empty or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """``{"mean", "p50", "p90", "p99", "max", "count"}`` of ``values`` times ``scale``.

    With the default ``scale`` seconds become milliseconds. Empty input gives ``None`` figures
    and ``count = 0``.
    """
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None, "count": 0}
    out: dict[str, float | int | None] = {"mean": sum(values) / len(values) * scale}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    out["max"] = max(values) * scale
    out["count"] = len(values)
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Summary of a run: latency distributions (ms), throughput and errors.

    Args:
        results: one per request sent.
        duration_s: wall time of the run, first send to last completion (seconds).

    Returns:
        A JSON-ready dict: ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms`` (see
        :func:`distribution`), ``completed``, ``failed``, ``duration_s``,
        ``request_throughput`` (completed requests/s), ``output_throughput`` (output tokens/s
        of completed requests), ``total_output_tokens``, ``total_prompt_tokens``,
        ``total_cached_tokens``, ``cached_token_share`` (``None`` without usage) and
        ``errors`` (kind → count) and ``error_messages`` (kind → the first such error's
        message: the reason, e.g. the context length it exceeded).
    """
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    with_usage = [r for r in done if r.prompt_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([g for r in done for g in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "request_throughput": len(done) * per_s,
        "output_throughput": out_tokens * per_s,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_cached_tokens": cached,
        "cached_token_share": cached / prompt_tokens if prompt_tokens else None,
        "errors": dict(Counter(r.error or "unknown" for r in failed)),
        "error_messages": first_messages(failed),
    }


def first_messages(failed: list[RequestResult]) -> dict[str, str]:
    """Error kind → the message of its first failed request (``""`` when it had none)."""
    out: dict[str, str] = {}
    for r in failed:
        out.setdefault(r.error or "unknown", r.error_message or "")
    return out


# The latency figures: (label, summary key, the statistics shown), each row in milliseconds.
_LATENCIES = (
    ("TTFT", "ttft_ms", ("mean", "p50", "p90", "p99")),
    ("TPOT", "tpot_ms", ("mean", "p50", "p99")),
    ("ITL", "itl_ms", ("p50", "p99")),
    ("E2E", "e2e_ms", ("mean", "p50", "p99")),
)

# The figures a table or a comparison shows: (label, path in the summary, unit, higher_is_better).
HEADLINE: tuple[tuple[str, tuple[str, ...], str, bool], ...] = (
    ("output tokens/s", ("output_throughput",), "tok/s", True),
    ("requests/s", ("request_throughput",), "req/s", True),
    *(
        (f"{label} {stat}", (key, stat), "ms", False)
        for label, key, stats in _LATENCIES
        for stat in stats
    ),
    ("cached-token share", ("cached_token_share",), "", True),
    ("completed", ("completed",), "", True),
    ("failed", ("failed",), "", False),
)


def lookup(summary: dict, path: tuple[str, ...]) -> float | None:
    """The figure at ``path`` in a summary, or ``None`` when absent."""
    cur = summary
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur if isinstance(cur, int | float) else None


def fmt(value: float | None, unit: str = "") -> str:
    """A figure for a table: ``-`` for ``None``, a share as a percentage, else 3 significant-ish digits."""
    if value is None:
        return "-"
    if unit == "" and isinstance(value, float) and 0 <= value <= 1:
        return f"{value * 100:.1f} %"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render_table(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """A plain-text table (what ``bench`` prints; rich renders it when installed)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    line = "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(columns, widths, strict=True))
    )
    out = [title, line, "-" * len(line)]
    for r in rows:
        out.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(out)


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """Print a table with rich when it is installed, else as plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is in the `bench` extra; the SDK alone may lack it
        print(render_table(title, columns, rows))
        return
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    console = Console()
    if not console.is_terminal:  # piped output: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)


def summary_rows(summary: dict) -> list[list[str]]:
    """Rows ``[label, value]`` of the headline figures of one summary."""
    rows = []
    for label, path, unit, _ in HEADLINE:
        rows.append([f"{label} ({unit})" if unit else label, fmt(lookup(summary, path), unit)])
    if summary.get("errors"):
        rows.append(["errors", ", ".join(f"{k}: {v}" for k, v in summary["errors"].items())])
        for kind, message in (summary.get("error_messages") or {}).items():
            if message:
                rows.append([f"  {kind}", _clip(message, 160)])
    return rows


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
