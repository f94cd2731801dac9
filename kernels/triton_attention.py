"""Triton paged attention: flash-decoding for decode, causal varlen flash attention for prefill.

Both kernels read K/V through block tables from caches laid out
``[num_blocks, block_size, num_kv_heads, head_dim]`` (see :mod:`prefixgate.kernels.torch_ref`).
Each K/V tile is gathered token by token (``block_tables[b, tok // S] * S + tok % S``), so any
block size works and a tile may span several blocks. Softmax is online (Milakov & Gimelshein
2018, as in FlashAttention, Dao et al. 2022) in fp32, with ``exp2`` and the scale folded into
``log2(e)``.

Decode is split-K over the context (flash-decoding, Dao et al. 2023): program
``(kv_head, b, split)`` handles the GQA group of query heads of one KV head (padded to 16 rows
for ``tl.dot``) over one slice of the context and writes an unnormalized partial output with
its running max and sum; a second kernel merges the splits. With one split the first kernel
writes the output directly.

Prefill programs are ``(query tile, query head)``: tiles are laid out without a host sync as in
vLLM's unified attention — sequence b owns tiles ``[qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M
+ b + 1)`` and a program finds its sequence by binary search over ``query_start_loc``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from prefixgate.kernels.triton_env import interpreting, next_pow2, tl, triton

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so fully masked rows give p = 0, not NaN


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


@dataclass(slots=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (tile sizes are powers of two >= 16)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use IEEE fp32 dots (TF32 would break greedy equality with torch)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _online_softmax_step(
    q, m_i, l_i, acc, q_pos, tok0, kv_end,
    bt_row, k_cache_ptr, v_cache_ptr, kvh,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    scale_log2, d, d_mask,
    TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold KV tile ``[tok0, tok0 + TILE_N)`` (keys < ``kv_end``) into the running softmax.

    ``q [M, D_PAD]``; ``m_i, l_i [M]`` fp32 running max (log2 units) and sum; ``acc [M, D_PAD]``
    fp32 unnormalized output. With ``CAUSAL`` row i only sees keys <= ``q_pos[i]``.
    Returns the updated ``(m_i, l_i, acc)``.
    """
    toks = tok0 + tl.arange(0, TILE_N)
    t_mask = toks < kv_end
    blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    off = toks % BLOCK_SIZE
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache_ptr + blk[:, None] * stride_kn + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
        mask=kv_mask, other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if CAUSAL:
        s = tl.where((toks[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
    else:
        s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + blk[:, None] * stride_vn + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
        mask=kv_mask, other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    tokens_per_split,
    GROUPS: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([G_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tok0 in range(start, end, TILE_N):
        m_i, l_i, acc = _online_softmax_step(
            q, m_i, l_i, acc, g, tok0, end, bt_row, k_cache_ptr, v_cache_ptr, kvh,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            scale_log2, d, d_mask, TILE_N, BLOCK_SIZE, False, DOT_PRECISION,
        )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # partials: acc [B, Hq, NUM_SPLITS, D_PAD], ml [B, Hq, NUM_SPLITS, 2] (max, sum), fp32
        row = (b.to(tl.int64) * num_kv_heads * GROUPS + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
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
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :], mask=sp_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # split s's weight relative to the global max
    den = tl.sum(l_s * w, 0)
    num = tl.sum(acc * w[:, None], 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                      tile_n: int) -> int:
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


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Paged decode attention (flash-decoding); arguments as ``torch_ref.paged_attention_decode``.

    Args:
        q: ``[B, Hq, D]`` fp32/fp16/bf16, last dim contiguous.
        k_cache, v_cache: ``[N, S, Hkv, D]``, q's dtype, last dim contiguous.
        block_tables: ``[B, max_blocks]`` int32; its width bounds the context for the split
            heuristic.
        context_lens: ``[B]`` int32 (>= 1).
        scale: softmax scale.
        config: tile / split / launch options (defaults: :class:`DecodeConfig`).

    Returns:
        ``[B, Hq, D]`` in q's dtype.
    """
    cfg = config or DecodeConfig()
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    groups = num_heads // num_kv_heads
    tile_n = max(16, cfg.tile_n)
    max_context = block_tables.shape[1] * block_size
    splits = cfg.num_splits or choose_num_splits(batch, num_kv_heads, max_context, q.device, tile_n)
    tokens_per_split = math.ceil(math.ceil(max_context / splits) / tile_n) * tile_n
    d_pad = next_pow2(head_dim, 16)
    if splits > 1:
        part_acc = torch.empty((batch, num_heads, splits, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(num_kv_heads, batch, splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_ml,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        tokens_per_split,
        GROUPS=groups, G_PAD=next_pow2(groups, 16),
        HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n,
        NUM_SPLITS=splits, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_ml, out,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad,
            NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
            num_warps=1 if d_pad <= 64 else 2,
        )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    out_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh,
    stride_kn, stride_ks, stride_kh,
    stride_vn, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    kvh = h // GROUPS

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    kv_end = tl.minimum(ctx, first_pos + (local + 1) * BLOCK_M)  # past the tile's last query
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    # Keys below the tile's first query position are visible to every row: no causal mask.
    full_end = tl.minimum((first_pos + local * BLOCK_M + 1) // BLOCK_N * BLOCK_N, kv_end)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _online_softmax_step(
            q, m_i, l_i, acc, q_pos, n0, full_end, bt_row, k_cache_ptr, v_cache_ptr, kvh,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            scale_log2, d, d_mask, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal band
        m_i, l_i, acc = _online_softmax_step(
            q, m_i, l_i, acc, q_pos, n0, kv_end, bt_row, k_cache_ptr, v_cache_ptr, kvh,
            stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
            scale_log2, d, d_mask, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :],
    )


def default_prefill_config(head_dim: int, device: torch.device) -> PrefillConfig:
    """Tiles for the prefill kernel: 64 x 64 on GPU (8 warps past head_dim 64), 32 x 32 on
    the interpreter (fewer, larger numpy steps)."""
    if interpreting() or device.type != "cuda":
        return PrefillConfig(block_m=32, block_n=32)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal varlen prefill attention over paged K/V; arguments as
    ``torch_ref.paged_attention_prefill``.

    Args:
        q: ``[T, Hq, D]``, last dim contiguous.
        k_cache, v_cache: ``[N, S, Hkv, D]``; this chunk's K/V already written.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32 (starts at 0, non-decreasing).
        context_lens: ``[B]`` int32, tokens per sequence including the chunk.
        scale: softmax scale.
        config: tile / launch options (default :func:`default_prefill_config`).

    Returns:
        ``[T, Hq, D]`` in q's dtype (contiguous).
    """
    total, num_heads, head_dim = q.shape
    out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    cfg = config or default_prefill_config(head_dim, q.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    grid = (total // cfg.block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUPS=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_M=max(16, cfg.block_m), BLOCK_N=max(16, cfg.block_n),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
