"""Triton paged decode attention: flash-decoding (split-K over the context + a reduce kernel).

Program ``(kv_head, b, split)`` handles the GQA group of query heads of one KV head (padded to
16 rows for ``tl.dot``) over one slice of sequence b's context (flash-decoding, Dao et al.
2023) and writes an unnormalized partial output with its running max and sum; a second kernel
merges the splits. With one split the first kernel writes the output directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from prefixgate.kernels.paged import PagedKV
from prefixgate.kernels.triton_attention import (
    LOG2E,
    NEG_BIG,
    _attend,
    _dot_precision,
    _softmax_output,
    _softmax_start,
    check_attention,
    kernel_strides,
)
from prefixgate.kernels.triton_env import interpreting, next_pow2, tl, triton


@dataclass(slots=True)
class DecodeConfig:
    """Launch parameters of the decode kernel.

    Attributes:
        tile_n: context tokens per loop iteration (power of two >= 16).
        num_splits: context slices (1 = no reduce kernel); ``None`` picks by heuristic.
        num_warps, num_stages: Triton launch options (ignored by the interpreter).
    """

    tile_n: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    tokens_per_split,
    GROUPS: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kvh = tl.program_id(0)  # fastest-varying: neighbouring programs read the same token rows
    b = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)

    ctx = tl.load(context_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUPS
    d_mask = d < HEAD_DIM
    heads = kvh * GROUPS + g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

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
    state = _softmax_start(G_PAD, D_PAD)
    state = _attend(
        q, state, g, start, end, kv, scale_log2, d_mask, TILE_N, BLOCK_SIZE, False, DOT_PRECISION
    )

    if NUM_SPLITS == 1:
        out = _softmax_output(state)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # partials: acc [B, Hq, NUM_SPLITS, D_PAD], ml [B, Hq, NUM_SPLITS, 2] (max, sum), fp32
        m_i, l_i, acc = state
        row = (b.to(tl.int64) * num_kv_heads * GROUPS + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    sp_mask = sp < NUM_SPLITS
    row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + row * 2, mask=sp_mask, other=NEG_BIG)
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + row[:, None] * D_PAD + d[None, :], mask=sp_mask[:, None], other=0.0
    )
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # split s's weight relative to the global max
    den = tl.sum(l_s * w, 0)
    num = tl.sum(acc * w[:, None], 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device, tile_n: int
) -> int:
    """Context slices so that ``batch * num_kv_heads * splits`` fills the GPU about twice over.

    ``max_context`` (tokens) is an upper bound read from the block table's width, so no host
    sync is needed; each split keeps at least 256 tokens (or one tile). Returns 1 on the
    interpreter unless contexts are long (more programs only cost time there).
    """
    min_tokens = max(256, tile_n)
    most = max(1, math.ceil(max_context / min_tokens))
    if interpreting() or device.type != "cuda":
        return min(most, max(1, math.ceil(max_context / 4096)))
    want = math.ceil(2 * _num_sms(device) / max(1, batch * num_kv_heads))
    return max(1, min(most, want, 64))


def paged_attention_decode(
    q: torch.Tensor, kv: PagedKV, scale: float, *, config: DecodeConfig | None = None
) -> torch.Tensor:
    """One query token per sequence over its paged context (flash-decoding split-K).

    Args:
        q: ``[B, Hq, D]`` fp32/fp16/bf16, last dim contiguous; Hq a multiple of Hkv (GQA).
        kv: the B sequences' paged K/V (caches in q's dtype, last dim contiguous), the new
            token's already written; the block tables' width bounds the context for the split
            heuristic.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        config: tile / split / launch options (defaults: :class:`DecodeConfig`); the backend's
            entry point (``torch_ref``'s signature) leaves it out.

    Returns:
        ``[B, Hq, D]`` in q's dtype (softmax and accumulation in fp32).

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    check_attention(q, kv, q.shape[0])
    cfg = config or DecodeConfig()
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv.k_cache.shape[1], kv.k_cache.shape[2]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    groups = num_heads // num_kv_heads
    tile_n = max(16, cfg.tile_n)
    max_context = kv.block_tables.shape[1] * block_size
    splits = cfg.num_splits or choose_num_splits(batch, num_kv_heads, max_context, q.device, tile_n)
    tokens_per_split = math.ceil(math.ceil(max_context / splits) / tile_n) * tile_n
    d_pad = next_pow2(head_dim, 16)
    if splits > 1:
        part_acc = torch.empty(
            (batch, num_heads, splits, d_pad), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((batch, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(num_kv_heads, batch, splits)](
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.context_lens,
        out,
        part_acc,
        part_ml,
        float(scale) * LOG2E,
        *kernel_strides(q, kv, out),
        tokens_per_split,
        GROUPS=groups,
        G_PAD=next_pow2(groups, 16),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=splits,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=next_pow2(splits),
            num_warps=1 if d_pad <= 64 else 2,
        )
    return out
