"""prefixgate's C++ CPU ops (kernels/cpu_ext.py) against the torch reference.

Skipped, with the reason, where the ops cannot be built (no x86-64 AVX2, no compiler, or
``PREFIXGATE_CPU_EXT=0``). The first test to run builds them: 20-22 s once on the dev machine's
2 cores (g++ 12), then torch's extensions cache serves every later process.
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


@pytest.mark.parametrize(
    "n,k",
    [(160, 96), (7, 5), (9, 13), (17, 1), (24, 33), (960, 576), (576, 1536), (1000, 577)],
)  # N not a multiple of 8 / of the two-panel step; K not a multiple of 4 or 8
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_matches_linear(n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(1, k, generator=gen)
    got = cpu_ext.gemv(x, cpu_ext.pack_panels(w), b, n)
    want = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
    assert got.shape == (1, n) and got.dtype == torch.float32
    # fp32 accumulation in another order: ~1e-6 * sqrt(K) on unit-normal inputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * k**0.5)


@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_same_result_at_any_thread_count(threads):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3000, 200, generator=gen), torch.randn(1, 200, generator=gen)
    packed = cpu_ext.pack_panels(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ext.gemv(x, packed, None, 3000)
        torch.set_num_threads(threads)
        assert torch.equal(cpu_ext.gemv(x, packed, None, 3000), one)  # rows never split
    finally:
        torch.set_num_threads(before)


def test_gemv_refuses_bad_shapes():
    packed = cpu_ext.pack_panels(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="K is 8"):
        cpu_ext.gemv(torch.randn(1, 9), packed, None, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_ext.gemv(torch.randn(1, 8), packed, None, 17)
    with pytest.raises(RuntimeError, match="panels"):  # 12 wide: not a multiple of 8
        cpu_ext.gemv(torch.randn(1, 8), torch.zeros(2, 8, 12), None, 16)
    with pytest.raises(RuntimeError, match="panels"):  # a panel not contiguous
        cpu_ext.gemv(torch.randn(1, 8), torch.zeros(2, 16, 8)[:, ::2], None, 16)


@pytest.mark.parametrize("width", [8, 16, 24, 32, 40, 48, 56, 64])
@pytest.mark.parametrize("n,k,k_pad", [(100, 37, 48), (64, 576, 576), (7, 5, 16), (130, 1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_wide_panels_with_padded_columns(width, n, k, k_pad, bias):
    """Panels [P, K, W] with a panel stride of k_pad * W (oneDNN's packed weight as a view)."""
    gen = torch.Generator().manual_seed(width * 7 + n + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(1, k, generator=gen)
    panels = -(-n // width)
    buf = torch.full((panels, k_pad, width), float("nan"))  # padding is never read
    padded = torch.full((panels * width, k), float("nan"))  # nor rows past N
    padded[:n] = w
    buf[:, :k, :] = padded.view(panels, width, k).transpose(1, 2)
    view = buf[:, :k, :]
    got = cpu_ext.gemv(x, view, b, n)
    want = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
    assert got.shape == (1, n) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * k**0.5)
    if width == 8 and k_pad == k:  # pack_panels' layout: the same bits as before
        assert torch.equal(got, cpu_ext.gemv(x, cpu_ext.pack_panels(w), b, n))


def test_pack_panels_layout():
    w = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    p = cpu_ext.pack_panels(w)
    assert p.shape == (2, 3, 8) and p.is_contiguous()
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 1], w[9])
    assert not p[1, :, 2:].any()  # rows past N are zeros


@pytest.mark.parametrize("h", [576, 64, 13])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(h, with_residual):
    gen = torch.Generator().manual_seed(h)
    x, r = torch.randn(1, h, generator=gen), torch.randn(1, h, generator=gen)
    w = torch.randn(h, generator=gen)
    got, got_res = cpu_ext.add_rms_norm(x, r if with_residual else None, w, 1e-5)
    if with_residual:
        want, want_res = torch_ref.rms_norm(x, w, 1e-5, r)
        assert torch.equal(got_res, want_res)  # the same fp32 add
    else:
        want = torch_ref.rms_norm(x, w, 1e-5)
        assert torch.equal(got_res, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("i", [1536, 7])
def test_silu_mul(i):
    x = torch.randn(1, 2 * i, generator=torch.Generator().manual_seed(i)) * 4
    torch.testing.assert_close(cpu_ext.silu_mul(x), torch_ref.silu_and_mul(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("length", [1, 16, 37])
@pytest.mark.parametrize("d", [64, 20])  # 20: not a multiple of 8 (the scalar tails)
def test_decode_attention_matches_reference(hq, hkv, length, d):
    gen = torch.Generator().manual_seed(hq * 100 + length + d)
    block, num_blocks, max_pos = 16, 8, 64
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:4].to(torch.int32).unsqueeze(0)
    pos = length - 1
    slot = torch.tensor([int(table[0, pos // block]) * block + pos % block])
    positions = torch.tensor([pos])
    lens = torch.tensor([length], dtype=torch.int32)
    cos_sin = rotary_table(d, max_pos)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=gen)
    scale = d**-0.5

    q, kr, vr = rotary_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, hq, hkv)
    want = torch_ref.paged_attention_decode(q, PagedKV(kr, vr, table, lens), scale).reshape(
        1, hq * d
    )

    got = cpu_ext.decode_attention(
        qkv, positions, cos_sin, k_cache, v_cache, table, lens, slot, hq, hkv, scale
    )
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)  # rotary + write: bit-exact
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_refuses_out_of_range():
    k_cache = torch.zeros(2, 4, 1, 8)
    args = (torch.zeros(1, 24), torch.tensor([3]), torch.zeros(8, 8), k_cache, k_cache.clone())
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="context length past the block table"):
        cpu_ext.decode_attention(
            *args, table, torch.tensor([5], dtype=torch.int32), torch.tensor([0]), 1, 1, 1.0
        )
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_ext.decode_attention(
            torch.zeros(1, 24),
            torch.tensor([8]),
            *args[2:],
            table,
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([0]),
            1,
            1,
            1.0,
        )


@pytest.mark.parametrize("n,k", [(160, 96), (7, 5), (9, 13), (1000, 577), (576, 1536)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_int8_matches_dequantized(n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(1, k, generator=gen)
    packed, scales = cpu_ext.pack_panels_int8(q, scale)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 8), k, 8)
    got = cpu_ext.gemv_int8(x, packed, scales, b, n)
    w = q.double() * scale.double()[:, None]
    want = (x.double() @ w.t() + (0 if b is None else b.double())).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k**0.5)


@pytest.mark.parametrize("n,k", [(7, 5), (9, 13), (100, 97), (576, 1536), (16, 600)])
def test_gemv_int8_w16_within_activation_rounding(n, k):
    """Error bound: 0.5 * amax|x| / 32767 * sum_k |q * scale| per output, + fp32 rounding."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100
    b = torch.randn(n, generator=gen)
    x = torch.randn(1, k, generator=gen) * 3
    packed, scales = cpu_ext.pack_pairs_int8(q, scale)
    assert packed.shape == (-(-n // 8), -(-k // 2), 8, 2)
    got = cpu_ext.gemv_int8(x, packed, scales, b, n, activations="int16")
    w = q.double() * scale.double()[:, None]
    want = x.double() @ w.t() + b.double()
    bound = 0.5 * x.abs().max().double() / 32767 * w.abs().sum(1) + 1e-5 * want.abs() + 1e-6
    assert ((got.double() - want).abs() <= bound).all()


def _gemv8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over 32-column blocks b of 0.5 * amax|x_b| / 127 * sum_{k in b} |w[:, k]|."""
    k = x.shape[1]
    bound = torch.zeros(w.shape[0], dtype=torch.float64)
    for k0 in range(0, k, 32):
        amax = x[0, k0 : k0 + 32].abs().max().double()
        bound += 0.5 * amax / 127 * w[:, k0 : k0 + 32].abs().sum(1)
    return bound


@pytest.mark.parametrize("n,k", [(7, 5), (9, 13), (100, 97), (576, 1536), (16, 600), (24, 64)])
def test_gemv_int8_x8_within_block_rounding(n, k):
    """Per-32-column int8 activations: error within each block's rounding, + fp32 rounding;
    the AVX2 and AVX-VNNI paths give the same int32 sums, so the same floats."""
    gen = torch.Generator().manual_seed(n * 11 + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 100
    b = torch.randn(n, generator=gen)
    x = torch.randn(1, k, generator=gen) * 3
    x[0, : min(k, 32)] *= 50  # one block's outliers must not coarsen the others
    packed, scales = cpu_ext.pack_quads_int8(q, scale)
    assert packed.shape == (-(-n // 8), -(-k // 32) * 8, 8, 4)
    got = cpu_ext.gemv_int8(x, packed, scales, b, n, activations="int8")
    w = q.double() * scale.double()[:, None]
    want = x.double() @ w.t() + b.double()
    bound = _gemv8_bound(x, w) + 1e-5 * want.abs() + 1e-5
    assert ((got.double() - want).abs() <= bound).all()
    avx2 = cpu_ext.gemv_int8(x, packed, scales, b, n, activations="int8", vnni=False)
    assert torch.equal(got, avx2)


def test_gemv_int8_x8_exact_on_int8_grid_and_extremes():
    """Activations already on the int8 grid of their block are exact; 127 x 127 over a long
    row neither saturates the pair sums nor overflows a block's int32 sum."""
    k = 4096
    q = torch.full((8, k), 127, dtype=torch.int8)
    q[1] = -127
    x = torch.full((1, k), -1.0)
    packed, scales = cpu_ext.pack_quads_int8(q, torch.ones(8))
    for vnni in (True, False):
        got = cpu_ext.gemv_int8(x, packed, scales, None, 8, activations="int8", vnni=vnni)
        want = torch.full((1, 8), -127.0 * k)
        want[0, 1] = 127.0 * k
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    zero = cpu_ext.gemv_int8(torch.zeros(1, k), packed, scales, None, 8, activations="int8")
    assert torch.equal(zero, torch.zeros(1, 8))


def test_gemv_int8_x8_refuses_what_it_cannot_compute():
    q = torch.zeros((8, 32), dtype=torch.int8)
    q[0, 0] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        cpu_ext.pack_quads_int8(q, torch.ones(8))
    packed, scales = cpu_ext.pack_quads_int8(torch.zeros((8, 64), dtype=torch.int8), torch.ones(8))
    with pytest.raises(RuntimeError, match="blocks of 32 columns"):
        cpu_ext.gemv_int8(torch.zeros(1, 96), packed, scales, None, 8, activations="int8")
    with pytest.raises(ValueError, match="unknown activations"):
        cpu_ext.gemv_int8(torch.zeros(1, 64), packed, scales, None, 8, activations="int4")


def test_gemv_int8_w16_int32_sums_never_overflow():
    """Extreme weights and activations over a long row: the int32 sums are flushed to fp32
    every 128 column pairs, so 127 * 32767 products over K = 8192 stay exact."""
    k = 8192
    q = torch.full((8, k), 127, dtype=torch.int8)
    x = torch.ones(1, k)
    packed, scales = cpu_ext.pack_pairs_int8(q, torch.ones(8))
    got = cpu_ext.gemv_int8(x, packed, scales, None, 8, activations="int16")
    torch.testing.assert_close(got, torch.full((1, 8), 127.0 * k), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [2, 33])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_rows_equal_one_row_at_a_time(rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x, r = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    res = r if with_residual else None
    got, got_res = cpu_ext.add_rms_norm(x, res, w, 1e-5)
    for i in range(rows):  # a row's result does not depend on the rows beside it
        one, one_res = cpu_ext.add_rms_norm(
            x[i : i + 1], None if res is None else res[i : i + 1], w, 1e-5
        )
        assert torch.equal(got[i : i + 1], one) and torch.equal(got_res[i : i + 1], one_res)
    want = torch_ref.rms_norm(x, w, 1e-5, res)
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_silu_mul_rows_and_extremes():
    x = torch.randn(17, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4
    x[0, :8] = torch.tensor([-200.0, -88.0, -87.0, -20.0, 0.0, 20.0, 88.0, 200.0])
    torch.testing.assert_close(cpu_ext.silu_mul(x), torch_ref.silu_and_mul(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 20)])
def test_decode_attention_rows_match_reference(hq, hkv, d):
    """B decode rows of different lengths (one with a slot of -1: not cached) over shuffled
    blocks: the cache writes bit-exact, the attention within SDPA's tolerance."""
    lengths = [1, 9, 16, 17, 40, 95]
    batch = len(lengths)
    qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot = decode_case(
        hq, hkv, d, lengths, hq + d
    )
    slot[2] = -1
    scale = d**-0.5

    q, kr, vr = rotary_and_cache(qkv, pos, cos_sin, k_cache, v_cache, slot, hq, hkv)
    want = torch_ref.paged_attention_decode(q, PagedKV(kr, vr, table, lens), scale).reshape(
        batch, hq * d
    )

    got = cpu_ext.decode_attention(
        qkv, pos, cos_sin, k_cache, v_cache, table, lens, slot, hq, hkv, scale
    )
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_attention_refuses_mismatched_rows():
    k_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="one position, slot, context length"):
        cpu_ext.decode_attention(
            torch.zeros(2, 24),
            torch.tensor([0]),
            torch.zeros(8, 8),
            k_cache,
            k_cache.clone(),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.tensor([1, 1], dtype=torch.int32),
            torch.tensor([0, 1]),
            1,
            1,
            1.0,
        )


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rotary_cache_is_the_reference_bit_for_bit(tokens):
    """rotary_cache: torch_ref.rotary_embedding's q, and its k / v written by reshape_and_cache
    (a -1 slot skipped), bit for bit."""
    hq, hkv, d, block, num_blocks, max_pos = 9, 3, 64, 16, 8, 128
    gen = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=gen)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    slot = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    slot[tokens // 2] = -1
    cos_sin = rotary_table(d, max_pos)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)

    q, kr, vr = rotary_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, hq, hkv)

    got = cpu_ext.rotary_cache(qkv, positions, cos_sin, k_cache, v_cache, slot, hq, hkv)
    assert torch.equal(got, q.reshape(tokens, hq * d))
    assert torch.equal(k_cache, kr) and torch.equal(v_cache, vr)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_ext.rotary_cache(qkv, positions + max_pos, cos_sin, k_cache, v_cache, slot, hq, hkv)
