"""The AVX-512 GEMM of a few rows on oneDNN's packed panels (``cpu_ext.gemm_panels``): against
float64 over row counts (every register-block tail), shapes whose outputs are not a multiple of
the panel width, input widths that are not a multiple of the chunk, bias or none, 1 and 2
threads; the linear layer's use of it; and its errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from prefixgate.engine.models.cpu_linear import OneDNNLinear, onednn_panels
from prefixgate.kernels import cpu_ext

pytestmark = pytest.mark.skipif(
    not cpu_ext.available() or not cpu_ext.gemm_rows_available(),
    reason="prefixgate CPU ops not built here, or no AVX-512 (AVX512F/DQ/BW/VL)",
)


def packed_panels(weight: torch.Tensor) -> tuple[OneDNNLinear, torch.Tensor]:
    layer = OneDNNLinear(weight, None)
    panels = onednn_panels(layer._packed, weight)
    if panels is None or panels.shape[2] != 64:
        pytest.skip("oneDNN packs this weight in another layout on this CPU")
    return layer, panels


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("out_f, in_f", [(64, 64), (200, 96), (576, 576), (130, 1536), (7, 33)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemm_panels_matches_float64(threads, out_f, in_f, bias):
    g = torch.Generator().manual_seed(out_f * 1000 + in_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    _, panels = packed_panels(w)
    for rows in (1, 2, 5, 6, 7, 12, 13, 31, 32, 64):
        x = torch.randn(rows, in_f, generator=g)
        y = cpu_ext.gemm_panels(x, panels, b, out_f)
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        assert y.shape == (rows, out_f) and y.dtype == torch.float32
        # fp32 FMA chain over in_f terms: within a few ulps of the sum of magnitudes
        scale = (x.double().abs() @ w.double().abs().T).max()
        assert (y.double() - ref).abs().max() <= 4e-7 * scale * in_f**0.5, rows


def test_gemm_panels_writes_only_its_rows_and_columns():
    """The last panel's columns past N are masked: a row's output is exactly N wide, and a
    non-contiguous x (a column slice) is read as its values."""
    w = torch.randn(70, 40)
    _, panels = packed_panels(w)
    x = torch.randn(9, 80)[:, ::2]
    y = cpu_ext.gemm_panels(x, panels, None, 70)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


def test_gemm_panels_rejects_what_it_cannot_do():
    w = torch.randn(128, 32)
    _, panels = packed_panels(w)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        cpu_ext.gemm_panels(torch.randn(65, 32), panels, None, 128)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        cpu_ext.gemm_panels(torch.randn(0, 32), panels, None, 128)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ext.gemm_panels(torch.randn(2, 32, dtype=torch.bfloat16), panels, None, 128)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ext.gemm_panels(torch.randn(2, 31), panels, None, 128)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_ext.gemm_panels(torch.randn(2, 32), panels, None, 200)
    with pytest.raises(RuntimeError, match="panels"):
        cpu_ext.gemm_panels(torch.randn(2, 32), torch.randn(2, 32, 8), None, 16)


@pytest.mark.parametrize("rows", [2, 7, 32, 64, 65, 200])
def test_the_linear_layer_takes_it_for_a_few_rows_and_onednn_past_them(rows, monkeypatch):
    w = torch.randn(192, 96)
    b = torch.randn(192)
    layer = OneDNNLinear(w, b)
    if layer._panels is None or layer._panels.shape[2] != 64:
        pytest.skip("oneDNN packs this weight in another layout on this CPU")
    onednn = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        torch.ops.mkldnn, "_linear_pointwise", lambda *a: onednn.append(1) or real(*a)
    )
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert bool(onednn) == (rows > cpu_ext.GEMM_ROWS)


def test_the_environment_switch_keeps_onednn(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_CPU_EXT_AVX512", "0")
    assert not cpu_ext.gemm_rows_available()
    layer = OneDNNLinear(torch.randn(128, 64), None)
    assert not layer._gemm_rows()
    with pytest.raises(RuntimeError, match="AVX-512"):
        cpu_ext.gemm_panels(torch.randn(2, 64), torch.zeros(2, 64, 64), None, 128)
