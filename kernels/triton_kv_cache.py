"""Triton paged KV-cache write: scatter a step's K/V rows into their cache slots.

``reshape_and_cache`` has the signature and semantics of ``torch_ref.reshape_and_cache``
(vLLM's name); the kernel copies one token's heads per program and skips slot -1 (padding).
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_checks import check_cache, check_device, check_float, check_int
from prefixgate.kernels.triton_env import next_pow2, tl, triton


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_ch,  # cache: flat slot stride and head stride (both caches alike)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [T, Hkv, D]`` into ``k_cache``/``v_cache [N, S, Hkv, D]`` at
    ``slot_mapping [T]`` (int64 slot = block_id * S + offset; -1 skips), in place.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes, devices or non-contiguous caches.
    """
    check_device(key, value, k_cache, v_cache, slot_mapping)
    check_float("key", key, 3)
    check_float("value", value, 3)
    check_cache(k_cache, v_cache)
    check_int("slot_mapping", slot_mapping, 1)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache "
            f"{tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        H_PAD=next_pow2(num_heads),
        D_PAD=next_pow2(head_dim),
    )
