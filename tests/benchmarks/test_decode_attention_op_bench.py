"""The decode-attention op benchmark (examples/benchmarks/decode_attention_op.py) runs and
reports each kernel the CPU can take, and leaves the kernel choice and threads as it found
them."""

from __future__ import annotations

import os

import pytest
import torch
from prefixgate.kernels import cpu_ext

from examples.benchmarks import decode_attention_op

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="prefixgate CPU ops not built")


def test_the_bench_reports_every_kernel_and_setting(capsys):
    before = torch.get_num_threads()
    argv = ["--rows", "4", "--context", "17-40", "--layers", "2", "--threads", "1", "--rounds", "1"]
    assert decode_attention_op.main(argv) == 0
    out = capsys.readouterr().out
    kernels = ["avx512", "avx2"] if cpu_ext.attention_kernel(64) == "avx512" else ["avx2"]
    for kernel in kernels:
        for dtype in ("float32", "bfloat16"):
            for setting in ("cold", "warm"):
                assert any(
                    line.split()[:3] == [kernel, dtype, setting] for line in out.splitlines()
                ), (kernel, dtype, setting, out)
    assert "PREFIXGATE_CPU_EXT_AVX512" not in os.environ  # as found
    assert torch.get_num_threads() == before
