"""Triton paged prefill attention: causal varlen flash attention over a cached prefix.

Programs are ``(query tile, query head)``. Tiles are laid out without a host sync as in vLLM's
unified attention: sequence b owns tiles ``[qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M + b + 1)``
and a program finds its sequence by binary search over ``query_start_loc``. KV tiles that every
query of the tile sees skip the causal mask; the diagonal band applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from prefixgate.kernels.paged import PagedKV
from prefixgate.kernels.triton_attention import (
    LOG2E,
    _attend,
    _dot_precision,
    _softmax_output,
    _softmax_start,
    check_attention,
    kernel_strides,
)
from prefixgate.kernels.triton_checks import check_int
from prefixgate.kernels.triton_env import interpreting, next_pow2, tl, triton


@dataclass(slots=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (tile sizes are powers of two >= 16)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)

    # The sequence b owning this tile: the largest b with qsl[b] // BLOCK_M + b <= tile.
    lo = tl.zeros([], dtype=tl.int32)
    hi = num_seqs - 1 + lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    b = lo
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    local = tile - (q_start // BLOCK_M + b)
    if local * BLOCK_M >= q_len:
        return

    ctx = tl.load(context_lens_ptr + b)
    first_pos = ctx - q_len  # absolute position of the chunk's first query
    rows = local * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = first_pos + rows
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    kvh = h // GROUPS

    kv_end = tl.minimum(ctx, first_pos + (local + 1) * BLOCK_M)  # past the tile's last query
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    kv = (
        bt_row,
        k_cache_ptr + kvh * stride_kh,
        v_cache_ptr + kvh * stride_vh,
        stride_kn,
        stride_ks,
        stride_vn,
        stride_vs,
    )
    # Keys below the tile's first query position are visible to every row: no causal mask.
    full_end = tl.minimum((first_pos + local * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    state = _softmax_start(BLOCK_M, D_PAD)
    state = _attend(
        q,
        state,
        q_pos,
        0,
        full_end,
        kv,
        scale_log2,
        d_mask,
        BLOCK_N,
        BLOCK_SIZE,
        False,
        DOT_PRECISION,
    )
    # the diagonal band
    state = _attend(
        q,
        state,
        q_pos,
        full_end,
        kv_end,
        kv,
        scale_log2,
        d_mask,
        BLOCK_N,
        BLOCK_SIZE,
        True,
        DOT_PRECISION,
    )

    out = _softmax_output(state)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def default_prefill_config(head_dim: int, device: torch.device) -> PrefillConfig:
    """Tiles for the prefill kernel: 64 x 64 on GPU (8 warps past head_dim 64), 32 x 32 on
    the interpreter (fewer, larger numpy steps)."""
    if interpreting() or device.type != "cuda":
        return PrefillConfig(block_m=32, block_n=32)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def paged_attention_prefill(
    q: torch.Tensor,
    kv: PagedKV,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention for a varlen batch of query chunks over paged K/V.

    Sequence b's queries ``q[query_start_loc[b]:query_start_loc[b+1]]`` are its last tokens;
    the first sits at position ``kv.context_lens[b] - q_len`` (earlier tokens already cached).

    Args:
        q: ``[T, Hq, D]``, last dim contiguous.
        kv: the B sequences' paged K/V, this chunk's already written.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths from 0 (non-decreasing).
        scale: softmax scale.
        config: tile / launch options (default :func:`default_prefill_config`); the backend's
            entry point (``torch_ref``'s signature) leaves it out.

    Returns:
        ``[T, Hq, D]`` in q's dtype (contiguous).

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    check_int("query_start_loc", query_start_loc, 1)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold B + 1 >= 1 offsets")
    check_attention(q, kv, num_seqs, query_start_loc)
    total, num_heads, head_dim = q.shape
    out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0 or num_seqs == 0:
        return out
    cfg = config or default_prefill_config(head_dim, q.device)
    block_size, num_kv_heads = kv.k_cache.shape[1], kv.k_cache.shape[2]
    grid = (total // cfg.block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        query_start_loc,
        kv.context_lens,
        out,
        float(scale) * LOG2E,
        num_seqs,
        *kernel_strides(q, kv, out),
        GROUPS=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, cfg.block_m),
        BLOCK_N=max(16, cfg.block_n),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def paged_attention_verify(
    q: torch.Tensor,
    kv: PagedKV,
    query_start_loc: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    query_index: torch.Tensor | None = None,
    output_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Speculative decoding's verify rows (``torch_ref.paged_attention_verify``'s signature):
    the prefill kernel, which handles short varlen queries as they are; the host layout
    (``mask``, ``query_index``, ``output_index``) is the torch path's and is not read here.

    Returns:
        ``[T, Hq, D]`` in q's dtype.

    Raises:
        TypeError / ValueError: as ``paged_attention_prefill``.
    """
    del mask, query_index, output_index
    return paged_attention_prefill(q, kv, query_start_loc, scale)
