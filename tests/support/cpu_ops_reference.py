"""The torch reference (kernels/torch_ref.py) of the batched C++ CPU ops' fused steps, shared by
the fp32 and bf16 op tests: rotary + KV-cache write from a fused ``qkv`` row, and a batch of
decode rows over shuffled paged blocks."""

from __future__ import annotations

import torch
from prefixgate.kernels import torch_ref


def cos_sin(d: int, max_pos: int) -> torch.Tensor:
    """``[max_pos, d]`` rotary cache (cos then sin halves, theta 10,000), fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of ``cpu_ext.rotary_cache`` on copies of the caches: ``qkv [T, (hq + 2 hkv)
    * d]`` split, q and k rotated (``torch_ref.rotary_embedding``), k and v written at ``slot``
    (``torch_ref.reshape_and_cache``, -1 skipped). Returns ``(q [T, hq, d], k_cache', v_cache')``;
    the inputs are left as they were."""
    tokens = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hkv)
    kr, vr = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.reshape(tokens, hq, d).contiguous()
    k = k.reshape(tokens, hkv, d).contiguous()
    q, k = torch_ref.rotary_embedding(positions, q, k, cos_sin_cache)
    torch_ref.reshape_and_cache(k, v.reshape(tokens, hkv, d), kr, vr, slot)
    return q, kr, vr


def decode_case(
    hq: int, hkv: int, d: int, lengths: list[int], seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Decode rows of context ``lengths`` over 40 shuffled 16-token blocks (6 a row), in
    ``dtype``: ``(qkv, positions, cos_sin, k_cache, v_cache, block_table, context_lens, slot)``,
    each row's new token at its last position."""
    gen = torch.Generator().manual_seed(seed)
    block, num_blocks, max_pos = 16, 40, 96
    batch = len(lengths)
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * 6].to(torch.int32).view(batch, 6)
    pos = torch.tensor([n - 1 for n in lengths])
    slot = torch.tensor([int(table[b, p // block]) * block + p % block for b, p in enumerate(pos)])
    lens = torch.tensor(lengths, dtype=torch.int32)
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    return qkv, pos, cos_sin(d, max_pos), k_cache, v_cache, table, lens, slot
