"""Pure-torch reference implementations of every kernel (the CPU backend).

Shapes use T = tokens in the flat batch, B = sequences, Hq / Hkv = query / KV heads,
D = head dim, N = KV blocks, S = block size. Caches are laid out
``[num_blocks, block_size, num_kv_heads, head_dim]`` (one tensor for K, one for V, per layer).
The Triton kernels in this package have the same signatures and semantics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prefixgate.kernels.paged import PagedKV


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into their cache slots, in place.

    Args:
        key, value: ``[T, Hkv, D]``, the cache's dtype (or castable to it).
        k_cache, v_cache: ``[N, S, Hkv, D]``.
        slot_mapping: ``[T]`` int64, slot = block_id * S + offset; -1 skips the token.
    """
    num_blocks, block_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of B sequences from the paged cache, heads first for SDPA.

    Args:
        cache: ``[N, S, Hkv, D]``.
        block_tables: ``[B, max_blocks]`` block ids.
        length: keys to return per sequence (the longest context); rows past a sequence's own
            context are whatever its padding blocks hold and must be masked by the caller.

    Returns:
        ``[B, Hkv, length, D]`` (a gathered copy; the last dim contiguous).
    """
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    batch = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1)
    # index_select copies whole blocks (rows of S * Hkv * D values): several times faster on
    # CPU than advanced indexing ``cache[table]``, and it takes int32 ids as they are.
    blocks = cache.index_select(0, ids)  # [B * nb, S, Hkv, D]
    flat = blocks.view(batch, num_blocks * block_size, *cache.shape[2:])
    return flat[:, :length].transpose(1, 2)


def paged_attention_decode(q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    """One query token per sequence attending over its whole paged context.

    All sequences at once: K/V are gathered through the block tables into ``[B, Hkv, L, D]``
    (L = longest context) and handed to ``torch.nn.functional.scaled_dot_product_attention``
    with a key-padding mask. The G = Hq / Hkv query heads sharing a KV head ride in SDPA's
    query-length dimension, so GQA needs no K/V repeat.

    Args:
        q: ``[B, Hq, D]``; Hq a multiple of Hkv (GQA).
        kv: the B sequences' paged K/V, the new token's already written.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[B, Hq, D]`` in q's dtype (SDPA accumulates in fp32 for half types).
    """
    batch, hq, d = q.shape
    if batch == 0:
        return torch.empty_like(q)
    hkv = kv.k_cache.shape[2]
    lens = kv.context_lens.long()
    max_len = int(lens.max())
    k = _gather_kv(kv.k_cache, kv.block_tables, max_len)
    v = _gather_kv(kv.v_cache, kv.block_tables, max_len)
    qg = q.reshape(batch, hkv, hq // hkv, d)  # [B, Hkv, G, D]: the group as query rows
    mask = None
    if bool((lens != max_len).any()):
        keys = torch.arange(max_len, device=q.device)
        mask = (keys.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, hq, d)


def paged_attention_prefill(
    q: torch.Tensor, kv: PagedKV, query_start_loc: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention for a varlen batch of query chunks over paged K/V.

    Sequence b's queries are ``q[query_start_loc[b]:query_start_loc[b+1]]``; they are its
    last ``q_len`` tokens, so the first query sits at position ``kv.context_lens[b] - q_len``
    (tokens before it are a cached prefix or earlier chunks, already in the cache).

    One ``scaled_dot_product_attention`` call for the whole batch: queries padded to
    ``[B, Hq, max_q, D]``, K/V gathered through the block tables to ``[B, Hkv, max_ctx, D]``
    (``enable_gqa``). When every chunk starts at position 0 with the same length the causal
    mask is SDPA's own ``is_causal`` (no mask tensor, upper blocks skipped); otherwise a
    boolean mask lets query i of sequence b see keys ``0 .. kv.context_lens[b] - q_len + i``.

    Args:
        q: ``[T, Hq, D]``.
        kv: the B sequences' paged K/V, this chunk's already written.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths (starts at 0).
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    batch = kv.context_lens.shape[0]
    total, hq, d = q.shape
    if batch == 0 or total == 0:
        return torch.empty_like(q)
    dev = q.device
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    ctx = kv.context_lens.long()
    max_q = int(q_lens.max())
    max_ctx = int(ctx.max())
    k = _gather_kv(kv.k_cache, kv.block_tables, max_ctx)
    v = _gather_kv(kv.v_cache, kv.block_tables, max_ctx)
    if bool(((q_lens == max_q) & (ctx == max_q)).all()):
        # Whole prompts of one length (no cached prefix): plain causal, no padding.
        qb = q.reshape(batch, max_q, hq, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(total, hq, d)
    rows = torch.arange(max_q, device=dev)
    valid = rows.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
    # Padding rows repeat the chunk's last query so no row is fully masked (no NaN).
    row = torch.minimum(rows.unsqueeze(0), (q_lens - 1).clamp(min=0).unsqueeze(1))
    token = qsl[:-1].unsqueeze(1) + row  # [B, max_q] flat token index
    flat_token = token.clamp(max=total - 1).reshape(-1)
    qb = q.index_select(0, flat_token).view(batch, max_q, hq, d).transpose(1, 2)
    pos = (ctx - q_lens).unsqueeze(1) + row  # absolute position of each query row
    keys = torch.arange(max_ctx, device=dev)
    mask = keys.view(1, 1, -1) <= pos.unsqueeze(2)  # [B, max_q, max_ctx]
    out = F.scaled_dot_product_attention(
        qb, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True
    )
    out = out.transpose(1, 2)  # [B, max_q, Hq, D]
    result = torch.empty_like(q)
    result[token[valid]] = out[valid]
    return result


def paged_attention_verify(
    q: torch.Tensor,
    kv: PagedKV,
    query_start_loc: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    query_index: torch.Tensor | None = None,
    output_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of short query chunks (speculative decoding's verify rows: a decode and
    its drafts) over paged K/V: ``paged_attention_prefill``'s result, computed as a decode is.

    The first four arguments and the result are ``paged_attention_prefill``'s; the layout
    (``prefixgate.engine.attention_metadata.verify_layout_arrays``, built once per step on the
    host) replaces its per-call index arithmetic: queries padded to ``Q`` rows per sequence
    (``query_index``), the ``G = Hq / Hkv`` query heads of a KV head riding in SDPA's query
    dimension as ``Q * G`` rows (no K/V repeat, as in ``paged_attention_decode``), one SDPA
    call with ``mask``, the real rows picked back (``output_index``).

    Args:
        q: ``[T, Hq, D]``.
        kv: the B sequences' paged K/V, these queries' already written (``kv.context_lens``
            unused here: ``mask`` holds them).
        query_start_loc: ``[B + 1]`` int32 (unused here: the layout holds it).
        scale: softmax scale.
        mask: ``[B, 1, Q, L]`` additive float mask (0: visible, ``-inf``: not) or bool (True:
            visible) per padded query row, ``L`` >= every context.
        query_index: ``[B * Q]`` int64 index into ``q`` of each padded row, or ``None`` when
            ``T == B * Q`` (no padding).
        output_index: ``[T]`` int64 padded row of each query, or ``None`` (no padding).

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    del query_start_loc  # the layout carries it (and the context lengths)
    batch = kv.block_tables.shape[0]
    total, hq, d = q.shape
    if batch == 0 or total == 0:
        return torch.empty_like(q)
    qlen, length = mask.shape[2], mask.shape[3]
    hkv = kv.k_cache.shape[2]
    group = hq // hkv
    k = _gather_kv(kv.k_cache, kv.block_tables, length)
    v = _gather_kv(kv.v_cache, kv.block_tables, length)
    padded = q if query_index is None else q.index_select(0, query_index)
    if group == 1:  # [B * Q, H, D] -> [B, H, Q, D]: a strided view, no copy
        out = F.scaled_dot_product_attention(
            padded.view(batch, qlen, hq, d).transpose(1, 2), k, v, attn_mask=mask, scale=scale
        )
    else:  # [B * Q, Hkv * G, D] -> [B, Hkv, Q * G, D]: row i * G + g is query i, head kv*G + g
        qg = padded.view(batch, qlen, hkv, group, d).transpose(1, 2).reshape(batch, hkv, -1, d)
        rows_mask = mask.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=rows_mask, scale=scale)
    # [B, Hkv, Q * G, D] -> [B * Q, Hq, D]
    out = out.view(batch, hkv, qlen, group, d).transpose(1, 2).reshape(batch * qlen, hq, d)
    return out if output_index is None else out.index_select(0, output_index)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019), optionally fused with a residual add first.

    Computes in fp32 and casts back, as Hugging Face's LlamaRMSNorm does.

    Args:
        x: ``[T, H]``.
        weight: ``[H]``.
        eps: added to the mean square.
        residual: ``[T, H]`` or None. When given, ``x = x + residual`` is normalized and the
            sum is returned as the new residual.

    Returns:
        ``out [T, H]``, or ``(out, new_residual)`` when a residual is given.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021), half-split (GPT-NeoX / HF Llama) layout.

    Args:
        positions: ``[T]`` int64 absolute positions.
        q: ``[T, Hq, D]``, k: ``[T, Hkv, D]``; rotated in place and returned.
        cos_sin_cache: ``[max_pos, D]`` fp32, ``cos`` in the first D/2 columns, ``sin`` in the last.
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    # out = t * [cos, cos] + [x2, x1] * [-sin, sin]: elementwise the same products and sums as
    # HF's ``q * cos + rotate_half(q) * sin`` (negation is exact), in half the ops.
    cos2 = torch.cat([cos, cos], dim=-1).unsqueeze(1)  # [T, 1, D]
    sin2 = torch.cat([-sin, sin], dim=-1).unsqueeze(1)
    for t in (q, k):
        tf = t.float()
        rot = torch.cat([tf[..., half:], tf[..., :half]], dim=-1)
        t.copy_(tf * cos2 + rot * sin2)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]`` for ``x [T, 2I]`` → ``[T, I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
