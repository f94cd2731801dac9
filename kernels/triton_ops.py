"""Public Triton entry points, with the signatures and semantics of :mod:`.torch_ref`.

``get_backend("triton")`` returns these. On a machine without CUDA they run in Triton's
interpreter: :mod:`.triton_env` sets ``TRITON_INTERPRET=1`` before any kernel is decorated, so
``attention_backend="triton"`` works on CPU tensors too (slowly; for tests). Arguments are
checked here and bad ones raise ``ValueError`` / ``TypeError`` before any launch.

Tolerances against the torch references (see ``tests/kernels``): fp32 about 1e-5 (different
summation order); fp16 about 2e-3 and bf16 about 2e-2 for attention (P is rounded to the
input dtype before the P·V dot, as in FlashAttention).
"""

from __future__ import annotations

import torch
from prefixgate.kernels import triton_decode, triton_layers, triton_prefill
from prefixgate.kernels.triton_env import interpreting

__all__ = [
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} and {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 before "
            "importing triton to run them on CPU"
        )


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_int(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in _INTS:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_float("k_cache", k_cache, 4)
    _check_float("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} differ"
        )


def _check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_seqs: int,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    _check_int("block_tables", block_tables, 2)
    _check_int("context_lens", context_lens, 1)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match {num_seqs} sequences"
        )
    if block_tables.numel() and block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dim")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [T, Hkv, D]`` into ``k_cache``/``v_cache [N, S, Hkv, D]`` at
    ``slot_mapping [T]`` (int64 slot = block_id * S + offset; -1 skips), in place.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes, devices or non-contiguous caches.
    """
    _check_device(key, value, k_cache, v_cache, slot_mapping)
    _check_float("key", key, 3)
    _check_float("value", value, 3)
    _check_cache(k_cache, v_cache)
    _check_int("slot_mapping", slot_mapping, 1)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache "
            f"{tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    triton_layers.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged context (flash-decoding split-K).

    Args:
        q: ``[B, Hq, D]``; Hq a multiple of Hkv (GQA).
        k_cache, v_cache: ``[N, S, Hkv, D]`` in q's dtype; the new token's K/V already written.
        block_tables: ``[B, max_blocks]`` int32 block ids.
        context_lens: ``[B]`` int32 tokens including the new one (>= 1).
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[B, Hq, D]`` in q's dtype (softmax and accumulation in fp32).

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    _check_device(q, k_cache, v_cache, block_tables, context_lens)
    _check_float("q", q, 3)
    _check_cache(k_cache, v_cache)
    _check_attention(q, k_cache, block_tables, context_lens, q.shape[0])
    return triton_decode.decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


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

    Sequence b's queries ``q[query_start_loc[b]:query_start_loc[b+1]]`` are its last tokens;
    the first sits at position ``context_lens[b] - q_len`` (earlier tokens already cached).

    Args:
        q: ``[T, Hq, D]``.
        k_cache, v_cache: ``[N, S, Hkv, D]``; this chunk's K/V already written.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths from 0.
        context_lens: ``[B]`` int32 tokens per sequence including this chunk.
        scale: softmax scale.

    Returns:
        ``[T, Hq, D]`` in q's dtype.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    _check_device(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    _check_float("q", q, 3)
    _check_cache(k_cache, v_cache)
    _check_int("query_start_loc", query_start_loc, 1)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold B + 1 >= 1 offsets")
    _check_attention(q, k_cache, block_tables, context_lens, num_seqs)
    return triton_prefill.prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, float(scale)
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm (Zhang & Sennrich 2019) in fp32, cast as HF's LlamaRMSNorm.

    Args:
        x: ``[T, H]`` (any leading dims); weight: ``[H]``; eps: added to the mean square;
        residual: like x, or None (then ``x + residual`` is normalized and returned too).

    Returns:
        ``out [T, H]`` or ``(out, new_residual)``; inputs are not modified.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    tensors = [x, weight] + ([residual] if residual is not None else [])
    _check_device(*tensors)
    if x.dtype not in _FLOATS or x.dim() < 1:
        raise TypeError(
            f"x must be a float32/float16/bfloat16 tensor [..., H], got {x.dtype} {tuple(x.shape)}"
        )
    _check_float("weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}"
        )
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    res2 = _rows(residual, hidden) if residual is not None else None
    result = triton_layers.rms_norm(x2, weight.contiguous(), eps, res2)
    if res2 is None:
        return result.view(x.shape)
    return result[0].view(x.shape), result[1].view(x.shape)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t [..., H]`` as ``[rows, H]`` with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


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
    _check_device(positions, q, k, cos_sin_cache)
    _check_int("positions", positions, 1)
    _check_float("q", q, 3)
    _check_float("k", k, 3)
    _check_float("cos_sin_cache", cos_sin_cache, 2)
    if q.shape[0] != positions.shape[0] or k.shape[0] != positions.shape[0]:
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} / positions {tuple(positions.shape)} disagree on T"
        )
    if cos_sin_cache.shape[1] != q.shape[2] or k.shape[2] != q.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the (even) head_dim "
            f"of q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    return triton_layers.rotary_embedding(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]`` → ``[..., I]``.

    Raises:
        TypeError / ValueError: non-float input or odd last dim.
    """
    _check_device(x)
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got shape {tuple(x.shape)}")
    return triton_layers.silu_and_mul(x)
