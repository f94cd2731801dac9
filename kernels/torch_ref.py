"""Pure-torch reference implementations of every kernel (the CPU backend).

Shapes use T = tokens in the flat batch, B = sequences, Hq / Hkv = query / KV heads,
D = head dim, N = KV blocks, S = block size. Caches are laid out
``[num_blocks, block_size, num_kv_heads, head_dim]`` (one tensor for K, one for V, per layer).
The Triton kernels in this package have the same signatures and semantics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat[slots] = key[valid].to(k_cache.dtype)
    v_flat[slots] = value[valid].to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence from the paged cache: ``[length, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, S, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int
) -> torch.Tensor:
    """Attention of ``q [Lq, Hq, D]`` over ``k, v [Lk, Hkv, D]`` in fp32.

    Query i sits at absolute position ``causal_offset + i`` and sees keys ``0..causal_offset+i``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    groups = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, Lk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(groups, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    lq, lk = q.shape[0], k.shape[0]
    q_pos = torch.arange(lq, device=q.device).unsqueeze(1) + causal_offset
    k_pos = torch.arange(lk, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1).to(q.dtype)  # [Lq, Hq, D]


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending over its whole paged context.

    Args:
        q: ``[B, Hq, D]``; Hq a multiple of Hkv (GQA).
        k_cache, v_cache: ``[N, S, Hkv, D]``; the new token's K/V already written.
        block_tables: ``[B, max_blocks]`` int32 block ids (padding entries unused).
        context_lens: ``[B]`` int32, tokens in the context including the new one (>= 1).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[B, Hq, D]`` in q's dtype (accumulated in fp32).
    """
    batch = q.shape[0]
    if batch == 0:
        return torch.empty_like(q)
    lens = context_lens.long()
    max_len = int(lens.max())
    block_size = k_cache.shape[1]
    max_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :max_blocks].long()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[table].reshape(batch, max_blocks * block_size, hkv, d)[:, :max_len]
    v = v_cache[table].reshape(batch, max_blocks * block_size, hkv, d)[:, :max_len]
    groups = q.shape[1] // hkv
    qf = q.float().view(batch, hkv, groups, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k.float()) * scale
    mask = torch.arange(max_len, device=q.device).unsqueeze(0) >= lens.unsqueeze(1)  # [B, L]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.float())
    return out.reshape(batch, q.shape[1], d).to(q.dtype)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a varlen batch of query chunks over paged K/V.

    Sequence b's queries are ``q[query_start_loc[b]:query_start_loc[b+1]]``; they are its
    last ``q_len`` tokens, so the first query sits at position ``context_lens[b] - q_len``
    (tokens before it are a cached prefix or earlier chunks, already in the cache).

    Args:
        q: ``[T, Hq, D]``.
        k_cache, v_cache: ``[N, S, Hkv, D]``; this chunk's K/V already written.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths (starts at 0).
        context_lens: ``[B]`` int32 total tokens per sequence including this chunk.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = _gather_kv(k_cache, block_tables[b], lens[b])
        v = _gather_kv(v_cache, block_tables[b], lens[b])
        out[s:e] = _attend(q[s:e], k, v, scale, lens[b] - (e - s))
    return out


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
    cos_sin = cos_sin_cache[positions.long()]
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, :half].unsqueeze(1)
    sin = cos_sin[:, half:].unsqueeze(1)
    for t in (q, k):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half:] = o2.to(t.dtype)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]`` for ``x [T, 2I]`` → ``[T, I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
