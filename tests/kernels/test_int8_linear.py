"""The Triton int8 weight-only GEMM (interpreter on CPU) against a dequantized fp32 matmul."""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine.models.quantization import quantize_weight
from prefixgate.kernels import triton_int8

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def _reference(x, q, scale, bias):
    out = x.float() @ (q.float() * scale[:, None]).T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_int8_linear_matches_dequantized_matmul(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 80  # neither a multiple of the 64-wide tiles: masked edges
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = quantize_weight(w)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    out = triton_int8.int8_linear(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (rows, n)
    err = (out.float() - _reference(x, q, scale, bias)).abs().max().item()
    assert err <= TOL[dtype], err


def test_int8_linear_leading_dims_and_empty():
    q, scale = quantize_weight(torch.randn(32, 48))
    x = torch.randn(2, 3, 48)
    out = triton_int8.int8_linear(x, q, scale, block_n=16, block_k=16)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, _reference(x, q, scale, None), atol=1e-4, rtol=0)
    assert triton_int8.int8_linear(x[:0], q, scale).shape == (0, 3, 32)


def test_int8_linear_bad_arguments():
    q, scale = quantize_weight(torch.randn(8, 16))
    with pytest.raises(TypeError, match="int8"):
        triton_int8.int8_linear(torch.randn(2, 16), q.float(), scale)
    with pytest.raises(ValueError, match="features"):
        triton_int8.int8_linear(torch.randn(2, 15), q, scale)
    with pytest.raises(TypeError, match="float32"):
        triton_int8.int8_linear(torch.ones(2, 16, dtype=torch.int32), q, scale)


def test_quantize_weight_per_channel():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.5]])
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 1.0, 2.0 / 127]))
    assert q[0].tolist() == [64, -127, 32] and q[1].tolist() == [0, 0, 0]
    assert q.abs().max() <= 127
    torch.testing.assert_close(q.float() * scale[:, None], w, atol=0.5 * 2.0 / 127, rtol=0)
