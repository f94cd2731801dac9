"""prefixgate's batched C++ CPU ops on bf16 rows and a bf16 KV cache against the torch
reference run in bf16 (kernels/torch_ref.py): load bf16, compute in fp32 registers, store bf16.

Where the reference rounds to bf16 (an op's output, the residual sum, the normalized row before
the weight, SiLU before the product) the ops round the same way, so the sums, the rotary and the
cache writes are the reference's bit for bit; the rest is within bf16's tolerance
(``torch.testing``'s defaults for bf16: ``rtol=1.6e-2, atol=1e-5``) plus, for the attention,
SDPA's own bf16 rounding. Skipped where the ops cannot be built.
"""

from __future__ import annotations

import pytest
import torch
from prefixgate.kernels import cpu_ext, torch_ref
from prefixgate.kernels.paged import PagedKV
from support.cpu_ops_reference import cos_sin as rotary_table
from support.cpu_ops_reference import decode_case, rotary_and_cache

pytestmark = pytest.mark.skipif(
    not cpu_ext.available(), reason="prefixgate CPU ops not built here (no AVX2 or no compiler)"
)

BF16 = torch.bfloat16


@pytest.mark.parametrize("rows,h", [(1, 576), (33, 576), (3, 13)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_bf16(rows, h, with_residual):
    gen = torch.Generator().manual_seed(rows + h)
    x = torch.randn(rows, h, generator=gen).to(BF16)
    r = torch.randn(rows, h, generator=gen).to(BF16)
    w = torch.randn(h, generator=gen).to(BF16)
    res = r if with_residual else None
    got, got_res = cpu_ext.add_rms_norm(x, res, w, 1e-5)
    assert got.dtype == got_res.dtype == BF16
    want = torch_ref.rms_norm(x, w, 1e-5, res)
    if isinstance(want, tuple):
        want, want_res = want
        assert torch.equal(got_res, want_res)  # the same bf16 add
    else:
        assert torch.equal(got_res, x)
    torch.testing.assert_close(got, want)
    for i in range(rows):  # a row's result does not depend on the rows beside it
        one, one_res = cpu_ext.add_rms_norm(
            x[i : i + 1], None if res is None else res[i : i + 1], w, 1e-5
        )
        assert torch.equal(got[i : i + 1], one) and torch.equal(got_res[i : i + 1], one_res)


@pytest.mark.parametrize("rows,i", [(1, 1536), (17, 1536), (4, 7)])
def test_silu_mul_bf16(rows, i):
    x = (torch.randn(rows, 2 * i, generator=torch.Generator().manual_seed(i)) * 4).to(BF16)
    x[0, :7] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0])
    got = cpu_ext.silu_mul(x)
    assert got.dtype == BF16
    torch.testing.assert_close(got, torch_ref.silu_and_mul(x))
    for r in range(rows):
        assert torch.equal(got[r : r + 1], cpu_ext.silu_mul(x[r : r + 1]))


def test_bf16_ops_refuse_mixed_dtypes():
    x = torch.randn(2, 8).to(BF16)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ext.add_rms_norm(x, None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ext.rotary_cache(
            torch.zeros(1, 24, dtype=BF16),
            torch.tensor([0]),
            torch.zeros(8, 8),
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, 4, 1, 8),
            torch.tensor([0]),
            1,
            1,
        )


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rotary_cache_bf16_is_the_reference_bit_for_bit(tokens):
    """bf16 rows and caches: the rotary in fp32 rounded once, as torch_ref.rotary_embedding's
    ``t.copy_(tf * cos2 + rot * sin2)``, and reshape_and_cache's writes (a -1 slot skipped)."""
    hq, hkv, d, block, num_blocks, max_pos = 9, 3, 64, 16, 8, 128
    gen = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(BF16)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(BF16)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    slot = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    slot[tokens // 2] = -1
    cos_sin = rotary_table(d, max_pos)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(BF16)

    q, kr, vr = rotary_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, hq, hkv)

    got = cpu_ext.rotary_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, hq, hkv)
    assert got.dtype == BF16
    assert torch.equal(got, q.reshape(tokens, hq * d))
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 20), (8, 1, 32)])
def test_decode_attention_bf16_matches_reference(hq, hkv, d):
    """B bf16 decode rows of different lengths (one not cached: slot -1) over shuffled blocks,
    K/V read as bf16 through the block tables: the cache writes bit-exact; the output within
    bf16 tolerance of SDPA run in bf16 on the gathered K/V, and closer still to fp32 SDPA on the
    same bf16 values (the op keeps scores and probabilities in fp32)."""
    lengths = [1, 9, 16, 17, 40, 95]
    qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot = decode_case(
        hq, hkv, d, lengths, hq + d, dtype=BF16
    )
    slot[2] = -1
    batch = len(lengths)
    scale = d**-0.5
    q, kr, vr = rotary_and_cache(qkv, pos, cos_sin, k_cache, v_cache, slot, hq, hkv)
    want = torch_ref.paged_attention_decode(q, PagedKV(kr, vr, table, lens), scale).reshape(
        batch, hq * d
    )
    want32 = torch_ref.paged_attention_decode(
        q.float(), PagedKV(kr.float(), vr.float(), table, lens), scale
    ).reshape(batch, hq * d)

    got = cpu_ext.decode_attention(
        qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot, hq, hkv, scale
    )
    assert got.dtype == BF16
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    # one bf16 rounding of the fp32 result: half a bf16 ulp (2^-9 relative)
    torch.testing.assert_close(got.float(), want32, rtol=2**-8, atol=1e-5)


def test_decode_attention_bf16_rows_equal_one_row_at_a_time():
    """A row's bf16 result is the same decoded alone as in a batch (caches alike after)."""
    hq, hkv, d = 9, 3, 64
    lengths = [3, 16, 33, 70]
    qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot = decode_case(
        hq, hkv, d, lengths, 7, dtype=BF16
    )
    k1, v1 = k_cache.clone(), v_cache.clone()
    got = cpu_ext.decode_attention(
        qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot, hq, hkv, d**-0.5
    )
    for b in range(len(lengths)):
        one = cpu_ext.decode_attention(
            qkv[b : b + 1],
            pos[b : b + 1],
            cos_sin,
            k1,
            v1,
            table[b : b + 1],
            lens[b : b + 1],
            slot[b : b + 1],
            hq,
            hkv,
            d**-0.5,
        )
        assert torch.equal(got[b : b + 1], one)
    assert torch.equal(k_cache, k1) and torch.equal(v_cache, v1)


_SAME_BITS = """
import sys
import torch
from prefixgate.kernels import cpu_ext

assert cpu_ext.available()
gen = torch.Generator().manual_seed(5)
x = (torch.randn(9, 2 * 200, generator=gen) * 4).to(torch.bfloat16)
w = torch.randn(400, generator=gen).to(torch.bfloat16)
hq, hkv, d, block = 9, 3, 64, 16
k_cache = torch.randn(8, block, hkv, d, generator=gen).to(torch.bfloat16)
v_cache = torch.randn(8, block, hkv, d, generator=gen).to(torch.bfloat16)
qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
lens = torch.tensor([5, 17, 30], dtype=torch.int32)
pos = (lens - 1).long()
slot = torch.tensor([4, 3 * block, 5 * block + 13])  # each row's last position
cos_sin = torch.randn(64, d, generator=gen)
out = {
    "native": cpu_ext.bf16_native(),
    "norm": cpu_ext.add_rms_norm(x, x.flip(0), w, 1e-5),
    "silu": cpu_ext.silu_mul(x),
    "attention": cpu_ext.decode_attention(
        qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot, hq, hkv, d**-0.5
    ),
    "k_cache": k_cache,
}
torch.save(out, sys.argv[1])
"""


def test_avx2_rounding_stores_the_same_bits(tmp_path):
    """CPUs without AVX512_BF16 round with AVX2 integer operations (c10's round to nearest
    even); forced here by ``PREFIXGATE_CPU_EXT_AVX512BF16=0`` in a child process, it gives the
    same bf16 bits as this process's stores on these (normal) values."""
    import os
    import subprocess
    import sys

    script = tmp_path / "same_bits.py"
    script.write_text(_SAME_BITS)
    paths = {}
    for flag in ("0", "1"):
        paths[flag] = tmp_path / f"out{flag}.pt"
        env = dict(os.environ, PREFIXGATE_CPU_EXT_AVX512BF16=flag)
        subprocess.run([sys.executable, str(script), str(paths[flag])], env=env, check=True)
    avx2, default = (torch.load(paths[f], weights_only=True) for f in ("0", "1"))
    assert avx2["native"] is False
    assert default["native"] is cpu_ext.bf16_native()
    for key in ("norm", "silu", "attention", "k_cache"):
        got, want = avx2[key], default[key]
        if isinstance(got, tuple | list):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), key
        else:
            assert torch.equal(got, want), key


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rotary_cache_refuses_a_slot_below_minus_one(dtype):
    """-1 skips a token; a slot below it is refused (it would write before the cache)."""
    cache = torch.zeros(2, 4, 1, 8, dtype=dtype)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ext.rotary_cache(
            torch.zeros(1, 24, dtype=dtype),
            torch.tensor([0]),
            torch.zeros(8, 8),
            cache,
            cache.clone(),
            torch.tensor([-2]),
            1,
            1,
        )
