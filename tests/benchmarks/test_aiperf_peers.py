"""The parsing of examples/benchmarks/aiperf_peers.py: AIPerf's export in, the kept figures out.

No server and no AIPerf needed: the export below has the shape AIPerf 0.13 writes
(``profile_export_aiperf.json``, one object per metric tag).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmarks" / "aiperf_peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("aiperf_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["aiperf_peers"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["aiperf_peers"]


EXPORT = {
    "schema_version": "1",
    "time_to_first_token": {"unit": "ms", "avg": 2011.0, "p50": 2011.0, "p99": 3134.0},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 4.45},
    "request_throughput": {"unit": "requests/sec", "avg": 0.139},
    "total_usage_prompt_tokens": {"unit": "tokens", "avg": 2408.0},
    "total_usage_prompt_cache_read_tokens": {"unit": "tokens", "avg": 2112.0},
    "total_usage_completion_tokens": {"unit": "tokens", "avg": 128.0},
    "completed_request_count": {"unit": "requests", "avg": 4},
}


def test_parse_profile_keeps_the_figures(peers):
    got = peers.parse_profile(EXPORT)
    assert got["ttft_p50_ms"] == 2011.0 and got["ttft_p99_ms"] == 3134.0
    assert got["output_tok_s"] == 4.45 and got["requests_s"] == 0.139
    assert got["cached_share"] == pytest.approx(2112 / 2408)
    assert got["output_tokens"] == 128.0 and got["completed"] == 4.0


def test_cached_tokens_not_reported_is_none_not_zero(peers):
    export = {k: v for k, v in EXPORT.items() if k != "total_usage_prompt_cache_read_tokens"}
    got = peers.parse_profile(export)
    assert got["cached_tokens"] is None and got["cached_share"] is None


def test_reported_zero_cached_tokens_is_a_zero_share(peers):
    export = {**EXPORT, "total_usage_prompt_cache_read_tokens": {"unit": "tokens", "avg": 0}}
    assert peers.parse_profile(export)["cached_share"] == 0.0


def test_metrics_under_records_and_bad_input(peers):
    assert peers.parse_profile({"records": EXPORT})["ttft_p50_ms"] == 2011.0
    with pytest.raises(ValueError):
        peers.parse_profile({"records": [1, 2]})


def test_summary_median_and_spread(peers):
    rounds = [
        {"ttft_p50_ms": 1.0, "output_tok_s": 10.0, "cached_share": None},
        {"ttft_p50_ms": 3.0, "output_tok_s": 30.0, "cached_share": None},
        {"ttft_p50_ms": 2.0, "output_tok_s": 20.0, "cached_share": None},
    ]
    got = peers.summary(rounds)
    assert got["ttft_p50_ms"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert got["cached_share"] is None and got["ttft_p99_ms"] is None
