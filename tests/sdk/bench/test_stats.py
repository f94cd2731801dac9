"""Percentiles, per-request derived figures and the run summary."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from prefixgate.sdk.bench.stats import (
    RequestResult,
    distribution,
    fmt,
    percentile,
    render_table,
    summarize,
    summary_rows,
)


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(q):
    rng = random.Random(q)
    xs = [rng.expovariate(1.0) for _ in range(137)]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_definition():
    r = RequestResult(0, ok=True, ttft=0.5, e2e=2.5, output_tokens=5)
    assert r.tpot == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert RequestResult(0, ok=True, ttft=0.5, e2e=0.5, output_tokens=1).tpot is None
    assert RequestResult(0, ok=False, error="x").tpot is None
    assert r.to_dict()["tpot"] == pytest.approx(0.5)


def test_summarize():
    ok = functools.partial(RequestResult, ok=True, output_tokens=6, prompt_tokens=100)
    results = [
        ok(0, ttft=0.1, e2e=1.1, itl=[0.2] * 5, cached_tokens=80),
        ok(1, ttft=0.3, e2e=0.8, itl=[0.1] * 5, cached_tokens=0),
        RequestResult(2, ok=False, error="RateLimitError(429)"),
        RequestResult(3, ok=False, error="RateLimitError(429)"),
        RequestResult(4, ok=False, error="APIConnectionError"),
    ]
    s = summarize(results, duration_s=2.0)
    assert s["completed"] == 2 and s["failed"] == 3
    assert s["errors"] == {"RateLimitError(429)": 2, "APIConnectionError": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((200.0 + 100.0) / 2)
    assert s["itl_ms"]["count"] == 10 and s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(6.0)
    assert s["cached_token_share"] == pytest.approx(0.4)
    rows = dict((r[0], r[1]) for r in summary_rows(s))
    assert rows["cached-token share"] == "40.0 %" and "RateLimitError(429): 2" in rows["errors"]


def test_summarize_empty_and_without_usage():
    s = summarize([RequestResult(0, ok=True, ttft=0.1, e2e=0.2, output_tokens=1)], 0.2)
    assert (
        s["cached_token_share"] is None
        and s["tpot_ms"]["count"] == 0
        and s["tpot_ms"]["p99"] is None
    )
    assert distribution([])["mean"] is None
    assert summarize([], 0.0)["request_throughput"] == 0.0


def test_fmt_and_table():
    assert (
        fmt(None) == "-"
        and fmt(0.25) == "25.0 %"
        and fmt(1234.5, "ms") == "1,234"
        and fmt(3, "") == "3"
    )
    text = render_table("T", ["metric", "v"], [["a", "1"], ["bb", "22"]])
    assert text.splitlines()[0] == "T" and text.splitlines()[-1].split() == ["bb", "22"]
