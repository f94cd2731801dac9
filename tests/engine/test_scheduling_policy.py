"""Scheduling policies on scripted arrival sequences: FCFS, priority (vLLM's) and fair (VTC).

The scheduler runs without a model: every sampled token is a fixed id, so what is checked is
only who is admitted when, the per-tenant counters (VTC: ``(w_in * input + w_out * output) /
weight``), counter lifting for tenants back from idle, weights, priorities and preemption
victims, and that the block pool ends whole under every policy.
"""

from __future__ import annotations

import random
import zlib

import pytest
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.protocol import EngineRequest
from prefixgate.engine.request import Request
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler

BS = 16
TOKEN = 7  # every sampled token (never EOS: requests end by length)


def make(policy: str, num_blocks: int = 256, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, scheduling_policy=policy, **cfg)
    return Scheduler(config, KVCacheManager.from_config(config, num_blocks), 4096)


def req(
    rid: str,
    n_prompt: int,
    max_tokens: int = 4,
    tenant: str | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    base: int = 100,
) -> Request:
    # distinct per request, the same in every process: hash() of a str is salted per process
    # (PYTHONHASHSEED), and 1 run in about 1,000 gave two requests one prompt, whose shared
    # prefix blocks then left nothing to preempt
    prompt = [base + zlib.crc32(rid.encode()) % 1000 + i for i in range(n_prompt)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        rid,
        prompt,
        sp,
        max_tokens=max_tokens,
        arrival_time=arrival,
        tenant=tenant,
        priority=priority,
    )


def step(sched: Scheduler, preempted: list[str] | None = None) -> list[str]:
    """One step; returns the ids admitted (first scheduled) in it, in admission order, and
    appends those it preempted to ``preempted``."""
    before = {r.request_id for r in sched.running}
    out = sched.schedule()
    if preempted is not None:
        preempted += out.preempted
    admitted = [s.request.request_id for s in out.scheduled if s.request.request_id not in before]
    sched.update_from_output(out, {s.request.request_id: TOKEN for s in out.scheduled if s.samples})
    sched.check_invariants()
    return admitted


def steps_until_done(sched: Scheduler, max_steps: int) -> tuple[list[str], list[str]]:
    """Step until no request is left (at most ``max_steps``): the ids admitted and the ids
    preempted, each in order."""
    order: list[str] = []
    preempted: list[str] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        order += step(sched, preempted)
    return order, preempted


def run_all(sched: Scheduler, max_steps: int = 10_000) -> list[str]:
    order, _ = steps_until_done(sched, max_steps)
    assert not sched.has_unfinished_requests()
    s = sched.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0, s
    return order


def counters(sched: Scheduler) -> dict[str, float]:
    return {t: row["virtual_counter"] for t, row in sched.stats()["tenants"].items()}


# ---- fcfs ------------------------------------------------------------------------------------


def test_fcfs_admits_in_arrival_order_whatever_the_tenant_or_priority():
    sched = make("fcfs", max_num_seqs=1)
    for i, (t, p) in enumerate([("a", 3), ("b", 0), ("a", 1), ("b", 2)]):
        sched.add_request(req(f"r{i}", 20, tenant=t, priority=p, arrival=i))
    assert run_all(sched) == ["r0", "r1", "r2", "r3"]


# ---- priority --------------------------------------------------------------------------------


def test_priority_lower_first_ties_by_arrival():
    sched = make("priority", max_num_seqs=1)
    script = [("r0", 2, 0.0), ("r1", 0, 1.0), ("r2", 1, 2.0), ("r3", 0, 3.0), ("r4", 2, 4.0)]
    for rid, prio, t in script:
        sched.add_request(req(rid, 20, priority=prio, arrival=t))
    assert run_all(sched) == ["r1", "r3", "r2", "r0", "r4"]


def test_priority_preempts_the_lowest_priority_running_request():
    # 6 blocks of 16 tokens; two requests of 40-token prompts (3 blocks each) grow until one
    # must yield: the victim is the one with the larger priority value, whatever its age.
    sched = make("priority", num_blocks=6, max_num_batched_tokens=256)
    urgent = req("urgent", 40, max_tokens=20, priority=0, arrival=1.0)
    lazy = req("lazy", 40, max_tokens=20, priority=5, arrival=0.0)
    sched.add_request(lazy)
    sched.add_request(urgent)
    _, victims = steps_until_done(sched, 200)
    assert victims and set(victims) == {"lazy"}
    assert urgent.num_preemptions == 0 and lazy.num_output_tokens == 20
    assert sched.stats()["kv_blocks_used"] == 0


# ---- fair (VTC) ------------------------------------------------------------------------------


def test_fair_counters_charge_weighted_input_and_output_tokens():
    sched = make("fair", fair_input_weight=1.0, fair_output_weight=2.0)
    sched.add_request(req("a0", 30, max_tokens=5, tenant="a"))
    sched.add_request(req("b0", 10, max_tokens=3, tenant="b"))
    run_all(sched)
    t = sched.stats()["tenants"]
    assert t["a"]["served_input_tokens"] == 30 and t["a"]["served_output_tokens"] == 5
    assert t["b"]["served_input_tokens"] == 10 and t["b"]["served_output_tokens"] == 3
    assert counters(sched) == {"a": 30 + 2 * 5, "b": 10 + 2 * 3}


def test_fair_admits_the_least_served_backlogged_tenant():
    # tenant a floods 6 requests first, b sends 3 after: with one seat, FCFS would serve all of
    # a's first; VTC alternates once a's counter passes b's (b starts lifted to a's counter 0)
    sched = make("fair", max_num_seqs=1)
    for i in range(6):
        sched.add_request(req(f"a{i}", 20, max_tokens=2, tenant="a", arrival=i))
    for i in range(3):
        sched.add_request(req(f"b{i}", 20, max_tokens=2, tenant="b", arrival=10 + i))
    order = run_all(sched)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


def test_fair_lifts_a_tenant_back_from_idle():
    # b is idle while a is served a lot; when b comes back its counter is lifted to a's (the
    # least backlogged counter), so it gets no burst of credit for the time it was away
    sched = make("fair", max_num_seqs=1)
    for i in range(4):
        sched.add_request(req(f"a{i}", 50, max_tokens=4, tenant="a", arrival=i))
    sched.add_request(req("b-early", 10, max_tokens=1, tenant="b", arrival=0.5))
    for _ in range(3):
        step(sched)  # b-early runs and finishes; a keeps being served
    while "a1" not in {r.request_id for r in sched.running}:
        step(sched)
    a_before = counters(sched)["a"]
    b_before = counters(sched)["b"]
    assert b_before < a_before
    sched.add_request(req("b-back", 10, max_tokens=1, tenant="b", arrival=100))
    assert counters(sched)["b"] == a_before  # lifted to the backlogged minimum (a's)
    # and with the queue empty, a newcomer is lifted to the last tenant that left it
    run_all(sched)
    last = counters(sched)["a"]
    sched.add_request(req("c0", 10, max_tokens=1, tenant="c", arrival=200))
    assert counters(sched)["c"] == last
    run_all(sched)


def test_fair_tenant_weights_scale_the_share():
    # a has weight 2: each token costs it half, so with both backlogged a gets ~2x service
    sched = make("fair", max_num_seqs=1, tenant_weights={"a": 2.0})
    for i in range(12):
        sched.add_request(req(f"a{i}", 20, max_tokens=2, tenant="a", arrival=i))
        sched.add_request(req(f"b{i}", 20, max_tokens=2, tenant="b", arrival=i + 0.5))
    order = run_all(sched)
    first = order[:12]
    assert sum(r.startswith("a") for r in first) == 8  # 2:1 while both are backlogged
    t = sched.stats()["tenants"]
    assert counters(sched)["a"] == pytest.approx((12 * 20 + 2 * 12 * 2) / 2.0)
    assert t["b"]["served_input_tokens"] == 12 * 20


@pytest.mark.parametrize("seed", range(3))
def test_fair_service_difference_stays_within_the_vtc_bound(seed):
    # two tenants kept backlogged with requests of random sizes; while both have requests
    # waiting, their counters never differ by more than 2 * the largest request cost
    # (Sheng et al., Theorem 4.4: 2 * max(w_in * L_in + w_out * L_out))
    rng = random.Random(seed)
    sched = make("fair", max_num_seqs=4, max_num_batched_tokens=128, num_blocks=512)
    costs = []
    n = 0
    for _ in range(400):
        for t in ("a", "b"):
            if sum(1 for r in sched.waiting if r.tenant == t) < 3 and n < 160:
                n_in, n_out = rng.randint(4, 120), rng.randint(1, 12)
                costs.append(1.0 * n_in + 2.0 * n_out)
                sched.add_request(req(f"{t}{n}", n_in, max_tokens=n_out, tenant=t, arrival=n))
                n += 1
        step(sched)
        backlogged = {r.tenant for r in sched.waiting}
        if backlogged == {"a", "b"}:
            c = counters(sched)
            assert abs(c["a"] - c["b"]) <= 2 * max(costs), (c, max(costs))
    run_all(sched)


def test_fair_preempts_the_most_served_tenant():
    sched = make("fair", num_blocks=6, max_num_batched_tokens=256)
    heavy = req("heavy", 40, max_tokens=20, tenant="heavy", arrival=0.0)
    light = req("light", 40, max_tokens=20, tenant="light", arrival=1.0)
    sched.add_request(heavy)
    sched.add_request(light)
    step(sched)  # both admitted
    sched.policy.tenants["heavy"].counter += 1000.0  # as if served a lot more before
    _, victims = steps_until_done(sched, 200)
    assert victims and set(victims) == {"heavy"}
    assert light.num_preemptions == 0
    assert sched.stats()["kv_blocks_used"] == 0


# ---- every policy: the rest of the scheduler keeps working -----------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_shared_prefixes_preemption_and_chunks_under_every_policy(policy, scheduling):
    # shared prefixes (prefix caching + in-flight dedup), long prompts (chunked prefill) and a
    # tight cache (preemption), random tenants and priorities: everything finishes, pool whole
    rng = random.Random(1)
    sched = make(
        policy,
        num_blocks=16,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        scheduling=scheduling,
    )
    shared = [list(range(500, 548)), list(range(600, 632))]
    reqs = []
    for i in range(40):
        prompt = rng.choice(shared) + [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        r = Request(
            f"r{i}",
            prompt,
            sp,
            max_tokens=sp.max_tokens,
            tenant=rng.choice(["x", "y", None]),
            priority=rng.randint(0, 3),
        )
        reqs.append(r)
        sched.add_request(r)
    run_all(sched)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    s = sched.stats()
    assert s["prefix_cache_hits"] > 0
    if scheduling == "continuous":
        assert s["num_preemptions"] > 0
    served = sum(row["served_output_tokens"] for row in s["tenants"].values())
    assert served == sum(r.max_tokens for r in reqs)


def test_bad_policy_and_weights_are_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="tenant_weights"):
        EngineConfig(tenant_weights={"a": 0})
    with pytest.raises(TypeError, match="fair_output_weight"):
        EngineConfig(fair_output_weight="2")
    # a request's fields are checked once, where the caller builds its EngineRequest
    with pytest.raises(TypeError, match="priority"):
        EngineRequest("r", [1, 2], priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tenant"):
        EngineRequest("r", [1, 2], tenant=3)  # type: ignore[arg-type]
