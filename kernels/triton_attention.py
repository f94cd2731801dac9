"""Shared pieces of Triton paged attention (:mod:`.triton_decode`, :mod:`.triton_prefill`):
the online-softmax loop both kernels run and the argument checks both entry points share.

Both kernels read K/V through block tables from caches laid out
``[num_blocks, block_size, num_kv_heads, head_dim]`` (see :mod:`prefixgate.kernels.torch_ref`).
Each K/V tile is gathered token by token (``block_tables[b, tok // S] * S + tok % S``), so any
block size works and a tile may span several blocks. Softmax is online (Milakov & Gimelshein
2018, as in FlashAttention, Dao et al. 2022) in fp32, with ``exp2`` and the scale folded into
``log2(e)``: :func:`_attend` folds a range of keys into the running max, sum and output
(:func:`_softmax_start`, :func:`_softmax_output`), one tile at a time.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.paged import PagedKV
from prefixgate.kernels.triton_checks import check_cache, check_device, check_float, check_int
from prefixgate.kernels.triton_env import tl, triton

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(
    -1.0e30
)  # running-max start: finite, so fully masked rows give p = 0, not NaN


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use IEEE fp32 dots (TF32 would break greedy equality with torch)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softmax_start(M: tl.constexpr, D_PAD: tl.constexpr):
    """The empty running state ``(m_i, l_i, acc)``: ``m_i [M]`` = ``NEG_BIG``, ``l_i [M]`` = 0,
    ``acc [M, D_PAD]`` = 0, all fp32."""
    return (
        tl.full([M], NEG_BIG, dtype=tl.float32),
        tl.zeros([M], dtype=tl.float32),
        tl.zeros([M, D_PAD], dtype=tl.float32),
    )


@triton.jit
def _softmax_output(state):
    """The normalized output ``acc / l_i`` ``[M, D_PAD]`` fp32 of a running state (rows that saw
    no key give 0)."""
    m_i, l_i, acc = state
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _load_kv_tile(head_ptr, blk, off, stride_n, stride_s, d, kv_mask):
    """Gather ``[TILE_N, D_PAD]`` rows of one KV head: token i at block ``blk[i]``, offset
    ``off[i]``; masked entries read 0."""
    ptrs = head_ptr + blk[:, None] * stride_n + off[:, None] * stride_s + d[None, :]
    return tl.load(ptrs, mask=kv_mask, other=0.0)


@triton.jit
def _attend(
    q,
    state,
    q_pos,
    start,
    end,
    kv,
    scale_log2,
    d_mask,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold keys ``[start, end)`` into the running softmax, one ``TILE_N`` tile at a time.

    Args:
        q: ``[M, D_PAD]`` query rows (D_PAD a power of two >= 16).
        state: ``(m_i, l_i, acc)`` from :func:`_softmax_start`: ``m_i, l_i [M]`` fp32 running
            max (log2 units) and sum, ``acc [M, D_PAD]`` fp32 unnormalized output.
        q_pos: ``[M]`` absolute query positions; with ``CAUSAL`` row i only sees keys <=
            ``q_pos[i]``.
        kv: one sequence's paged K/V of one KV head, ``(bt_row, k_head, v_head, stride_kn,
            stride_ks, stride_vn, stride_vs)``: its block-table row, the K and V cache
            pointers already offset to the head, and the caches' block and slot strides.
        scale_log2: softmax scale times ``log2(e)``.
        d_mask: ``[D_PAD]`` the columns below head_dim.

    Returns:
        The updated state.
    """
    m_i, l_i, acc = state
    bt_row, k_head, v_head, stride_kn, stride_ks, stride_vn, stride_vs = kv
    d = tl.arange(0, q.shape[1])
    for tok0 in range(start, end, TILE_N):
        toks = tok0 + tl.arange(0, TILE_N)
        t_mask = toks < end
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = toks % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = _load_kv_tile(k_head, blk, off, stride_kn, stride_ks, d, kv_mask)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            s = tl.where((toks[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
        else:
            s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_head, blk, off, stride_vn, stride_vs, d, kv_mask)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


def kernel_strides(q: torch.Tensor, kv: PagedKV, out: torch.Tensor) -> tuple[int, ...]:
    """The eleven stride arguments both attention kernels take, in their order (elements):
    ``q [T, Hq, D]``'s token and head strides, ``kv.k_cache``'s and ``kv.v_cache``'s
    ``[N, S, Hkv, D]`` block, slot and head strides, ``kv.block_tables``' row stride, ``out``'s
    token and head strides.
    """
    return (
        *q.stride()[:2],
        *kv.k_cache.stride()[:3],
        *kv.v_cache.stride()[:3],
        kv.block_tables.stride(0),
        *out.stride()[:2],
    )


def check_attention(q: torch.Tensor, kv: PagedKV, num_seqs: int, *more: torch.Tensor) -> None:
    """Both attention entry points' argument checks: ``q [T, Hq, D]`` float with a contiguous
    last dim, ``kv``'s caches alike and matching it (head_dim, dtype, Hq a multiple of Hkv), its
    block tables and lengths int and of ``num_seqs`` sequences, all on one device with ``more``.

    Raises:
        TypeError / ValueError: see :mod:`.triton_checks`.
    """
    k_cache, block_tables, context_lens = kv.k_cache, kv.block_tables, kv.context_lens
    check_device(q, k_cache, kv.v_cache, block_tables, context_lens, *more)
    check_float("q", q, 3)
    check_cache(k_cache, kv.v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    check_int("block_tables", block_tables, 2)
    check_int("context_lens", context_lens, 1)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match {num_seqs} sequences"
        )
    if block_tables.numel() and block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")
