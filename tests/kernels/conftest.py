"""Kernel tests: Triton's interpreter on CPU, and a paged-KV batch builder shared by the tests.

``TRITON_INTERPRET=1`` is set here, before any test module imports triton, when CUDA is absent
(Triton reads it when ``@triton.jit`` decorates a kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from prefixgate.kernels.paged import PagedKV

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Max abs error allowed against the fp32 torch reference / dense SDPA, per input dtype.
# fp32: summation order only. fp16/bf16: inputs rounded once, P rounded before P·V (as in
# FlashAttention), output rounded to the dtype (bf16 keeps 8 mantissa bits: 2^-8 ~ 4e-3 rel).
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` without CUDA. bf16 tests carry it: the interpreter mis-computes
    bf16 ``tl.dot`` (triton issue #11584)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: the Triton interpreter mis-computes bf16 (tl.dot, triton#11584; casts round differently)"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Same shape, all finite, max abs difference <= ``tol`` (compared in fp32)."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.1g}"


@pytest.fixture
def close():
    """:func:`assert_close` as a fixture: ``close(out, ref, tol)``."""
    return assert_close


@pytest.fixture
def atol() -> dict[torch.dtype, float]:
    """Max abs error per input dtype against the fp32 references (see ``ATOL``)."""
    return ATOL


@dataclass(slots=True)
class PagedBatch:
    """A varlen batch over a paged KV cache plus the same K/V unpaged, for dense references.

    Attributes:
        q: ``[T, Hq, D]`` queries (each sequence's last ``q_len`` tokens).
        k_cache, v_cache: ``[N, S, Hkv, D]``, unused slots filled with large garbage.
        block_tables: ``[B, W]`` int32 (blocks shuffled; padding points at block 0).
        query_start_loc: ``[B + 1]`` int32; context_lens: ``[B]`` int32.
        keys, values: per sequence ``[L_b, Hkv, D]`` dense K/V.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    q_lens: list[int]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    @property
    def kv(self) -> PagedKV:
        """The caches, block tables and context lengths as the attention kernels take them."""
        return PagedKV(self.k_cache, self.v_cache, self.block_tables, self.context_lens)

    def decode_args(self) -> tuple[torch.Tensor, PagedKV, float]:
        """``paged_attention_decode``'s arguments: ``(q, kv, scale)``."""
        return (self.q, self.kv, self.scale)

    def prefill_args(self) -> tuple[torch.Tensor, PagedKV, torch.Tensor, float]:
        """``paged_attention_prefill``'s arguments: ``(q, kv, query_start_loc, scale)``."""
        return (self.q, self.kv, self.query_start_loc, self.scale)


def make_paged_batch(
    context_lens: list[int],
    q_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    groups: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_table_width: int = 2,
) -> PagedBatch:
    """Random K/V for sequences of ``context_lens`` tokens scattered into shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 300.0)  # garbage a correct kernel never reads
    v_cache = torch.full(shape, -300.0)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq, default=0) + extra_table_width
    tables = torch.zeros((len(context_lens), width), dtype=torch.int32)
    keys, values = [], []
    for b, (n, nb) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for i in range(n):
            k_cache[ids[i // block_size], i % block_size] = k[i]
            v_cache[ids[i // block_size], i % block_size] = v[i]
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    q = torch.randn(sum(q_lens), num_kv_heads * groups, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q=q.to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        v_cache=v_cache.to(dtype).to(DEVICE),
        block_tables=tables.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        keys=[k.to(DEVICE) for k in keys],
        values=[v.to(DEVICE) for v in values],
        q_lens=list(q_lens),
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Naive reference: torch SDPA in fp32 on the unpaged K/V, causal with the cached prefix."""
    outs = []
    starts = batch.query_start_loc.tolist()
    for b, q_len in enumerate(batch.q_lens):
        if q_len == 0:
            continue
        q = batch.q[starts[b] : starts[b] + q_len].float().transpose(0, 1)  # [Hq, Lq, D]
        k = batch.keys[b].float().transpose(0, 1)
        v = batch.values[b].float().transpose(0, 1)
        groups = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        n = k.shape[1]
        q_pos = torch.arange(n - q_len, n, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=batch.scale
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs) if outs else batch.q.float()[:0]


@pytest.fixture
def paged_batch():
    """Factory fixture: ``paged_batch(context_lens, q_lens, block_size, Hkv, groups, D, dtype)``."""
    return make_paged_batch


@pytest.fixture
def dense():
    """The naive dense attention reference as a fixture."""
    return dense_attention
