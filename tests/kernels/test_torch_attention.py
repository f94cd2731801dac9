"""The torch backend's paged attention (batched SDPA over gathered K/V) vs a naive dense SDPA.

Covers each path of ``torch_ref``: decode with and without a padding mask, prefill of whole
equal-length prompts (``is_causal``), prefill chunks over a cached prefix, mixed lengths, empty
chunks, and GQA ratios 1 / 3 / 8.
"""

from __future__ import annotations

import pytest
import torch
from prefixgate.kernels import torch_ref
from prefixgate.kernels.paged import PagedKV

DTYPES = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, id="bf16"),
]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize(
    "lens", [[1, 16, 37, 53], [40, 40, 40]], ids=["mixed", "equal"]
)  # equal lengths: the no-mask path
def test_decode(close, paged_batch, dense, lens, groups, dtype, tol):
    pb = paged_batch(lens, [1] * len(lens), 16, 2, groups, 64, dtype)
    out = torch_ref.paged_attention_decode(*pb.decode_args())
    assert out.dtype == dtype
    close(out, dense(pb), tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize(
    "lens,q_lens",
    [
        pytest.param([33, 33], [33, 33], id="whole-equal"),  # is_causal path
        pytest.param([50], [50], id="one-whole"),
        pytest.param([70, 33, 16], [6, 33, 16], id="prefix-and-whole"),
        pytest.param([100, 20], [64, 1], id="chunk-and-one-token"),
        pytest.param([48, 17, 30], [16, 0, 30], id="empty-chunk"),
        pytest.param([33, 40], [33, 33], id="equal-len-one-prefix"),
    ],
)
def test_prefill(close, paged_batch, dense, lens, q_lens, groups, dtype, tol):
    pb = paged_batch(lens, q_lens, 16, 2, groups, 64, dtype)
    out = torch_ref.paged_attention_prefill(*pb.prefill_args())
    assert out.dtype == dtype
    close(out, dense(pb), tol)


def test_prefill_one_token_equals_decode(close, paged_batch):
    pb = paged_batch([5, 37, 64], [1, 1, 1], 16, 2, 4, 64)
    dec = torch_ref.paged_attention_decode(*pb.decode_args())
    pre = torch_ref.paged_attention_prefill(*pb.prefill_args())
    close(pre, dec, 1e-5)


def test_empty(paged_batch):
    pb = paged_batch([5], [1], 16, 2, 2, 64)
    kv0 = PagedKV(pb.k_cache, pb.v_cache, pb.block_tables[:0], pb.context_lens[:0])
    out = torch_ref.paged_attention_decode(pb.q[:0], kv0, pb.scale)
    assert out.shape == (0, 4, 64)
    out = torch_ref.paged_attention_prefill(pb.q[:0], kv0, pb.query_start_loc[:1], pb.scale)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize(
    "lens,q_lens",
    [
        pytest.param([40], [5], id="one"),
        pytest.param([17, 64, 5], [5, 5, 5], id="uniform"),  # no padding indices
        pytest.param([33, 9, 70], [3, 5, 2], id="ragged"),  # padded to 5 rows
        pytest.param([6, 16], [6, 2], id="whole-context"),
    ],
)
def test_verify(close, paged_batch, dense, lens, q_lens, groups, dtype, tol):
    # speculative decoding's verify rows: prefill's result, through the decode-like layout
    from prefixgate.engine.attention_metadata import verify_layout_arrays
    from prefixgate.kernels import triton_ops

    pb = paged_batch(lens, q_lens, 16, 2, groups, 64, dtype)
    qsl, mask, q_idx, o_idx = verify_layout_arrays(
        torch.tensor(q_lens).numpy(), torch.tensor(lens).numpy()
    )
    assert (q_idx is None) == (len(set(q_lens)) == 1)
    hints = [torch.from_numpy(a) if a is not None else None for a in (mask, q_idx, o_idx)]
    out = torch_ref.paged_attention_verify(*pb.prefill_args(), *hints)
    assert out.dtype == dtype
    close(out, dense(pb), tol)
    close(out, torch_ref.paged_attention_prefill(*pb.prefill_args()), tol)
    as_bool = [hints[0] == 0, *hints[1:]]  # the long-context form of the mask (True: visible)
    close(torch_ref.paged_attention_verify(*pb.prefill_args(), *as_bool), dense(pb), tol)
    if dtype == torch.float32:  # the Triton backend takes its prefill kernel (interpreter here)
        close(triton_ops.paged_attention_verify(*pb.prefill_args(), *hints), dense(pb), tol)


def test_verify_layout_refuses_bad_lengths():
    import numpy as np
    from prefixgate.engine.attention_metadata import verify_layout_arrays

    with pytest.raises(ValueError, match="q_len <= context_len"):
        verify_layout_arrays(np.array([5]), np.array([4]))
    with pytest.raises(ValueError, match=r"\[Bv\]"):
        verify_layout_arrays(np.array([], dtype=np.int64), np.array([], dtype=np.int64))


def test_verify_layout_mask_is_bool_past_the_float_limit():
    import numpy as np
    from prefixgate.engine.attention_metadata import FLOAT_MASK_MAX, verify_layout_arrays

    small = verify_layout_arrays(np.array([5]), np.array([40]))[1]
    assert small.dtype == np.float32 and small.shape == (1, 1, 5, 40)
    long_ctx = FLOAT_MASK_MAX // 5 + 1
    big = verify_layout_arrays(np.array([5]), np.array([long_ctx]))[1]
    assert big.dtype == np.bool_ and big.shape == (1, 1, 5, long_ctx)
    assert big[0, 0, 0, : long_ctx - 4].all() and not big[0, 0, 0, long_ctx - 4 :].any()
