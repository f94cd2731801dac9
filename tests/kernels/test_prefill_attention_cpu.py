"""``cpu_ext.prefill_attention`` (AVX-512 causal prefill attention read through the block tables)
against ``torch_ref.paged_attention_prefill``: fresh prompts, chunks after a cached prefix,
mixed lengths in one batch, shuffled block tables of several block sizes, GQA groups 1 to 12,
head sizes 32 / 64 / 128, fp32 and bf16, one and two threads; what it refuses (and the engine's
fallback to the torch path there); a hypothesis property over shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefixgate.engine.models.layers import Attention
from prefixgate.kernels import cpu_ext, get_backend, torch_ref
from prefixgate.kernels.paged import PagedKV

pytestmark = [
    pytest.mark.skipif(
        not cpu_ext.available(), reason="prefixgate CPU ops not built here (no AVX2 or no compiler)"
    ),
    pytest.mark.skipif(
        cpu_ext.available() and not cpu_ext.prefill_attention_supported(64, 3),
        reason="this CPU has no AVX-512 (AVX512F/DQ/BW/VL)",
    ),
]

BF16 = torch.bfloat16


def _case(
    hq: int,
    hkv: int,
    d: int,
    block: int,
    q_lens: list[int],
    ctx: list[int],
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, PagedKV, torch.Tensor]:
    """``(q [T, Hq, D], PagedKV, query_start_loc)``: each sequence's blocks drawn at random
    from a shuffled pool (tables out of order, a few blocks unused)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    per_seq = (max(ctx) + block - 1) // block
    num_blocks = batch * per_seq + 3
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * per_seq]
    table = table.to(torch.int32).view(batch, per_seq).contiguous()
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, PagedKV(k_cache, v_cache, table, torch.tensor(ctx, dtype=torch.int32)), qsl


def _exact(q: torch.Tensor, kv: PagedKV, qsl: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch reference in float64 on the same (fp32 or bf16) values."""
    kv64 = PagedKV(kv.k_cache.double(), kv.v_cache.double(), kv.block_tables, kv.context_lens)
    return torch_ref.paged_attention_prefill(q.double(), kv64, qsl, scale)


def _check(q: torch.Tensor, kv: PagedKV, qsl: torch.Tensor) -> torch.Tensor:
    """The kernel's result, held to the torch reference and to its float64 value."""
    scale = q.shape[2] ** -0.5
    got = cpu_ext.prefill_attention(q, kv, qsl, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    ref = torch_ref.paged_attention_prefill(q, kv, qsl, scale)
    exact = _exact(q, kv, qsl, scale)
    if q.dtype == BF16:  # one bf16 rounding of the fp32 result: half a bf16 ulp
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-8)  # both rounded
    else:  # fp32: summation order only
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=5e-6)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    return got


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's threads for the call, pinned (tasks are taken from a shared counter)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


HEADS = [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 4, 64), (4, 1, 32), (12, 1, 64)]
BATCHES = {  # name: (query lengths, context lengths)
    "fresh": ([100], [100]),  # one whole prompt (the reference's is_causal path)
    "fresh-equal": ([37, 37, 37], [37, 37, 37]),
    "prefixed": ([50], [130]),  # a chunk after a cached prefix / earlier chunks
    "mixed": ([1, 17, 64, 5, 33], [1, 40, 64, 90, 33]),  # fresh and prefixed, one token
}


@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_prefill_attention_matches_the_torch_reference(threads, hq, hkv, d, block, batch, dtype):
    q_lens, ctx = BATCHES[batch]
    _check(*_case(hq, hkv, d, block, q_lens, ctx, dtype, seed=hq * 1000 + d * 10 + block))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_long_prompt_across_many_tiles_and_tasks(threads, dtype):
    """1,088 tokens (the benchmark's prompt): 34 key tiles, tasks of 16 positions."""
    _check(*_case(9, 3, 64, 16, [300, 1088], [700, 1088], dtype, seed=7))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_sequences_result_does_not_depend_on_the_batch_or_the_threads(dtype):
    """Tasks are independent: a sequence alone or beside others, on 1 or 2 threads, the same
    bits."""
    q, kv, qsl = _case(9, 3, 64, 16, [40, 70, 9], [60, 70, 100], dtype, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = cpu_ext.prefill_attention(q, kv, qsl, 0.125)
        torch.set_num_threads(1)
        alone = cpu_ext.prefill_attention(
            q[40:110],
            PagedKV(kv.k_cache, kv.v_cache, kv.block_tables[1:2], kv.context_lens[1:2]),
            torch.tensor([0, 70], dtype=torch.int32),
            0.125,
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together[40:110], alone)


def test_large_scores_keep_the_softmax_finite():
    """Scores in the hundreds (the running max rescales; no overflow, no NaN)."""
    q, kv, qsl = _case(9, 3, 64, 16, [70], [150], torch.float32, seed=5)
    q = q * 40
    got = cpu_ext.prefill_attention(q, kv, qsl, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _exact(q, kv, qsl, 0.125), rtol=0, atol=5e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_key_makes_the_rows_that_see_it_nan_as_sdpa(bad):
    """A bad value in the key at position 40 (KV head 1): the rows at 40 and after of heads
    3-5 are NaN where the reference's are (all of them for NaN; those whose score is +inf
    for inf); the rows before it never see it and match."""
    q, kv, qsl = _case(9, 3, 64, 16, [70], [70], torch.float32, seed=9)
    block = int(kv.block_tables[0, 40 // 16])
    kv.k_cache[block, 40 % 16, 1, 5] = bad
    got = cpu_ext.prefill_attention(q, kv, qsl, 0.125)
    ref = torch_ref.paged_attention_prefill(q, kv, qsl, 0.125)
    assert torch.equal(got.isnan(), ref.isnan())
    assert got[40:, 3:6].isnan().any() and not got[:40].isnan().any()
    assert got[40:, 3:6].isnan().all() or bad == float("inf")
    torch.testing.assert_close(got[:40], ref[:40], rtol=0, atol=1e-5)


@given(
    group=st.sampled_from([1, 2, 3, 4, 5, 8]),
    hkv=st.integers(1, 3),
    d=st.sampled_from([16, 32, 64, 128]),
    block=st.sampled_from([1, 4, 16, 48]),
    seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 60)), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, BF16]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_prefill_attention_property(group, hkv, d, block, seqs, dtype, seed):
    """Any chunk lengths and cached prefixes, block sizes, groups, head sizes the kernel takes."""
    q_lens = [n for n, _ in seqs]
    ctx = [n + prefix for n, prefix in seqs]
    _check(*_case(group * hkv, hkv, d, block, q_lens, ctx, dtype, seed))


def test_the_shapes_it_refuses(monkeypatch):
    assert cpu_ext.prefill_attention_supported(64, 3)
    assert cpu_ext.prefill_attention_supported(128, 48)
    assert not cpu_ext.prefill_attention_supported(20, 3)  # not a multiple of 16
    assert not cpu_ext.prefill_attention_supported(512, 1)  # past 256
    assert not cpu_ext.prefill_attention_supported(64, 64)  # a group past 48 rows
    monkeypatch.setenv("PREFIXGATE_CPU_EXT_AVX512", "0")
    assert not cpu_ext.prefill_attention_supported(64, 3)
    q, kv, qsl = _case(9, 3, 64, 16, [4], [4], torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="AVX-512"):
        cpu_ext.prefill_attention(q, kv, qsl, 0.125)


def test_bad_input_is_a_clear_error():
    q, kv, qsl = _case(9, 3, 64, 16, [10], [20], torch.float32, seed=0)
    short = PagedKV(kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="longer than its context"):
        cpu_ext.prefill_attention(q, short, qsl, 0.125)
    past = PagedKV(kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([900], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="past the block table"):
        cpu_ext.prefill_attention(q, past, qsl, 0.125)
    outside = PagedKV(kv.k_cache, kv.v_cache, kv.block_tables + 1000, kv.context_lens)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ext.prefill_attention(q, outside, qsl, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ext.prefill_attention(q.to(BF16), kv, qsl, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ext.prefill_attention(q, kv, qsl.long(), 0.125)
    with pytest.raises(RuntimeError, match="from 0 to the token count"):
        cpu_ext.prefill_attention(q, kv, torch.tensor([0, 9], dtype=torch.int32), 0.125)


def _attention(hq: int, hkv: int, d: int) -> Attention:
    cfg = SimpleNamespace(
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        q_size=hq * d,
        kv_size=hkv * d,
        hidden_size=32,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        rms_norm_eps=1e-6,
    )
    attn = Attention(cfg, get_backend("torch"))  # type: ignore[arg-type]
    attn.decode_ops = True
    return attn


@pytest.mark.parametrize(
    "hq,hkv,d,dtype,fused",
    [
        (9, 3, 64, torch.float32, True),
        (8, 2, 128, BF16, True),
        (4, 2, 20, torch.float32, False),  # a head size the kernel refuses: the torch path
        (64, 1, 32, torch.float32, False),  # a group past 48 rows
        (9, 3, 64, torch.float16, False),  # a dtype the CPU ops do not take
    ],
)
def test_the_engine_takes_the_kernel_where_it_applies(monkeypatch, hq, hkv, d, dtype, fused):
    """``Attention._prefill`` with ``decode_ops``: the C++ kernel where it takes the shape and
    dtype, the torch reference otherwise; the same values either way."""
    q, kv, qsl = _case(hq, hkv, d, 16, [30, 12], [30, 50], dtype, seed=1)
    attn = _attention(hq, hkv, d)
    views = SimpleNamespace(
        prefill_block_tables=kv.block_tables,
        prefill_context_lens=kv.context_lens,
        prefill_query_start_loc=qsl,
    )
    calls: list[int] = []
    real = cpu_ext.prefill_attention

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cpu_ext, "prefill_attention", counting)
    got = attn._prefill(q, kv.k_cache, kv.v_cache, views)  # type: ignore[arg-type]
    assert bool(calls) == fused
    ref = torch_ref.paged_attention_prefill(q, kv, qsl, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    attn.decode_ops = False
    calls.clear()
    assert torch.equal(attn._prefill(q, kv.k_cache, kv.v_cache, views), ref)  # type: ignore[arg-type]
    assert not calls
