"""Unit tests: admission queue, token buckets and keys, schemas, serve CLI parsing."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.serve.runner import (
    add_serve_parser,
    engine_config,
    parse_bytes,
    settings_from_args,
)
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.admission import AdmissionConfig, AdmissionController
from prefixgate.gateway.tenancy.keys import KeyRing, KeySpec, TokenBucket, load_keys_file
from prefixgate.gateway.wire.request_models import ChatCompletionRequest, CompletionRequest, parse


def test_admission_bounds_and_retry_after():
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=2, max_queued_tokens=100))
    a = ctl.admit(60)
    with pytest.raises(APIError) as e:
        ctl.admit(50)  # 110 tokens > 100
    assert e.value.status == 429 and e.value.code == "server_overloaded"
    assert e.value.retry_after >= 1
    b = ctl.admit(40)
    with pytest.raises(APIError):
        ctl.admit(1)  # 2 requests queued
    for _ in range(10):  # drain: rate becomes known
        a.started()
    assert ctl.queued_requests == 1 and ctl.drain_rate > 0
    a.done()
    a.done()  # idempotent
    b.done()
    assert (ctl.queued_requests, ctl.queued_tokens, ctl.in_flight) == (0, 0, 0)
    big = ctl.admit(10_000)  # alone in the queue: an oversized prompt still passes
    big.done()
    ctl2 = AdmissionController(AdmissionConfig(max_running=1))
    t = ctl2.admit(1)
    t.started()
    with pytest.raises(APIError):
        ctl2.admit(1)
    with pytest.raises(ValueError):
        AdmissionConfig(max_queued_requests=0)


def test_token_bucket():
    b = TokenBucket(capacity=10, rate=100.0)
    assert b.take(10) == 0.0
    wait = b.take(5)
    assert 0.0 < wait <= 0.05 + 1e-3
    time.sleep(0.06)
    assert b.take(5) == 0.0
    big = TokenBucket(capacity=10, rate=1.0)
    assert big.take(50) == 0.0  # full bucket lets an oversized cost through
    assert big.level == -40 and big.take(1) > 40


def test_keys_file_and_salts(tmp_path):
    f = tmp_path / "k.json"
    f.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "a", "salt": "s1", "requests_per_minute": 1},
                    {"key": "b", "salt": "s1"},
                    {"key": "c"},
                ]
            }
        )
    )
    specs = load_keys_file(str(f))
    assert [s.salt for s in specs][:2] == ["s1", "s1"] and specs[2].salt.startswith("key:")
    assert specs[2].salt == "key:" + hashlib.sha256(b"c").hexdigest()[:32]  # never the key
    ring = KeyRing.from_options(["plain"], str(f))
    assert not ring.open
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        load_keys_file(str(tmp_path / "bad.json"))
    (tmp_path / "bad2.json").write_text(json.dumps({"keys": [{"key": "x", "rpm": 3}]}))
    with pytest.raises(ValueError, match="entry 0"):
        load_keys_file(str(tmp_path / "bad2.json"))
    with pytest.raises(ValueError):
        KeySpec(key="x", max_concurrent=-1)
    with pytest.raises(ValueError):
        load_keys_file(str(tmp_path / "missing.json"))


def test_schema_strictness():
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        "max_completion_tokens": 7,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with pytest.raises(APIError) as e:  # OpenAI's answer to an unknown field
        parse(ChatCompletionRequest, json.dumps({**body, "unknown_field": 1}).encode())
    assert e.value.param == "unknown_field"
    assert str(e.value) == "Unrecognized request argument supplied: unknown_field"
    req = parse(ChatCompletionRequest, json.dumps(body).encode())
    assert req.messages[0].text() == "ab" and req.output_limit == 7
    assert req.num_logprobs == 0 and req.include_usage
    assert parse(CompletionRequest, b'{"model": "m", "prompt": "x"}').output_limit == 16
    for bad, param in (
        (b'{"model": "m", "prompt": "x", "top_p": 0}', "top_p"),
        (b'{"model": "m", "prompt": "x", "temperature": 3}', "temperature"),
        (b'{"model": "m", "prompt": "x", "stop": ["a","b","c","d","e"]}', "stop"),
        (b'{"model": "m", "prompt": 5}', "prompt"),
        (b'{"model": "m", "prompt": "x", "seed": "1"}', "seed"),
    ):
        with pytest.raises(APIError) as e:
            parse(CompletionRequest, bad)
        assert e.value.status == 400 and e.value.param == param, (bad, e.value.param)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_cli_flags_build_engine_config():
    args = _parse(
        "--model",
        "/m/aidreams-260k/",
        "--block-size",
        "32",
        "--num-kv-blocks",
        "100",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "512",
        "--scheduling",
        "static",
        "--no-prefix-caching",
        "--attention-backend",
        "torch",
        "--dtype",
        "float32",
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--hf-overrides",
        '{"num_hidden_layers": 2}',
        "--api-key",
        "k1",
        "--api-key",
        "k2",
    )
    cfg = engine_config(args)
    assert (cfg.model, cfg.block_size, cfg.num_kv_blocks, cfg.kv_cache_memory) == (
        "/m/aidreams-260k/",
        32,
        100,
        64 * 2**20,
    )
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (128, 4, 512)
    assert cfg.scheduling == "static" and cfg.enable_prefix_caching is False
    assert cfg.attention_backend == "torch" and cfg.load_format == "dummy"
    assert cfg.hf_overrides == {"num_hidden_layers": 2}
    s = settings_from_args(args)
    assert s.model_name == "aidreams-260k" and s.api_keys == ["k1", "k2"]
    assert callable(args.func)
    default = engine_config(_parse())
    assert default.model is None and default.enable_prefix_caching is True
    assert settings_from_args(_parse()).model_name == "tiny-random"
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30) and parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    with pytest.raises(SystemExit):
        _parse("--scheduling", "fifo")
    with pytest.raises(ValueError):
        GatewaySettings(keepalive_s=0)


def test_retry_after_after_a_quiet_period_uses_the_service_time(monkeypatch):
    # Three sequential requests (0.5 s of generation each), then a burst: the drain-rate EWMA
    # held ~3 departures and said Retry-After: 60 while the queue drained in 5-7 s. With the
    # service-time estimate: 64 queued x 0.5 s / 8 running at once = 4 s.
    now = [1000.0]
    monkeypatch.setattr("prefixgate.gateway.tenancy.admission.time.monotonic", lambda: now[0])
    ctl = AdmissionController(AdmissionConfig(max_queued_requests=64), concurrency=8)
    for _ in range(3):
        t = ctl.admit(10)
        now[0] += 0.05
        t.started()
        now[0] += 0.5
        t.done()
        now[0] += 2.0
    now[0] += 60.0
    tickets = [ctl.admit(10) for _ in range(64)]
    with pytest.raises(APIError) as e:
        ctl.admit(10)
    assert e.value.status == 429
    assert 3.0 <= e.value.retry_after <= 6.0, e.value.retry_after
    for t in tickets:
        t.done()
    # without a concurrency hint: the most requests seen running at once (1 here) -> capped
    ctl2 = AdmissionController(AdmissionConfig(max_queued_requests=300))
    t = ctl2.admit(1)
    t.started()
    now[0] += 0.5
    t.done()
    tickets = [ctl2.admit(1) for _ in range(300)]
    with pytest.raises(APIError) as e:
        ctl2.admit(1)
    assert e.value.retry_after == 60.0
    for t in tickets:
        t.done()


def test_a_chat_without_tools_imports_no_grammar_machinery():
    # plan_tools imported prefixgate.engine.structured_output (xgrammar, torch: ~1.3 s) for
    # every chat, tools or not: the first chat request of a process blocked the event loop
    # that long (every client stalled; a 0.3 s-timed disconnect test failed when run alone).
    from support.fresh_process import run_code

    code = (
        "import sys\n"
        "from prefixgate.gateway.wire.tools import plan_tools\n"
        "plan = plan_tools(None, None, None, None)\n"
        "assert plan.mode == 'none'\n"
        "assert plan_tools([], 'none', None, None).mode == 'none'\n"
        "print(sorted(m for m in ('prefixgate.engine.structured_output', 'xgrammar', 'torch')"
        " if m in sys.modules))\n"
    )
    stdout = run_code(code, timeout_s=120)
    assert stdout.strip() == "[]", stdout
