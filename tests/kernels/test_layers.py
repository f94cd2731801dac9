"""Triton per-token kernels vs their torch references: KV cache write, RMSNorm, rotary, SwiGLU."""

from __future__ import annotations

import inspect

import pytest
import torch
from prefixgate.kernels import KERNEL_NAMES, get_backend, torch_ref, triton_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]
# One rounding of the result at most: fp32 ulps, fp16 2^-11, bf16 2^-8 (relative, values ~ O(4)).
LAYER_ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def test_backend_signatures_match_reference():
    backend = get_backend("triton")
    for name in KERNEL_NAMES:
        ours = inspect.signature(getattr(backend, name)).parameters.values()
        ref = inspect.signature(getattr(torch_ref, name)).parameters
        # the reference's parameters, in its order; a backend's own launch options only after
        # them, keyword-only and optional (Triton's ``config``)
        called_as_ref = [p.name for p in ours if p.kind is not p.KEYWORD_ONLY]
        assert called_as_ref == list(ref), name
        extra = [p for p in ours if p.kind is p.KEYWORD_ONLY and p.name not in ref]
        assert all(p.default is not p.empty for p in extra), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_reshape_and_cache(dtype, block_size, head_dim):
    # key/value as strided views of a fused qkv projection; -1 slots are skipped
    num_kv_heads, tokens = 2, 6
    qkv = _rand(tokens, 3 * num_kv_heads * head_dim, dtype=dtype)
    key = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        tokens, num_kv_heads, head_dim
    )
    value = qkv[:, 2 * num_kv_heads * head_dim :].view(tokens, num_kv_heads, head_dim)
    slots = torch.tensor(
        [0, -1, block_size - 1, block_size + 3, -1, 4 * block_size - 1], device=DEVICE
    )
    caches = [
        torch.full((4, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
        for _ in range(4)
    ]
    triton_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    torch_ref.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_reshape_and_cache_casts_to_cache_dtype():
    key, value = _rand(3, 2, 64), _rand(3, 2, 64, seed=1)
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    triton_ops.reshape_and_cache(
        key, value, k_cache, v_cache, torch.tensor([1, 17, 5], device=DEVICE)
    )
    assert torch.equal(k_cache.view(32, 2, 64)[[1, 17, 5]], key.half())
    assert torch.equal(v_cache.view(32, 2, 64)[[1, 17, 5]], value.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm(dtype, hidden):
    x, w = _rand(5, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=1)
    out = triton_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, torch_ref.rms_norm(x, w, 1e-5), atol=LAYER_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype):
    x, res = _rand(7, 96, dtype=dtype), _rand(7, 96, dtype=dtype, seed=2)
    w = _rand(96, dtype=dtype, seed=1)
    x_before, res_before = x.clone(), res.clone()
    out, new_res = triton_ops.rms_norm(x, w, 1e-6, residual=res)
    ref_out, ref_res = torch_ref.rms_norm(x, w, 1e-6, residual=res)
    torch.testing.assert_close(new_res, ref_res, atol=LAYER_ATOL[dtype], rtol=0)
    torch.testing.assert_close(out, ref_out, atol=LAYER_ATOL[dtype], rtol=0)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)


def test_rms_norm_fp32_weight_promotes_like_torch():
    x, w = _rand(3, 64, dtype=torch.float16), _rand(64, seed=1)
    out = triton_ops.rms_norm(x, w, 1e-5)
    ref = torch_ref.rms_norm(x, w, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def _cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,groups", [(64, 1), (128, 4), (64, 8)])
def test_rotary_in_place_on_strided_views(dtype, head_dim, groups):
    tokens, hkv = 5, 2
    hq = hkv * groups
    qkv = _rand(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype)
    qkv_ref = qkv.clone()
    positions = torch.tensor([0, 1, 17, 100, 3], device=DEVICE)
    cache = _cos_sin_cache(128, head_dim)

    def split(t):
        return t[:, : hq * head_dim].view(tokens, hq, head_dim), t[
            :, hq * head_dim : (hq + hkv) * head_dim
        ].view(tokens, hkv, head_dim)

    q, k = split(qkv)
    rq, rk = triton_ops.rotary_embedding(positions, q, k, cache)
    assert rq.data_ptr() == q.data_ptr() and rk.data_ptr() == k.data_ptr()
    torch_ref.rotary_embedding(positions, *split(qkv_ref), cache)
    torch.testing.assert_close(qkv, qkv_ref, atol=LAYER_ATOL[dtype], rtol=0)  # v part untouched too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2 * 172), (2, 3, 2 * 1536)])
def test_silu_and_mul(dtype, shape):
    x = _rand(*shape, dtype=dtype)
    out = triton_ops.silu_and_mul(x)
    torch.testing.assert_close(out, torch_ref.silu_and_mul(x), atol=LAYER_ATOL[dtype], rtol=0)


def test_layer_errors():
    x = _rand(2, 64)
    with pytest.raises(TypeError):
        triton_ops.rms_norm(x.long(), _rand(64), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        triton_ops.rms_norm(x, _rand(32), 1e-5)
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_and_mul(_rand(2, 7))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        triton_ops.rotary_embedding(
            torch.zeros(2, dtype=torch.long, device=DEVICE),
            _rand(2, 1, 64),
            _rand(2, 1, 64),
            _cos_sin_cache(8, 32),
        )
    kc = torch.zeros(2, 16, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_ops.reshape_and_cache(
            _rand(2, 1, 64),
            _rand(2, 1, 64),
            kc,
            kc.clone(),
            torch.zeros(3, dtype=torch.long, device=DEVICE),
        )
    with pytest.raises(TypeError, match="slot_mapping"):
        triton_ops.reshape_and_cache(
            _rand(2, 1, 64), _rand(2, 1, 64), kc, kc.clone(), torch.zeros(2, device=DEVICE)
        )


def test_rms_norm_any_leading_dims_and_strided_rows():
    x = _rand(2, 3, 64)
    w = _rand(64, seed=1)
    torch.testing.assert_close(
        triton_ops.rms_norm(x, w, 1e-5), torch_ref.rms_norm(x, w, 1e-5), atol=1e-5, rtol=0
    )
    wide = _rand(4, 3 * 64, seed=3)
    view = wide[:, 64:128]  # a column slice: rows strided
    res = _rand(4, 64, seed=4)
    ours = triton_ops.rms_norm(view, w, 1e-5, residual=res)
    ref = torch_ref.rms_norm(view, w, 1e-5, residual=res)
    torch.testing.assert_close(ours[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=1e-5, rtol=0)
