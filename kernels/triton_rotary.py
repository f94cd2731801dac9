"""Triton rotary embedding (``rotary_embedding``, as ``torch_ref.rotary_embedding``), in place.

One program rotates one token's query and key heads in fp32 (half-split layout). q and k may
be strided views, e.g. split from a fused QKV projection, as long as their last dim is
contiguous.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_checks import check_device, check_float, check_int
from prefixgate.kernels.triton_env import next_pow2, tl, triton


@triton.jit
def _rotate_heads(
    head_ptr,
    stride_h,
    cos,
    sin,
    c,
    c_mask,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotate one token's ``NUM_HEADS`` heads in place: ``head_ptr`` points at its first head,
    ``cos``/``sin [HALF_PAD]`` fp32 are its position's angles over columns ``c`` (< ``HALF``
    where ``c_mask``)."""
    h = tl.arange(0, H_PAD)
    mask = (h[:, None] < NUM_HEADS) & c_mask[None, :]
    x1_ptr = head_ptr + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = head_ptr.dtype.element_ty
    tl.store(x1_ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(x1_ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


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
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, c, c_mask, NUM_Q_HEADS, HQ_PAD, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, c, c_mask, NUM_K_HEADS, HK_PAD, HALF)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (Su et al. 2021), half-split (GPT-NeoX / HF Llama) layout, in place.

    Args:
        positions: ``[T]`` int64 absolute positions (< max_pos).
        q: ``[T, Hq, D]``, k: ``[T, Hkv, D]``; rotated in place and returned.
        cos_sin_cache: ``[max_pos, D]`` fp32, cos in the first D/2 columns, sin in the last.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    check_device(positions, q, k, cos_sin_cache)
    check_int("positions", positions, 1)
    check_float("q", q, 3)
    check_float("k", k, 3)
    check_float("cos_sin_cache", cos_sin_cache, 2)
    if q.shape[0] != positions.shape[0] or k.shape[0] != positions.shape[0]:
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} / positions {tuple(positions.shape)} disagree on T"
        )
    if cos_sin_cache.shape[1] != q.shape[2] or k.shape[2] != q.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the (even) head_dim "
            f"of q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
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
