"""The one-row GEMM A/B benchmark (examples/benchmarks/one_row.py) runs and reports both settings."""

from __future__ import annotations

import json

import pytest
from prefixgate.engine.models.cpu_linear import onednn_linear_available

from examples.benchmarks import one_row

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(), reason="torch built without oneDNN's prepacked linear"
)


def test_one_row_bench_reports_both_settings_with_the_same_tokens(aidreams_path, tmp_path, capsys):
    out = tmp_path / "one_row.json"
    argv = ["--model", str(aidreams_path), "--rounds", "1", "--max-tokens", "4", "--json", str(out)]
    assert one_row.main(argv) == 0
    res = json.loads(out.read_text())
    assert set(res["wall_tok_s"]) == {"onednn", "calibrated"}
    assert all(len(v) == 1 and v[0] > 0 for v in res["cpu_tok_s"].values())
    assert res["same_tokens"] is True  # greedy: the GEMM choice changes no token here
    assert res["extra_bytes"] >= 0 and res["one_row_kinds"]
    assert "calibrated / onednn" in capsys.readouterr().out
