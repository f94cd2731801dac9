"""The flat batch's attention metadata, built by the model runner and read by attention layers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class VerifyLayout:
    """The verify rows of a flat batch (speculative decoding: a decode plus its ``k`` drafts,
    ``1 + k`` query tokens) laid out once per step for a decode-like attention call (one
    ``scaled_dot_product_attention`` over the sequences' gathered KV with a causal mask over
    their last ``q_len`` positions) instead of the general prefill path.

    Rows are padded to ``Q`` (the longest verify query) per sequence; ``Bv`` sequences,
    ``Tv`` real query tokens. Built by :func:`verify_layout` from host arrays (no device sync).

    Attributes:
        num_seqs: ``Bv``.
        num_tokens: ``Tv``.
        query_start_loc: ``[Bv + 1]`` int32 cumulative query lengths of the verify rows, from 0
            (what the prefill kernels take).
        mask: ``[Bv, 1, Q, L]`` float32 additive mask (0 or ``-inf``; bool, True = visible,
            past ``FLOAT_MASK_MAX`` entries), ``L`` = the longest verify context: padded query
            row ``i`` of sequence ``b`` sees key ``j`` iff ``j <= ctx_b - q_b + min(i, q_b - 1)``
            (padding rows repeat the last real row: never fully masked).
        query_index: ``[Bv * Q]`` int64 verify-token index of each padded row, or ``None``
            when every query is ``Q`` tokens long (no padding).
        output_index: ``[Tv]`` int64 padded row of each real token, or ``None`` (no padding).
    """

    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    output_index: torch.Tensor | None


FLOAT_MASK_MAX = 1 << 16
"""Mask entries (``Bv * Q * L``) up to which the verify mask is additive float32 (larger: bool)."""


def verify_layout_arrays(
    q_lens: np.ndarray, context_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The host arrays of a :class:`VerifyLayout`.

    Args:
        q_lens: ``[Bv]`` int query tokens per verify sequence (>= 1).
        context_lens: ``[Bv]`` int tokens per sequence after this step (>= its ``q_len``).

    Returns:
        ``(query_start_loc [Bv + 1] int32, mask [Bv, 1, Q, L] float32 or bool, query_index [Bv * Q]
        int64 or None, output_index [Tv] int64 or None)``.

    Raises:
        ValueError: empty, mismatched, or a query longer than its context / shorter than 1.
    """
    q_lens = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    if q_lens.ndim != 1 or q_lens.shape != ctx.shape or q_lens.size == 0:
        raise ValueError(f"need [Bv] q_lens and context_lens, got {q_lens.shape}, {ctx.shape}")
    q_min, q_max, length = int(q_lens.min()), int(q_lens.max()), int(ctx.max())
    start = ctx - q_lens  # position of each sequence's first query token
    if q_min < 1 or int(start.min()) < 0:
        raise ValueError("every verify query needs 1 <= q_len <= context_len")
    qsl = np.zeros(q_lens.size + 1, dtype=np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    uniform = q_min == q_max
    row = np.arange(q_max)[None, :]  # [1 or Bv, Q]: padding rows repeat the last real one
    if not uniform:
        row = np.minimum(row, (q_lens - 1)[:, None])
    last_key = start[:, None] + row
    visible = np.arange(length)[None, None, :] <= last_key[:, :, None]
    if visible.size <= FLOAT_MASK_MAX:  # additive: SDPA would make this in every layer
        mask = np.where(visible, np.float32(0), np.float32(-np.inf))[:, None]
    else:  # long contexts: a quarter of the bytes, converted by SDPA per layer
        mask = visible[:, None]
    if uniform:
        return qsl, mask, None, None
    query_index = (qsl[:-1, None].astype(np.int64) + row).reshape(-1)
    padded = np.arange(q_lens.size * q_max, dtype=np.int64).reshape(-1, q_max)
    output_index = padded[np.arange(q_max)[None, :] < q_lens[:, None]]
    return qsl, mask, query_index, output_index


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a flat batch reads and writes the paged KV cache.

    The batch holds B sequences: first ``num_decode_seqs`` decodes (one query token each), then
    the ``verify.num_seqs`` verify rows when ``verify`` is set (a decode and its draft tokens),
    then prefill chunks (one or more query tokens). T = total query tokens.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token (block_id * block_size + offset).
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths, starting at 0.
        context_lens: ``[B]`` int32 tokens per sequence after this step (cached + new).
        block_tables: ``[B, max_blocks]`` int32 block ids per sequence, padded with 0.
        num_decode_seqs: leading sequences that are decodes (== their token count).
        max_query_len: longest query chunk in tokens.
        max_context_len: longest context in tokens.
        verify: the verify rows' layout (speculative decoding), or ``None`` (none this step).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decode_seqs: int
    max_query_len: int
    max_context_len: int
    verify: VerifyLayout | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def num_verify_seqs(self) -> int:
        return 0 if self.verify is None else self.verify.num_seqs

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
