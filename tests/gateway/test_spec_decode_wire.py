"""Speculative decoding and the thread policy seen from the gateway: ``/metrics`` counters,
the periodic stats line, and the ``prefixgate serve`` flags (vLLM's names included)."""

from __future__ import annotations

import argparse

from prefixgate.gateway.cli import build_parser
from prefixgate.gateway.http.metrics import GatewayMetrics
from prefixgate.gateway.local.engine_log import stats_line
from prefixgate.gateway.serve.configure import engine_config
from support.fake_engine import IDLE_STATS

BASE = dict(IDLE_STATS, num_running=1)


def _serve(argv: list[str]) -> argparse.Namespace:
    parser = build_parser("serve")
    return parser.parse_args(["serve", *argv])


def test_metrics_expose_spec_decode_counters_as_vllm_names_them():
    m = GatewayMetrics()
    stats = dict(
        BASE,
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=40,
        spec_decode_num_accepted_tokens=25,
        spec_decode_acceptance_rate=0.625,
    )
    m.add_engine(lambda: stats)
    text = m.render().decode()
    assert "prefixgate_spec_decode_num_draft_tokens_total 40.0" in text
    assert "prefixgate_spec_decode_num_accepted_tokens_total 25.0" in text
    assert "prefixgate_spec_decode_num_drafts_total 10.0" in text
    assert "# TYPE prefixgate_spec_decode_num_draft_tokens_total counter" in text


def test_metrics_without_speculation_have_no_spec_counters():
    m = GatewayMetrics()
    m.add_engine(lambda: dict(BASE))
    assert "spec_decode" not in m.render().decode()


def test_stats_line_reports_the_intervals_acceptance():
    prev = dict(BASE, spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=25)
    cur = dict(
        BASE,
        tokens_decoded=90,
        spec_decode_num_draft_tokens=104,
        spec_decode_num_accepted_tokens=65,
    )
    line = stats_line(prev, cur, 2.0)
    assert line is not None
    assert line.endswith(", spec acceptance 62.5 % (40/64 draft tokens)")
    assert "spec" not in (stats_line(BASE, dict(BASE, tokens_decoded=60), 1.0) or "")


def test_serve_flags_for_speculation_and_threads():
    args = _serve(
        [
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "6",
            "--ngram-prompt-lookup-min",
            "3",
            "--ngram-prompt-lookup-max",
            "4",
            "--threads",
            "1",
        ]
    )
    config = engine_config(args)
    assert config.speculative_method == "ngram"
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (6, 3)
    assert (config.prompt_lookup_max, config.threads) == (4, 1)
    same = engine_config(_serve(["--speculative-method", "ngram", "--prompt-lookup-max", "7"]))
    assert (same.speculative_method, same.prompt_lookup_max) == ("ngram", 7)


def test_serve_threads_default_is_the_affinity_count_capped():
    from prefixgate.engine.threads import MAX_DEFAULT_THREADS, available_cpus, default_threads

    config = engine_config(_serve([]))
    assert config.threads == default_threads() == min(available_cpus(), MAX_DEFAULT_THREADS)
    assert config.speculative_method is None
