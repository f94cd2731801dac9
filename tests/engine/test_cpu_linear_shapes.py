"""The oneDNN linear runs a bounded set of row counts, so its primitive caches stay bounded.

oneDNN and torch's ideep keep one compiled primitive per GEMM shape (1,024 each); before the
row counts were padded to ``padded_rows``, every new prefill length kept ~2.2 MB for the
tiny-random model (the local server grew for thousands of requests, invisible to
tracemalloc). Heap bytes in use from glibc's ``mallinfo2`` (``support.heap``), not RSS.
"""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine.models.cpu_linear import (
    EXACT_ROWS,
    OneDNNLinear,
    distinct_row_counts,
    onednn_linear_available,
    padded_rows,
    warm_up_row_counts,
)
from support.heap import heap_in_use
from torch import nn


@pytest.fixture
def one_thread():
    """One torch thread, as the engine runs on a loaded 2-core machine (the server's setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_padded_rows_bounds_shapes_and_padding():
    for rows in range(0, 9000):
        p = padded_rows(rows)
        assert rows <= p <= rows * 1.125, rows
        assert padded_rows(p) == p
        if rows <= EXACT_ROWS:
            assert p == rows
    assert distinct_row_counts(2048) == 72
    assert distinct_row_counts(8192) == 88
    with pytest.raises(ValueError, match="rows"):
        padded_rows(-1)


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear")
@pytest.mark.parametrize("rows", [17, 33, 65, 100, 257, 1000])
def test_padded_rows_give_the_same_values(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    packed = OneDNNLinear.from_linear(linear)
    x = torch.randn(2, rows, 64).transpose(0, 1)  # leading dims, not contiguous
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == (rows, 2, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear")
def test_new_row_counts_keep_no_more_primitives(one_thread):
    torch.manual_seed(0)
    packed = OneDNNLinear.from_linear(nn.Linear(128, 256))
    xs = torch.randn(400, 128)
    lengths = range(301, 341)  # unpadded, each new row count kept ~575 KB: ~23 MB
    with torch.inference_mode():
        for rows in (301, 320, 352):  # warm: the first length, the two padded shapes
            packed(xs[:rows])
        before = heap_in_use()
        for rows in lengths:
            packed(xs[:rows])
        growth = heap_in_use() - before
    assert growth < 2_000_000, growth


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear")
def test_decode_sized_row_counts_share_primitives(one_thread):
    """Steps that mix decode rows with prefill chunks reach every row count up to 64 in turn
    (the local server's bursts): past 16 rows they share the 8-steps-per-octave shapes."""
    torch.manual_seed(0)
    packed = OneDNNLinear.from_linear(nn.Linear(128, 256))
    xs = torch.randn(64, 128)
    grid = [r for r in range(17, 65) if r % (2 if r <= 32 else 4) == 0]  # 18, 20, ..., 60, 64
    with torch.inference_mode():
        for rows in grid:
            packed(xs[:rows])
        before = heap_in_use()
        for rows in range(17, 65):  # unpadded, the 24 counts off the grid kept ~14 MB
            packed(xs[:rows])
        growth = heap_in_use() - before
    assert growth < 2_000_000, growth


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear")
def test_warm_up_compiles_every_row_count(one_thread):
    """After ``warm_up_row_counts``, every row count up to its bound runs on primitives it
    compiled: no heap grows (unwarmed, the 32 counts of 1-64 rows kept ~18 MB)."""
    torch.manual_seed(0)
    layers = [OneDNNLinear.from_linear(nn.Linear(128, 256)) for _ in range(3)]  # one shape
    layers.append(nn.ReLU())  # not a OneDNNLinear: skipped
    assert warm_up_row_counts(layers, 64) == distinct_row_counts(64) == 32
    xs = torch.randn(64, 128)
    with torch.inference_mode():
        before = heap_in_use()
        for rows in range(1, 65):
            for layer in layers[:3]:
                layer(xs[:rows])
        growth = heap_in_use() - before
    assert growth < 2_000_000, growth
    with pytest.raises(ValueError, match="max_rows"):
        warm_up_row_counts(layers, 0)
