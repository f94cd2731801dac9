"""``bench compare``: ratios, the compare targets' checks, target commands, and a real run of (d) + (e)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest
from prefixgate.sdk.bench.commands import add_bench_parser  # noqa: E402
from prefixgate.sdk.bench.compare import bench_target, shared_prefix_share  # noqa: E402
from prefixgate.sdk.bench.report import checks, ratios  # noqa: E402
from prefixgate.sdk.bench.targets import Target, build_targets  # noqa: E402
from prefixgate.sdk.bench.workload import BenchRequest  # noqa: E402
from support.stub_upstream import StubServer  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefixgate")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def _summary(tp: float, mean: float, p99: float) -> dict:
    return {"output_throughput": tp, "ttft_ms": {"mean": mean, "p99": p99}}


def test_ratios_and_checks_pass_and_fail():
    s = {
        "a": _summary(300, 100, 200),
        "b": _summary(250, 1000, 3000),
        "c": _summary(200, 150, 900),
        "d": _summary(90, 2000, 5000),
    }
    r = ratios(s)
    assert r["a"]["output tokens/s"] == 1.0 and r["d"]["output tokens/s"] == pytest.approx(0.3)
    assert r["b"]["TTFT mean"] == pytest.approx(10.0)
    res = {c["check"]: c for c in checks(s)}
    assert res["(a)/(d) output tokens/s"]["pass"] and res["(a)/(d) output tokens/s"][
        "value"
    ] == pytest.approx(300 / 90)
    assert res["(a)/(d) p99 TTFT"]["pass"] and res["(a) vs (b) mean TTFT reduction"][
        "value"
    ] == pytest.approx(0.9)
    assert res["(a)/(c) output tokens/s"]["pass"] and res["(a)/(c) p99 TTFT"]["pass"]
    s["b"] = _summary(250, 400, 3000)
    s["d"] = _summary(150, 2000, 5000)
    res = {c["check"]: c for c in checks(s)}
    assert (
        not res["(a) vs (b) mean TTFT reduction"]["pass"]
        and not res["(a)/(d) output tokens/s"]["pass"]
    )
    assert checks({"a": _summary(1, 1, 1)}) == []


def test_build_targets_commands():
    args = _parse(
        [
            "bench",
            "compare",
            "--model",
            "/m",
            "--load-format",
            "dummy",
            "--targets",
            "a,b,c,d",
            "--upstream",
            "http://127.0.0.1:9/v1",
            "--concurrency",
            "8",
        ]
    )
    ts = build_targets(args)
    assert [t.key for t in ts] == ["a", "b", "c", "d", "e"]
    a, b, c, d, e = ts
    assert "serve" in a.command and "--model" in a.command and "{port}" in a.command
    assert set(b.command) - set(a.command) and set(c.command) - set(a.command)
    assert (
        "prefixgate.engine.hf_server" in d.command
        and d.command[d.command.index("--max-batch-size") + 1] == "8"
    )
    assert e.command is None and e.base_url == "http://127.0.0.1:9/v1"
    threaded = build_targets(_parse(["bench", "compare", "--model", "/m", "--threads", "1"]))
    assert all(t.env["OMP_NUM_THREADS"] == "1" for t in threaded)
    with pytest.raises(ValueError, match="unknown target"):
        build_targets(_parse(["bench", "compare", "--targets", "a,z"]))


def test_shared_prefix_share(smollm2_shape_path):
    sys_msg = {"role": "system", "content": "x" * 900}
    reqs = [
        BenchRequest(i, [sys_msg, {"role": "user", "content": f"task {i} " * 3}], 4, 0)
        for i in range(4)
    ]
    share = shared_prefix_share(smollm2_shape_path, reqs)
    assert 0.9 < share["share"] < 1 and share["prompt_tokens"] == 4 * share["mean_prompt_tokens"]
    assert shared_prefix_share(None, reqs) is None


def test_compare_runs_hf_baseline_and_upstream(aidreams_path, tmp_path, capsys):
    """(d) started as a real server on loopback, (e) an external stub: one compare run."""
    stub = StubServer(ttft_s=0.01, token_delay_s=0.001).start()
    try:
        out, png = tmp_path / "c.json", tmp_path / "c.png"
        args = _parse(
            [
                "bench",
                "compare",
                "--model",
                aidreams_path,
                "--targets",
                "d",
                "--upstream",
                stub.base_url,
                "--num-requests",
                "6",
                "--concurrency",
                "3",
                "--output-len",
                "4",
                "--num-system-prompts",
                "0",
                "--user-task-max-chars",
                "60",
                "--json",
                str(out),
                "--plot",
                str(png),
                "--no-progress",
                "--log-dir",
                str(tmp_path / "logs"),
                "--startup-timeout",
                "120",
                "--threads",
                "1",
            ]
        )
        assert args.func(args) == 0
    finally:
        stub.stop()
    doc = json.loads(out.read_text())
    d, e = doc["targets"]
    assert d["target"] == "d" and "error" not in d, d.get("error")
    assert d["summary"]["completed"] == 6 and d["summary"]["total_output_tokens"] == 24
    assert e["summary"]["completed"] == 6 and e["model"] == "stub-model"
    assert doc["ratios_vs_a"]["(e) upstream"]["completed"] == 1.0
    assert png.stat().st_size > 1000
    assert "(d) hf-transformers" in capsys.readouterr().out
    assert (tmp_path / "logs" / "d-hf-transformers.log").exists()


def test_a_server_that_fails_is_reported(tmp_path):
    """A target whose server exits is reported with its log tail; the run goes on."""
    target = Target(
        "b", "broken", "exits at once", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    )
    args = _parse(["bench", "compare", "--startup-timeout", "30", "--no-progress"])
    info = asyncio.run(bench_target(target, [], args, tmp_path))
    assert "exited with 3" in info["error"] and "boom" in info["error"]
    assert "summary" not in info and Path(info["log"]).exists()


def test_compare_defaults_are_the_cpu_demo(workloads_path):
    from prefixgate.sdk.bench.commands import workload_from_args
    from prefixgate.sdk.bench.workload import load_workload

    args = _parse(["bench", "compare"])
    wl = workload_from_args(args)
    assert (wl.num_requests, wl.output_len.kind, wl.output_len.values) == (40, "uniform", (4, 24))
    reqs = load_workload(
        wl, workloads_path / "system_prompts.csv", workloads_path / "user_tasks.jsonl"
    )
    assert len({r.messages[0]["content"] for r in reqs}) == 1  # one shared system prompt
    assert len({r.messages[1]["content"] for r in reqs}) == 40  # distinct user turns
    assert 540 <= len(reqs[0].messages[0]["content"]) <= 760
