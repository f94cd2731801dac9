"""The flat batch's attention metadata, built by the model runner and read by attention layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a flat batch reads and writes the paged KV cache.

    The batch holds B sequences; the first ``num_decode_seqs`` are decodes (one query token
    each), the rest are prefill chunks (one or more query tokens). T = total query tokens.

    Attributes:
        slot_mapping: ``[T]`` int64 cache slot of each new token (block_id * block_size + offset).
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths, starting at 0.
        context_lens: ``[B]`` int32 tokens per sequence after this step (cached + new).
        block_tables: ``[B, max_blocks]`` int32 block ids per sequence, padded with 0.
        num_decode_seqs: leading sequences that are decodes (== their token count).
        max_query_len: longest query chunk in tokens.
        max_context_len: longest context in tokens.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decode_seqs: int
    max_query_len: int
    max_context_len: int

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
