"""The decode-attention op's two kernels (AVX-512 and AVX2) over the combinations of block size,
head size, grouping, context lengths, row count and dtype, against the torch reference; and the
ops' threads (the library ran every op on one thread while it was built without OpenMP)."""

from __future__ import annotations

import os

import pytest
import torch
from prefixgate.kernels import cpu_ext, torch_ref
from prefixgate.kernels.paged import PagedKV
from support.cpu_ops_reference import cos_sin, rotary_and_cache

pytestmark = pytest.mark.skipif(
    not cpu_ext.available(), reason="prefixgate CPU ops not built here (no AVX2 or no compiler)"
)

BF16 = torch.bfloat16


@pytest.fixture(params=["avx512", "avx2"])
def kernel(request, monkeypatch):
    """Each kernel the op can take here (``PREFIXGATE_CPU_EXT_AVX512=0`` forces AVX2)."""
    if request.param == "avx2":
        monkeypatch.setenv("PREFIXGATE_CPU_EXT_AVX512", "0")
    else:
        monkeypatch.delenv("PREFIXGATE_CPU_EXT_AVX512", raising=False)
        if cpu_ext.attention_kernel(64) != "avx512":
            pytest.skip("this CPU has no AVX-512 (AVX512F/DQ/BW/VL)")
    return request.param


def _case(hq, hkv, d, block, lengths, dtype, seed):
    """Rows of context ``lengths`` over shuffled blocks of ``block`` tokens, each row's new
    token at its last position: ``(qkv, positions, cos_sin, k_cache, v_cache, table, lens,
    slot)``."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    per_row = (max(lengths) + block - 1) // block
    num_blocks = batch * per_row + 3
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * per_row]
    table = table.to(torch.int32).view(batch, per_row).contiguous()
    pos = torch.tensor([n - 1 for n in lengths])
    slot = torch.tensor([int(table[b, p // block]) * block + p % block for b, p in enumerate(pos)])
    lens = torch.tensor(lengths, dtype=torch.int32)
    qkv = (torch.randn(batch, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    return qkv, pos, cos_sin(d, max(lengths) + 1), k_cache, v_cache, table, lens, slot


HEADS = [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 96), (16, 2, 64), (4, 2, 20)]
LENGTHS = {
    "few": [1, 15, 16, 17, 33],  # a (row, KV head) a task; a step's tail, one token
    "many": [(7 * i) % 70 + 1 for i in range(19)],  # whole rows a task (rows >= 4 x threads)
}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's threads for the call, pinned: whole rows a task needs rows >= 4 x threads, which
    19 rows are not at 5 threads or more (a reviewer's mutant of the KV-head index survived
    there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("rows", sorted(LENGTHS))
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_decode_attention_kernels_match_reference(kernel, threads, hq, hkv, d, block, rows, dtype):
    lengths = LENGTHS[rows]
    qkv, pos, cs, k_cache, v_cache, table, lens, slot = _case(
        hq, hkv, d, block, lengths, dtype, seed=hq * 1000 + d * 10 + block
    )
    slot[1] = -1  # a row whose token is not cached
    scale = d**-0.5
    q, kr, vr = rotary_and_cache(qkv, pos, cs, k_cache, v_cache, slot, hq, hkv)
    exact = torch_ref.paged_attention_decode(  # in float64 on the same (fp32 or bf16) values
        q.double(), PagedKV(kr.double(), vr.double(), table, lens), scale
    ).reshape(len(lengths), hq * d)

    got = cpu_ext.decode_attention(
        qkv, pos, cs, k_cache, v_cache, table, lens, slot, hq, hkv, scale
    )
    assert got.dtype == dtype
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)  # rotary + write: bit-exact
    if dtype == BF16:  # one bf16 rounding of the fp32 result: half a bf16 ulp
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
    else:  # closer to the exact value than torch's fp32 SDPA (5.8e-6 at worst on these cases)
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=4e-6)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, dtype):
    """Alone (a KV head a task) or among 19 rows (whole rows a task): the same bits."""
    lengths = LENGTHS["many"]
    hq, hkv, d = 9, 3, 64
    qkv, pos, cs, k_cache, v_cache, table, lens, slot = _case(hq, hkv, d, 16, lengths, dtype, 5)
    k1, v1 = k_cache.clone(), v_cache.clone()
    got = cpu_ext.decode_attention(
        qkv, pos, cs, k_cache, v_cache, table, lens, slot, hq, hkv, d**-0.5
    )
    for b in (0, 7, 18):
        one = cpu_ext.decode_attention(
            qkv[b : b + 1], pos[b : b + 1], cs, k1, v1, table[b : b + 1], lens[b : b + 1],
            slot[b : b + 1], hq, hkv, d**-0.5,
        )  # fmt: skip
        assert torch.equal(got[b : b + 1], one)


def test_the_kernel_is_chosen_by_cpu_head_size_and_environment(monkeypatch):
    monkeypatch.setenv("PREFIXGATE_CPU_EXT_AVX512", "0")
    assert cpu_ext.attention_kernel(64) == "avx2"
    monkeypatch.delenv("PREFIXGATE_CPU_EXT_AVX512")
    assert cpu_ext.attention_kernel(20) == "avx2"  # not 16 lanes a step: AVX2's tails
    assert cpu_ext.attention_kernel(64) in ("avx512", "avx2")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: nothing to run in parallel")
def test_the_ops_run_on_torchs_threads():
    """Built without OpenMP, ``at::parallel_for`` ran every op on the calling thread whatever
    ``torch.get_num_threads()`` said (decode attention of 32 rows took as long at 2 threads as
    at 1)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_ext.op_threads() == 2
        torch.set_num_threads(1)
        assert cpu_ext.op_threads() == 1
    finally:
        torch.set_num_threads(before)


def _at_position_zero(hq, hkv, d, lengths, seed):
    """A case whose new tokens sit at position 0 and are not cached (slot -1): the rotary is
    the identity there, so q is what ``qkv`` holds and the scores are ``q . K`` of the cache
    as written."""
    qkv, pos, cs, k_cache, v_cache, table, lens, slot = _case(
        hq, hkv, d, 16, lengths, torch.float32, seed
    )
    pos.zero_()
    slot.fill_(-1)
    return qkv, pos, cs, k_cache, v_cache, table, lens, slot


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_score_far_below_zero(kernel, threads, dtype):
    """Scores of -50 and less: the padding lanes past a context's end (zeros) must not count
    in the max, or every exp underflows (a reviewer's mutant of the max's mask survived the
    random cases, whose scores straddle zero)."""
    hq, hkv, d = 9, 3, 64
    lengths = [1, 7, 17, 33, 40]
    qkv, pos, cs, k_cache, v_cache, table, lens, slot = _at_position_zero(hq, hkv, d, lengths, 3)
    qkv[:, : hq * d] = qkv[:, : hq * d].abs() * 4
    k_cache.copy_(-(k_cache.abs() + 0.5))
    qkv, k_cache, v_cache = qkv.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    q, kr, vr = rotary_and_cache(qkv, pos, cs, k_cache, v_cache, slot, hq, hkv)
    exact = torch_ref.paged_attention_decode(
        q.double(), PagedKV(kr.double(), vr.double(), table, lens), d**-0.5
    ).reshape(len(lengths), hq * d)
    # q >= 0 and every K value <= -0.5: each scaled score <= -0.5 * sum(q) / sqrt(d)
    assert float(q.double().sum(-1).min()) * 0.5 * d**-0.5 > 20
    got = cpu_ext.decode_attention(
        qkv, pos, cs, k_cache, v_cache, table, lens, slot, hq, hkv, d**-0.5
    )
    # scores of -20 to -100: fp32's rounding of a score moves its weight ~1e-5 (the mutant of
    # the mask was off by 1.35)
    tol = (2**-8, 5e-5) if dtype == BF16 else (0, 5e-5)
    torch.testing.assert_close(got.double(), exact, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_score_makes_its_row_nan_as_sdpa(kernel, threads, bad):
    """A NaN (or +inf) in one cached K row: that KV head's query heads are NaN in the reference
    (a NaN score, or +inf - +inf in the softmax); the op's exp had clamped NaN to -87.3, giving
    a plausible row instead."""
    hq, hkv, d = 9, 3, 64
    lengths = [5, 20, 33]
    qkv, pos, cs, k_cache, v_cache, table, lens, slot = _at_position_zero(hq, hkv, d, lengths, 4)
    k_cache[table[1, 0], 3, 1, 7] = bad  # row 1's token 3, KV head 1
    for h in (3, 4, 5):  # KV head 1's query heads: q[7] > 0, so an inf K value is a +inf score
        qkv[1, h * d + 7] = qkv[1, h * d + 7].abs() + 1
    q, kr, vr = rotary_and_cache(qkv, pos, cs, k_cache, v_cache, slot, hq, hkv)
    want = torch_ref.paged_attention_decode(q, PagedKV(kr, vr, table, lens), d**-0.5)
    got = cpu_ext.decode_attention(
        qkv, pos, cs, k_cache, v_cache, table, lens, slot, hq, hkv, d**-0.5
    ).reshape(len(lengths), hq, d)
    assert torch.equal(got.isnan(), want.isnan())
    assert got[1, 3:6].isnan().all() and not got[0].isnan().any()


def test_a_compiler_without_openmp_still_gets_the_ops(monkeypatch, caplog):
    """The build with ``-fopenmp`` fails (a compiler without OpenMP): built again without it,
    the ops stay (on one thread, said in the log), not lost to the torch paths."""
    calls = []

    def build(cflags, ldflags):
        calls.append((list(cflags), list(ldflags)))
        if "-fopenmp" in cflags or "-fopenmp" in ldflags:
            raise RuntimeError("unsupported option '-fopenmp'")

    monkeypatch.setattr(cpu_ext, "_build", build)
    with caplog.at_level("INFO", logger=cpu_ext.logger.name):
        assert cpu_ext._build_ops() is True
    assert [("-fopenmp" in cf, lf) for cf, lf in calls] == [(True, ["-fopenmp"]), (False, [])]
    assert "without OpenMP: each op on one thread" in caplog.text

    calls.clear()
    monkeypatch.setattr(cpu_ext, "_build", lambda cf, lf: calls.append(cf) or 1 / 0)
    assert cpu_ext._build_ops() is False  # no compiler at all: the torch paths, said
    assert len(calls) == 2 and "torch paths only" in caplog.text
