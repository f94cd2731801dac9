"""The paged K/V that every paged attention entry point reads (both backends take it).

vLLM's attention backends likewise take the cache and the batch's block tables and lengths as
one metadata object rather than as loose tensors in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's paged K/V cache and the block tables and lengths through which a batch of B
    sequences reads it: all of a paged attention call's inputs but the queries and the scale.

    Attributes:
        k_cache, v_cache: ``[N, S, Hkv, D]`` (N blocks of S slots); this step's K/V already
            written.
        block_tables: ``[B, max_blocks]`` int32 block ids of each sequence (padding entries
            unused).
        context_lens: ``[B]`` int32 tokens in each sequence's context, this step's included
            (>= 1).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
