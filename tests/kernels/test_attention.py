"""Triton paged attention vs the torch reference and a naive dense SDPA (interpreter on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from prefixgate.kernels import torch_ref, triton_decode, triton_ops, triton_prefill
from prefixgate.kernels.paged import PagedKV

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]
# (block_size, head_dim, GQA ratio): every block size x head_dim pair, every ratio twice.
SHAPES = [
    pytest.param(16, 64, 1, id="bs16-d64-g1"),
    pytest.param(16, 128, 4, id="bs16-d128-g4"),
    pytest.param(32, 64, 8, id="bs32-d64-g8"),
    pytest.param(32, 128, 1, id="bs32-d128-g1"),
    pytest.param(16, 64, 8, id="bs16-d64-g8"),
    pytest.param(32, 128, 4, id="bs32-d128-g4"),
]
NUM_KV_HEADS = 2


def _kv_heads(groups: int) -> int:
    """2 KV heads (checks the query→KV head mapping), 1 at GQA 8 to keep the interpreter fast."""
    return 1 if groups >= 8 else NUM_KV_HEADS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,groups", SHAPES)
def test_decode_matches_reference_and_dense(
    close, paged_batch, dense, atol, block_size, head_dim, groups, dtype
):
    # lengths: the first token only, exactly one block, and two non-multiples of the block size
    lens = [1, block_size, 37, 2 * block_size + 5]
    pb = paged_batch(lens, [1] * len(lens), block_size, _kv_heads(groups), groups, head_dim, dtype)
    args = pb.decode_args()
    out = triton_ops.paged_attention_decode(*args)
    assert out.dtype == dtype
    close(out, torch_ref.paged_attention_decode(*args), atol[dtype])
    close(out, dense(pb), atol[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,tile_n", [(2, 16), (5, 32), (16, 16)])
def test_decode_split_k(close, paged_batch, dense, atol, num_splits, tile_n, dtype):
    """Flash-decoding: splits (some empty for short sequences) merged by the reduce kernel."""
    lens = [3, 70, 129, 200]
    pb = paged_batch(lens, [1] * len(lens), 16, NUM_KV_HEADS, 4, 64, dtype)
    cfg = triton_decode.DecodeConfig(tile_n=tile_n, num_splits=num_splits)
    out = triton_decode.paged_attention_decode(*pb.decode_args(), config=cfg)
    ref = torch_ref.paged_attention_decode(*pb.decode_args())
    close(out, ref, atol[dtype])
    close(out, dense(pb), atol[dtype])


def _prefill_case(block_size: int) -> tuple[list[int], list[int]]:
    """A mixed batch: empty prefix, prefix of whole blocks, prefix not a block multiple,
    a one-token chunk after a long prefix."""
    prefixes = [0, 2 * block_size, 21, 50]
    q_lens = [37, 13, 19, 1]
    return [p + n for p, n in zip(prefixes, q_lens, strict=True)], q_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,groups", SHAPES)
def test_prefill_matches_reference_and_dense(
    close, paged_batch, dense, atol, block_size, head_dim, groups, dtype
):
    ctx, q_lens = _prefill_case(block_size)
    pb = paged_batch(ctx, q_lens, block_size, _kv_heads(groups), groups, head_dim, dtype, seed=1)
    args = pb.prefill_args()
    out = triton_ops.paged_attention_prefill(*args)
    assert out.dtype == dtype
    close(out, torch_ref.paged_attention_prefill(*args), atol[dtype])
    close(out, dense(pb), atol[dtype])


@pytest.mark.parametrize(
    "block_m,block_n", [(16, 16), (16, 64), (64, 16)], ids=["m16n16", "m16n64", "m64n16"]
)
def test_prefill_tilings(close, paged_batch, dense, atol, block_m, block_n):
    """Tiles smaller and larger than the chunks and blocks; a zero-length chunk in the middle."""
    ctx, q_lens = [40, 9, 70, 33], [40, 0, 35, 17]
    pb = paged_batch(ctx, q_lens, 16, NUM_KV_HEADS, 4, 64, torch.float32, seed=2)
    cfg = triton_prefill.PrefillConfig(block_m=block_m, block_n=block_n)
    out = triton_prefill.paged_attention_prefill(*pb.prefill_args(), config=cfg)
    close(out, dense(pb), atol[torch.float32])


def test_prefill_of_one_token_equals_decode(close, paged_batch, atol):
    lens = [5, 33, 64]
    pb = paged_batch(lens, [1, 1, 1], 16, NUM_KV_HEADS, 4, 64, torch.float32, seed=3)
    dec = triton_ops.paged_attention_decode(*pb.decode_args())
    pre = triton_ops.paged_attention_prefill(*pb.prefill_args())
    close(pre, dec, atol[torch.float32])


def test_empty_batches(paged_batch):
    pb = paged_batch([5], [1], 16, NUM_KV_HEADS, 1, 64)
    q0 = pb.q[:0]
    kv0 = PagedKV(pb.k_cache, pb.v_cache, pb.block_tables[:0], pb.context_lens[:0])
    out = triton_ops.paged_attention_decode(q0, kv0, pb.scale)
    assert out.shape == (0, NUM_KV_HEADS, 64)
    qsl = torch.zeros(1, dtype=torch.int32, device=q0.device)
    out = triton_ops.paged_attention_prefill(q0, kv0, qsl, pb.scale)
    assert out.shape == (0, NUM_KV_HEADS, 64)


def test_bad_arguments_raise_clear_errors(paged_batch):
    pb = paged_batch([5, 9], [1, 1], 16, NUM_KV_HEADS, 2, 64)
    with pytest.raises(TypeError, match="dtype"):
        triton_ops.paged_attention_decode(pb.q.half(), pb.kv, pb.scale)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_ops.paged_attention_decode(pb.q[:, :3], pb.kv, pb.scale)
    with pytest.raises(ValueError, match="sequences"):
        triton_ops.paged_attention_decode(
            pb.q, replace(pb.kv, block_tables=pb.block_tables[:1]), pb.scale
        )
    with pytest.raises(TypeError, match="block_tables"):
        triton_ops.paged_attention_decode(
            pb.q, replace(pb.kv, block_tables=pb.block_tables.float()), pb.scale
        )
    with pytest.raises(ValueError, match="head_dim"):
        triton_ops.paged_attention_prefill(pb.q[..., :32], pb.kv, pb.query_start_loc, pb.scale)


def test_split_heuristic_bounds(monkeypatch):
    cpu = torch.device("cpu")
    assert triton_decode.choose_num_splits(4, 2, 128, cpu, 64) == 1
    assert triton_decode.choose_num_splits(1, 1, 16384, cpu, 64) >= 2
    # the GPU branch, as on a 132-SM H100/H200
    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)
    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)
    gpu = torch.device("cuda")
    assert triton_decode.choose_num_splits(64, 8, 4096, gpu, 64) == 1  # 512 programs fill it
    assert triton_decode.choose_num_splits(4, 3, 4096, gpu, 64) == 16  # >= 256 tokens a split
    assert triton_decode.choose_num_splits(8, 3, 8192, gpu, 64) == 11
    assert triton_decode.choose_num_splits(1, 1, 100, gpu, 64) == 1


def test_int64_metadata(close, paged_batch, dense, atol):
    """Block tables, context lengths and query offsets may be int64 as well as int32."""
    pb = paged_batch([30, 7], [12, 7], 16, NUM_KV_HEADS, 2, 64, torch.float32, seed=4)
    tables, lens, qsl = pb.block_tables.long(), pb.context_lens.long(), pb.query_start_loc.long()
    kv = PagedKV(pb.k_cache, pb.v_cache, tables, lens)
    out = triton_ops.paged_attention_prefill(pb.q, kv, qsl, pb.scale)
    close(out, dense(pb), atol[torch.float32])
    last = qsl[1:] - 1
    dec = triton_ops.paged_attention_decode(pb.q[last], kv, pb.scale)
    close(dec, out[last], atol[torch.float32])


@pytest.mark.parametrize("head_dim", [16, 80])
def test_other_head_dims(close, paged_batch, dense, atol, head_dim):
    """head_dim 16 (aidreams-260k) and 80 (padded to a 128-wide tile, masked)."""
    pb = paged_batch([21, 40], [21, 9], 16, NUM_KV_HEADS, 2, head_dim, torch.float32, seed=5)
    out = triton_ops.paged_attention_prefill(*pb.prefill_args())
    close(out, dense(pb), atol[torch.float32])
    last = pb.query_start_loc[1:].long() - 1
    dec = triton_ops.paged_attention_decode(pb.q[last], pb.kv, pb.scale)
    close(dec, out[last], atol[torch.float32])
