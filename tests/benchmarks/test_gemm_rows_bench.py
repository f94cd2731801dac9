"""The few-rows GEMM benchmark (examples/benchmarks/gemm_rows.py) runs, compares both ways
per shape and row count, and leaves torch's threads as it found them."""

from __future__ import annotations

import pytest
import torch
from prefixgate.kernels import cpu_ext

from examples.benchmarks import gemm_rows

pytestmark = pytest.mark.skipif(
    not cpu_ext.available() or not cpu_ext.gemm_rows_available(),
    reason="prefixgate CPU ops with AVX-512 not here",
)


def test_the_bench_reports_each_shape_and_row_count(capsys):
    before = torch.get_num_threads()
    argv = ["--rows", "2", "7", "--threads", "1", "--rounds", "1", "--copies", "1", "--shapes", "2"]
    assert gemm_rows.main(argv) == 0
    out = capsys.readouterr().out
    assert "a step's linears at 7 rows" in out
    assert sum(1 for line in out.splitlines() if line.strip().startswith(("960x", "576x"))) == 4
    assert torch.get_num_threads() == before
