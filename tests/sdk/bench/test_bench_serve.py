"""End to end: the load generator and ``prefixgate bench serve`` against a stub server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefixgate.sdk.bench.commands import add_bench_parser  # noqa: E402
from prefixgate.sdk.bench.loadgen import LoadConfig, root_url, run_load  # noqa: E402
from prefixgate.sdk.bench.workload import WorkloadConfig, load_workload, parse_output_len_dist  # noqa: E402
from support.stub_upstream import StubServer  # noqa: E402


@pytest.fixture
def stub():
    server = StubServer().start()
    yield server
    server.stop()


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_root_url():
    assert root_url("http://h:1/v1/") == "http://h:1" == root_url("http://h:1")


def test_run_load_measures_and_bounds_concurrency(stub):
    stub.ttft_s, stub.token_delay_s = 0.05, 0.01
    reqs = load_workload(WorkloadConfig(num_requests=12, output_len=parse_output_len_dist("5")))
    res = asyncio.run(run_load(reqs, LoadConfig(stub.base_url, concurrency=3, progress=False)))
    assert res.model == "stub-model" and len(res.results) == 12
    assert stub.max_in_flight <= 3
    s = res.summary()
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == 60
    assert 40 <= s["ttft_ms"]["p50"] < 1000  # server waits 50 ms before the first content chunk
    assert 8 <= s["itl_ms"]["p50"] < 500 and s["itl_ms"]["count"] == 12 * 4
    assert s["tpot_ms"]["mean"] >= 8
    assert 0 < s["cached_token_share"] < 0.5
    body = stub.seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["messages"][0]["role"] == "system"


def test_run_load_poisson_and_errors_by_kind(stub):
    stub.fail_every = 4
    reqs = load_workload(WorkloadConfig(num_requests=8, output_len=parse_output_len_dist("2")))
    res = asyncio.run(
        run_load(reqs, LoadConfig(stub.base_url, model="m", rate=200.0, progress=False))
    )
    s = res.summary()
    assert s["completed"] == 6 and s["failed"] == 2  # no retry: every failure is counted
    assert s["errors"] == {"RateLimitError(429)": 2}
    starts = [r.start for r in res.results]
    assert starts[0] < 0.05 and max(starts) > 0  # spread by the arrivals


def test_run_load_connection_error():
    reqs = load_workload(WorkloadConfig(num_requests=2, output_len=parse_output_len_dist("2")))
    res = asyncio.run(
        run_load(reqs, LoadConfig("http://127.0.0.1:9", model="m", progress=False, timeout_s=5))
    )
    assert res.summary()["errors"] == {"APIConnectionError": 2}


def test_bench_serve_cli(stub, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = _parse(
        [
            "bench",
            "serve",
            "--base-url",
            stub.base_url + "/v1",
            "--num-requests",
            "10",
            "--concurrency",
            "4",
            "--output-len-dist",
            "uniform:2:6",
            "--num-system-prompts",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "TTFT p99" in printed and "output tokens/s" in printed
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 10 and len(doc["requests"]) == 10
    assert doc["workload"]["num_system_prompts"] == 2 and doc["model"] == "stub-model"
    assert all(2 <= r["output_tokens"] <= 6 for r in doc["requests"])
    assert png.stat().st_size > 1000


def test_bench_serve_cli_bad_input(capsys):
    args = _parse(
        ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--output-len-dist", "uniform:5:1"]
    )
    assert args.func(args) == 2
    assert "lo <= hi" in capsys.readouterr().err
    args = _parse(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--concurrency", "0"])
    assert args.func(args) == 2


def test_bench_serve_cli_server_down(capsys):
    args = _parse(
        [
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--num-requests",
            "2",
            "--no-progress",
        ]
    )
    assert args.func(args) == 1
    assert "Connection error" in capsys.readouterr().err


_BLOCKER = """
import importlib.abc
import sys

BLOCKED = ("torch", "transformers", "aiohttp", "prefixgate.gateway", "prefixgate.engine",
           "prefixgate.kernels")
# the `prefixgate` entry point (prefixgate.gateway.cli:main) and its package's empty __init__
ALLOWED = ("prefixgate.gateway", "prefixgate.gateway.cli")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ALLOWED:
            return None
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is blocked in this test", name=name)
        return None


sys.meta_path.insert(0, _Block())
"""


def _prefixgate_command() -> list[str]:
    """The installed ``prefixgate`` script next to this Python, else the same entry via ``-m``."""
    script = Path(sys.executable).parent / "prefixgate"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prefixgate.gateway.cli"]


def test_bench_serve_runs_without_torch_or_the_gateway(stub, tmp_path):
    """``prefixgate bench serve`` with torch, transformers, aiohttp, the engine, the kernels and
    every gateway module but the entry point (``prefixgate.gateway.cli``) unimportable."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    for blocked in ("torch", "prefixgate.gateway.app", "prefixgate.engine"):
        probe = subprocess.run(
            [sys.executable, "-c", f"import {blocked}"], env=env, capture_output=True, text=True
        )
        assert probe.returncode != 0 and "blocked in this test" in probe.stderr, blocked
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", stub.base_url, "--num-requests", "4"]
    argv += ["--output-len", "3", "--no-progress", "--json", str(out)]
    proc = subprocess.run(
        _prefixgate_command() + argv, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p99" in proc.stdout
    assert json.loads(out.read_text())["summary"]["completed"] == 4
    # `serve` in the same environment says in one line what is missing, no traceback
    proc = subprocess.run(
        _prefixgate_command() + ["serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "engine extra" in proc.stderr
    assert "Traceback" not in proc.stderr
