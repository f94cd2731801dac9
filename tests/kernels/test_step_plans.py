"""The torch backend's step plans (metadata read once per forward) give bitwise the results
of the per-layer kernels they stand for."""

from __future__ import annotations

import torch
from prefixgate.kernels import STEP_PLAN_NAMES, get_backend, torch_ref


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_the_torch_backend_carries_the_step_plans():
    backend = get_backend("torch")
    for name in STEP_PLAN_NAMES:
        assert getattr(backend, name) is getattr(torch_ref, name)


def test_rotate_qk_on_one_row_of_merged_qkv_matches_rotary_embedding():
    # q and k as views of the merged projection: one pass over both heads
    hq, hkv, d = 9, 3, 64
    for tokens in (1, 5):
        qkv = _rand(tokens, (hq + 2 * hkv) * d)
        ref = qkv.clone()
        cache = _rand(100, d, seed=1)
        pos = torch.arange(tokens) + 7
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
        assert torch_ref._adjacent_heads(q, k) is not None
        torch_ref.rotate_qk(q, k, torch_ref.rotary_tables(pos, cache))
        rq, rk, rv = ref.split([hq * d, hkv * d, hkv * d], dim=-1)
        rq, rk = rq.reshape(tokens, hq, d).contiguous(), rk.reshape(tokens, hkv, d).contiguous()
        torch_ref.rotary_embedding(pos, rq, rk, cache)
        assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)


def test_heads_not_adjacent_are_rotated_apart():
    q, k = _rand(2, 4, 8), _rand(2, 2, 8, seed=1)
    assert torch_ref._adjacent_heads(q, k) is None
    cache = _rand(16, 8, seed=2)
    pos = torch.tensor([3, 4])
    rq, rk = q.clone(), k.clone()
    torch_ref.rotate_qk(q, k, torch_ref.rotary_tables(pos, cache))
    torch_ref.rotary_embedding(pos, rq, rk, cache)
    assert torch.equal(q, rq) and torch.equal(k, rk)


def test_attend_decode_matches_paged_attention_decode_with_and_without_padding():
    blocks, size, hkv, hq, d = 12, 4, 2, 6, 16
    k_cache, v_cache = _rand(blocks, size, hkv, d), _rand(blocks, size, hkv, d, seed=1)
    tables = torch.tensor([[3, 7, 1], [5, 2, 0]], dtype=torch.int32)
    q = _rand(2, hq, d, seed=2)
    for lens in ([9, 9], [9, 5]):
        ctx = torch.tensor(lens, dtype=torch.int32)
        plan = torch_ref.plan_decode(tables, ctx)
        assert (plan.mask is None) == (lens[0] == lens[1])
        ours = torch_ref.attend_decode(q, k_cache, v_cache, plan, 0.25)
        ref = torch_ref.paged_attention_decode(q, k_cache, v_cache, tables, ctx, 0.25)
        assert torch.equal(ours, ref)


def test_write_kv_skips_the_slots_marked_minus_one():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    key, value = _rand(3, 1, 2), _rand(3, 1, 2, seed=1)
    slots = torch.tensor([5, -1, 0])
    plan = torch_ref.plan_cache_write(slots)
    assert plan.valid is not None and plan.slots.tolist() == [5, 0]
    torch_ref.write_kv(key, value, k_cache, v_cache, plan)
    flat_k, flat_v = k_cache.view(8, 1, 2), v_cache.view(8, 1, 2)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[0], key[2])
    assert torch.equal(flat_v[5], value[0]) and torch.equal(flat_v[0], value[2])
    assert int((flat_k != 0).any(-1).sum()) == 2
    assert torch_ref.plan_cache_write(torch.tensor([1, 2])).valid is None
