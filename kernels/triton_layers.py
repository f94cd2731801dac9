"""Triton kernels for the per-token layers: KV cache write, fused RMSNorm, rotary, SiLU-and-mul.

Every kernel computes in fp32 and rounds where the torch reference
(:mod:`prefixgate.kernels.torch_ref`) rounds, so fp32 results match it to the last bits and
fp16/bf16 results to one rounding. Inputs may be strided views (e.g. q/k/v split from a fused
projection) as long as their last dim is contiguous.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_env import next_pow2, tl, triton


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_ch,  # cache: flat slot stride and head stride (both caches alike)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value [T, Hkv, D]`` into ``k_cache``/``v_cache [N, S, Hkv, D]`` at
    ``slot_mapping [T]`` (int64, -1 skips). Caches must be contiguous. In place."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_heads),
        D_PAD=next_pow2(head_dim),
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm over ``x [T, H]``; see ``torch_ref.rms_norm``.

    Returns ``out [T, H]`` (dtype promoted from weight and x, as torch does), or
    ``(out, x + residual)`` when ``residual [T, H]`` is given. Inputs are not modified.
    """
    rows, hidden = x.shape
    out = torch.empty(
        (rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )
    res_out = (
        torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
        if residual is not None
        else None
    )
    if rows > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out if res_out is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if res_out is None else (out, res_out)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)
    c_mask = c < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + c, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + c, mask=c_mask, other=0.0).to(tl.float32)

    hq = tl.arange(0, HQ_PAD)
    q_mask = (hq[:, None] < NUM_Q_HEADS) & c_mask[None, :]
    q1_ptr = q_ptr + t * stride_qt + hq[:, None] * stride_qh + c[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(
        q1_ptr, (q1 * cos[None, :] - q2 * sin[None, :]).to(q_ptr.dtype.element_ty), mask=q_mask
    )
    tl.store(
        q1_ptr + HALF,
        (q2 * cos[None, :] + q1 * sin[None, :]).to(q_ptr.dtype.element_ty),
        mask=q_mask,
    )

    hk = tl.arange(0, HK_PAD)
    k_mask = (hk[:, None] < NUM_K_HEADS) & c_mask[None, :]
    k1_ptr = k_ptr + t * stride_kt + hk[:, None] * stride_kh + c[None, :]
    k1 = tl.load(k1_ptr, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(
        k1_ptr, (k1 * cos[None, :] - k2 * sin[None, :]).to(k_ptr.dtype.element_ty), mask=k_mask
    )
    tl.store(
        k1_ptr + HALF,
        (k2 * cos[None, :] + k1 * sin[None, :]).to(k_ptr.dtype.element_ty),
        mask=k_mask,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split rotary on ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (both returned);
    ``cos_sin_cache [max_pos, D]`` holds cos | sin. See ``torch_ref.rotary_embedding``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    half = cos_sin_cache.shape[-1] // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=half,
        HALF_PAD=next_pow2(half),
        HQ_PAD=next_pow2(num_q_heads),
        HK_PAD=next_pow2(num_k_heads),
    )
    return q, k


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]`` → ``[..., I]``."""
    inter = x.shape[-1] // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            num_warps=min(8, max(1, block // 128)),
        )
    return out.reshape(*lead, inter)
