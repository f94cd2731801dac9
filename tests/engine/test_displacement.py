"""Displacement: fair running slots (``fair``) and priority that preempts (``priority``).

The scheduler runs with a fake deterministic "greedy model" (the next token is a hash of the
whole context), so a preempted and recomputed request must end with exactly the tokens of an
unpreempted run (``reference``). Steps are counted, never timed. Every scenario ends with the
pool whole.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.request import Request, RequestStatus
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.scheduling_policy import POLICIES, FairPolicy, policy_class

BS = 16
VOCAB = 1000


def fake_token(context: list[int]) -> int:
    return 3 + zlib.crc32(array("q", context).tobytes()) % (VOCAB - 3)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(fake_token(ctx))
        ctx.append(out[-1])
    return out


def make(policy: str, num_blocks: int = 512, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, scheduling_policy=policy, **cfg)
    return Scheduler(config, KVCacheManager.from_config(config, num_blocks), 4096)


def req(
    rid: str, n_prompt: int, max_tokens: int, tenant: str | None = None, priority: int = 0
) -> Request:
    seed = zlib.crc32(rid.encode())
    prompt = [3 + (seed + 37 * i) % (VOCAB - 3) for i in range(n_prompt)]  # distinct per id
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, sp, max_tokens=max_tokens, tenant=tenant, priority=priority)


@dataclass
class Trace:
    """What a driven run saw, step by step."""

    steps: int = 0
    first_scheduled: dict[str, int] = field(default_factory=dict)  # id -> step
    first_token: dict[str, int] = field(default_factory=dict)
    preempted_at: dict[str, list[int]] = field(default_factory=dict)
    preempted_outputs: dict[str, list[int]] = field(default_factory=dict)  # tokens by then
    resumed_at: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    seats: list[dict[str, int]] = field(default_factory=list)  # running per tenant, per step
    finished_at: dict[str, int] = field(default_factory=dict)


def step(sched: Scheduler, tr: Trace) -> None:
    before = {r.request_id for r in sched.running}
    out = sched.schedule()
    n = tr.steps
    assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for rid in out.preempted:
        tr.preempted_at.setdefault(rid, []).append(n)
        tr.preempted_outputs.setdefault(rid, []).append(sched.requests[rid].num_output_tokens)
    for s in out.scheduled:
        rid = s.request.request_id
        tr.first_scheduled.setdefault(rid, n)
        if rid not in before and rid in tr.preempted_at:
            tr.resumed_at.setdefault(rid, []).append(n)
    seats: dict[str, int] = {}
    for r in sched.running:
        seats[r.tenant or "default"] = seats.get(r.tenant or "default", 0) + 1
    tr.seats.append(seats)
    sampled = {
        s.request.request_id: fake_token(s.request.all_token_ids)
        for s in out.scheduled
        if s.samples
    }
    for s in out.scheduled:
        if s.samples:
            tr.first_token.setdefault(s.request.request_id, n)
    for r in sched.update_from_output(out, sampled):
        tr.outputs[r.request_id] = list(r.output_token_ids)
        tr.finished_at[r.request_id] = n
    sched.check_invariants()
    tr.steps += 1


def step_until_done(sched: Scheduler, tr: Trace) -> None:
    """``step`` until no request is left."""
    while sched.has_unfinished_requests():
        step(sched, tr)


def add(sched: Scheduler, tr: Trace, r: Request, reqs: dict[str, Request] | None = None) -> None:
    """Add ``r`` to ``sched``, its prompt to the trace and (if given) ``r`` to ``reqs`` by id."""
    tr.prompts[r.request_id] = list(r.prompt_token_ids)
    if reqs is not None:
        reqs[r.request_id] = r
    sched.add_request(r)


def assert_whole(sched: Scheduler) -> None:
    sched.check_invariants()
    s = sched.stats()
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s["kv_blocks_used"] + s["kv_blocks_free"] == s["kv_blocks_total"], s
    assert s["kv_blocks_used"] == s["pinned_blocks"], s


def assert_greedy_unchanged(tr: Trace, reqs: dict[str, Request]) -> None:
    for rid, r in reqs.items():
        assert tr.outputs[rid] == reference(tr.prompts[rid], r.max_tokens), rid


def run_random_arrivals(
    sched: Scheduler,
    rng: random.Random,
    count: int,
    p_arrive: float,
    new_req: Callable[[int], Request],
    max_steps: int,
) -> None:
    """Step ``sched`` while ``count`` requests arrive at random (before each step the n-th
    arrives with probability ``p_arrive``, built by ``new_req(n)``) until all are done; the run
    must end within ``max_steps`` steps (no preemption loop), displace at least once, give every
    request its reference tokens and leave the pool whole."""
    tr = Trace()
    reqs: dict[str, Request] = {}
    n = 0
    while n < count or sched.has_unfinished_requests():
        if n < count and rng.random() < p_arrive:
            add(sched, tr, new_req(n), reqs)
            n += 1
        step(sched, tr)
        assert tr.steps < max_steps, "no progress: a preemption loop"
    assert sched.num_displacements > 0
    assert_greedy_unchanged(tr, reqs)
    assert_whole(sched)


# ---- policies declare what they use ------------------------------------------------------------


def test_policies_declare_priority_and_tenant_weights():
    assert {n: (c.uses_priority, c.uses_tenant_weights) for n, c in POLICIES.items()} == {
        "fcfs": (False, False),
        "priority": (True, False),
        "fair": (False, True),
    }
    assert policy_class("fair") is FairPolicy
    with pytest.raises(ValueError, match="scheduling_policy"):
        policy_class("lottery")


# ---- fair running slots ------------------------------------------------------------------------

SEATS = 8
HEAVY = dict(n_prompt=100, max_tokens=40)
LIGHT = dict(n_prompt=20, max_tokens=4)


def flood(policy: str, n_light: int = 6, gap: int = 12, **cfg) -> tuple[Scheduler, Trace, dict]:
    """Heavy floods 32 long requests at step 0; light sends one short request every ``gap``
    steps (from step 5) after the previous one finished. Ample KV blocks: seats and the token
    budget are what the tenants compete for. ``cfg``: more ``EngineConfig`` fields."""
    sched = make(policy, max_num_seqs=SEATS, max_num_batched_tokens=256, **cfg)
    tr = Trace()
    reqs: dict[str, Request] = {}
    for i in range(32):
        r = req(f"h{i}", tenant="heavy", **HEAVY)
        reqs[r.request_id] = r
        add(sched, tr, r)
    light_at: dict[str, int] = {}
    nxt = 5
    while sched.has_unfinished_requests() or len(light_at) < n_light:
        sent = len(light_at)
        last = f"l{sent - 1}"
        if sent < n_light and tr.steps >= nxt and (sent == 0 or last in tr.outputs):
            r = req(f"l{sent}", tenant="light", **LIGHT)
            reqs[r.request_id] = r
            light_at[r.request_id] = tr.steps
            add(sched, tr, r)
            nxt = tr.steps + gap
        step(sched, tr)
        assert tr.steps < 5000, "no progress"
    assert len(light_at) == n_light
    assert_whole(sched)
    return sched, tr, {"reqs": reqs, "light_at": light_at}


def test_fair_light_tenant_is_scheduled_at_once_while_the_heavy_one_floods():
    sched, tr, info = flood("fair")
    # the bound: admitted in the first step after its arrival (ample blocks: no decode-phase
    # preemption), by displacing the heavy tenant's newest running request; its 20-token
    # prompt fits its share of the step budget (128 of 256), so its first token is that step's
    for rid, at in info["light_at"].items():
        assert tr.first_scheduled[rid] == at, rid
        assert tr.first_token[rid] == at, rid
    assert sched.num_displacements > 0  # (a light request that finds a free seat needs none)
    assert_greedy_unchanged(tr, info["reqs"])
    # FCFS (same script): light waits for the heavy queue — the test has teeth
    _, fcfs, finfo = flood("fcfs")
    assert fcfs.first_token["l0"] - finfo["light_at"]["l0"] > 100


def test_fair_displaces_the_victim_cheapest_to_recompute():
    # two heavy requests hold both seats; the older one's context ends on a block boundary
    # (preempted now it recomputes nothing: its full blocks stay cached), the newer one's 3
    # tokens past one: the light request takes the older one's seat, not the newest's
    sched = make("fair", max_num_seqs=2, max_num_batched_tokens=256)
    tr = Trace()
    reqs = {r.request_id: r for r in (req("h0", 30, 40, "heavy"), req("h1", 17, 40, "heavy"))}
    for r in reqs.values():
        add(sched, tr, r)
    for _ in range(3):  # h0: 30 prompt + 2 decodes computed = 32; h1: 17 + 2 = 19
        step(sched, tr)
    assert [r.num_computed_tokens for r in sched.running] == [32, 19]
    light = req("l0", 20, 4, "light")
    reqs["l0"] = light
    add(sched, tr, light)
    step(sched, tr)
    assert tr.preempted_at == {"h0": [3]}  # the cheapest, though h1 is the newest
    assert tr.first_scheduled["l0"] == 3
    step_until_done(sched, tr)
    assert_greedy_unchanged(tr, reqs)
    assert_whole(sched)


def test_fair_heavy_tenant_keeps_its_share_and_its_starvation_bound():
    sched, tr, info = flood("fair", n_light=6, gap=3)
    reqs = info["reqs"]
    # (1) hysteresis (blocks are ample, so every preemption here is a displacement): between
    # two fairness preemptions a request samples >= fair_min_progress tokens, so none is
    # preempted more than 1 + max_tokens // 16 times
    p = FairPolicy.fair_min_progress
    for rid, outs in tr.preempted_outputs.items():
        assert all(b - a >= p for a, b in zip(outs, outs[1:], strict=False)), (rid, outs)
        assert len(outs) <= 1 + reqs[rid].max_tokens // p
    assert set(tr.preempted_at) <= {r for r in reqs if r.startswith("h")}
    # (4) the heavy tenant never runs fewer than its share (4 of 8 seats) while it has that
    # many unfinished requests (from the light tenant's first arrival, step 5: before it the
    # budget, not fairness, limits how many heavy prompts start per step)
    share = FairPolicy().shares({"heavy", "light"}, SEATS, 512)["heavy"][0]
    assert share == SEATS // 2
    for n, seats in enumerate(tr.seats):
        if n < 5:
            continue
        left = sum(1 for r in reqs if r.startswith("h") and tr.finished_at[r] >= n)
        if left >= share:
            assert seats.get("heavy", 0) >= share, (n, seats)
    # (4) a preempted heavy request resumes at the latest when the heavy requests running at
    # its preemption have finished: each needs at most ceil(100 / 128) prefill steps and 40
    # decodes, so the wait is within one heavy request's length in steps (41)
    bound = -(-HEAVY["n_prompt"] // 128) + HEAVY["max_tokens"]
    waits = [
        back - at
        for r in tr.preempted_at
        for at, back in zip(tr.preempted_at[r], tr.resumed_at[r], strict=True)
    ]
    assert waits and max(waits) <= bound, (max(waits), bound)
    assert_greedy_unchanged(tr, reqs)


def test_fair_long_heavy_requests_are_preempted_again_only_after_progress():
    # heavy keeps 32 long requests (256 output tokens) outstanding on 8 seats; light sends a
    # short request every 16 steps. With "at most once" hysteresis every heavy running request
    # would soon be exempt and light would wait for one to finish (~256 steps); with
    # fair_min_progress a request yields again after 16 more tokens of progress.
    # (The light first step alone, FairPolicy.hold_back, is off here: its one held step per
    # light request shifts this script so that light's previous request always ends just
    # before the next one arrives, and nothing is displaced at all; it has its own test.)
    sched = make(
        "fair",
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        num_blocks=2048,
        fair_first_step_alone=False,
    )
    tr = Trace()
    reqs: dict[str, Request] = {}
    light_at: dict[str, int] = {}
    n_heavy = 0
    while tr.steps < 600:
        while sum(1 for r in sched.requests.values() if r.tenant == "heavy") < 32:
            r = req(f"h{n_heavy}", 256, 256, tenant="heavy")
            n_heavy += 1
            reqs[r.request_id] = r
            add(sched, tr, r)
        if tr.steps % 16 == 0:
            r = req(f"l{len(light_at)}", 32, 16, tenant="light")
            reqs[r.request_id] = r
            light_at[r.request_id] = tr.steps
            add(sched, tr, r)
        step(sched, tr)
    sched.abort_requests(list(sched.requests))
    assert_whole(sched)
    assert all(tr.first_token[rid] == at for rid, at in light_at.items()), light_at
    p = FairPolicy.fair_min_progress
    again = {rid: o for rid, o in tr.preempted_outputs.items() if len(o) > 1}
    assert again, "the scenario must preempt some request twice"
    for rid, outs in tr.preempted_outputs.items():
        assert all(b - a >= p for a, b in zip(outs, outs[1:], strict=False)), (rid, outs)
    for rid, outs in tr.outputs.items():  # finished ones: the reference tokens
        assert outs == reference(tr.prompts[rid], reqs[rid].max_tokens), rid


def test_fair_token_budget_is_shared_while_both_tenants_want_tokens():
    # one seat each is enough: heavy's long prompts would take the whole 128-token budget
    # under fcfs; under fair the light tenant's prefill gets its half in the first round
    sched = make("fair", max_num_seqs=8, max_num_batched_tokens=128)
    tr = Trace()
    for i in range(4):
        add(sched, tr, req(f"h{i}", 400, 2, tenant="heavy"))
    step(sched, tr)
    add(sched, tr, req("l0", 100, 2, tenant="light"))
    out = sched.schedule()
    got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got["l0"] == 64 and sum(got.values()) == 128, got
    sched.update_from_output(out, {})
    sched.check_invariants()
    # alone, a tenant takes the whole budget (work-conserving)
    solo = make("fair", max_num_seqs=8, max_num_batched_tokens=128)
    solo.add_request(req("x", 400, 2, tenant="heavy"))
    assert solo.schedule().num_scheduled_tokens == 128
    for s in (sched, solo):
        while s.has_unfinished_requests():
            o = s.schedule()
            s.update_from_output(o, {x.request.request_id: 7 for x in o.scheduled if x.samples})
        assert_whole(s)


def test_fair_light_tenant_over_its_share_does_not_displace():
    # light already holds its 1 of 2 seats: a second light request waits (no displacement),
    # and the heavy tenant is never taken below its share
    sched = make("fair", max_num_seqs=2, max_num_batched_tokens=256)
    tr = Trace()
    add(sched, tr, req("h0", 30, 30, tenant="heavy"))
    add(sched, tr, req("h1", 30, 30, tenant="heavy"))
    step(sched, tr)
    add(sched, tr, req("l0", 10, 20, tenant="light"))
    step(sched, tr)
    assert tr.preempted_at == {"h1": [1]} and tr.first_scheduled["l0"] == 1
    add(sched, tr, req("l1", 10, 2, tenant="light"))
    for _ in range(5):
        step(sched, tr)
    assert "l1" not in tr.first_scheduled and sched.num_displacements == 1
    step_until_done(sched, tr)
    assert_whole(sched)


@pytest.mark.parametrize("pin_tenant", ["heavy", None])
def test_fair_pinned_blocks_count_against_the_tenant_share(pin_tenant):
    # 16 blocks, two tenants: 8 each. Heavy pins a 6-block prefix and runs two 60-token
    # requests (4 blocks each): 14 used, 2 free. Light's 40-token prompt needs 3 blocks.
    # Counting the pin, heavy holds 14 > 8 and yields its newest request; without a tenant on
    # the pin heavy holds 8 (its share) and light waits.
    sched = make("fair", num_blocks=16, max_num_seqs=8, max_num_batched_tokens=256)
    tr = Trace()
    prefix = req("pfx", 96, 1, tenant="heavy")
    add(sched, tr, prefix)
    step_until_done(sched, tr)
    sched.kv.pin(prefix.prompt_token_ids, tenant=pin_tenant)
    assert sched.stats()["pinned_blocks"] == 6
    for i in range(2):
        add(sched, tr, req(f"h{i}", 60, 4, tenant="heavy"))
    step(sched, tr)
    assert sched.kv.num_free_blocks == 2
    add(sched, tr, req("l0", 40, 2, tenant="light"))
    step(sched, tr)
    if pin_tenant == "heavy":
        assert tr.preempted_at == {"h1": [2]} and tr.first_scheduled["l0"] == 2
    else:
        assert not tr.preempted_at and "l0" not in tr.first_scheduled
    step_until_done(sched, tr)
    for pin in sched.kv.pins:
        sched.kv.unpin(pin.id)
    assert_whole(sched)


# ---- priority that preempts --------------------------------------------------------------------


def test_priority_displaces_under_full_seats():
    sched = make("priority", max_num_seqs=2, max_num_batched_tokens=256)
    tr = Trace()
    reqs: dict[str, Request] = {}
    for r in (req("lo0", 30, 20, priority=5), req("lo1", 30, 20, priority=5)):
        add(sched, tr, r, reqs)
    for _ in range(3):
        step(sched, tr)
    urgent = req("urgent", 30, 5, priority=0)
    add(sched, tr, urgent, reqs)
    step(sched, tr)
    # the newest lowest-priority request yields its seat at once
    assert tr.preempted_at == {"lo1": [3]} and tr.first_token["urgent"] == 3
    step_until_done(sched, tr)
    assert sched.num_preemptions == 1 and urgent.num_preemptions == 0  # no preemption loop
    assert_greedy_unchanged(tr, reqs)
    assert_whole(sched)
    # fcfs and an equal priority never displace
    for policy, prio in (("fcfs", 0), ("priority", 5)):
        s = make(policy, max_num_seqs=2, max_num_batched_tokens=256)
        t = Trace()
        for r in (req("a", 30, 20, priority=5), req("b", 30, 20, priority=5)):
            add(s, t, r)
        step(s, t)
        add(s, t, req("c", 30, 5, priority=prio))
        step_until_done(s, t)
        assert s.num_preemptions == 0 and t.first_scheduled["c"] >= 20
        assert_whole(s)


def test_priority_displaces_under_full_blocks():
    # 8 blocks; two low-priority 60-token requests hold 4 each; a 30-token urgent request
    # (2 blocks) finds none free though seats are: the newest low one yields
    sched = make("priority", num_blocks=8, max_num_seqs=8, max_num_batched_tokens=256)
    tr = Trace()
    reqs: dict[str, Request] = {}
    for r in (req("lo0", 60, 4, priority=3), req("lo1", 60, 4, priority=3)):
        add(sched, tr, r, reqs)
    step(sched, tr)
    assert sched.kv.num_free_blocks == 0
    urgent = req("urgent", 30, 3, priority=1)
    add(sched, tr, urgent, reqs)
    step(sched, tr)
    assert tr.preempted_at == {"lo1": [1]} and tr.first_token["urgent"] == 1
    step_until_done(sched, tr)
    assert urgent.num_preemptions == 0
    assert sched.num_displacements == 1
    assert_greedy_unchanged(tr, reqs)
    assert_whole(sched)


def test_priority_never_preempts_in_a_loop_under_a_stream_of_priorities():
    # many priorities arriving over time with tight seats and blocks: every request finishes
    # with its reference tokens; each displacement took a strictly lower priority
    rng = random.Random(3)
    sched = make("priority", num_blocks=24, max_num_seqs=4, max_num_batched_tokens=64)

    def new_req(n: int) -> Request:
        return req(f"r{n}", rng.randint(5, 60), rng.randint(1, 20), priority=rng.randint(0, 4))

    run_random_arrivals(sched, rng, 40, 0.5, new_req, max_steps=5000)


# ---- engine-side estimates ---------------------------------------------------------------------


def test_stats_carry_queued_work_and_the_ttft_prediction_follows_its_formula():
    sched = make("fcfs", max_num_seqs=4, max_num_batched_tokens=64)
    assert sched.predict_ttft(10) is None  # nothing measured yet
    for i in range(6):
        sched.add_request(req(f"r{i}", 50, 3))
    s = sched.stats()
    assert s["queued_prefill_tokens"] == 300 and s["running_decodes"] == 0
    assert s["prefill_tokens_per_s"] is None
    while sched.has_unfinished_requests():
        o = sched.schedule()
        sched.update_from_output(o, {x.request.request_id: 7 for x in o.scheduled if x.samples})
    s = sched.stats()
    assert s["prefill_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0
    assert s["finished_per_s"] > 0
    # the formula, on set rates (no clock): 2 running (decoding), 3 waiting of 50 tokens
    for i in range(5):
        sched.add_request(req(f"q{i}", 50, 3))
    o = sched.schedule()  # admits 2 with 64 tokens: one whole, one 14-token chunk
    sched.update_from_output(o, {x.request.request_id: 7 for x in o.scheduled if x.samples})
    load = sched.load
    load.prefill_tokens_per_s, load.decode_tokens_per_s, load.finished_per_s = 1000.0, 50.0, 2.0
    load.mean_output_tokens = None  # no seat schedule: the fluid seat wait (test_finish_rate)
    s = sched.stats()
    d = sched.num_running
    assert s["queued_prefill_tokens"] == 36 + 3 * 50 and s["running_decodes"] == 1
    q = 186 + 40
    steps = -(-q // (64 - d))
    compute = q / 1000 + steps * d / 50
    seat = (d + 3 + 1 - 4) / 2.0
    assert sched.predict_ttft(40) == pytest.approx(max(compute, seat) + d / 50)
    assert sched.predict_ttft(2000, num_cached_tokens=1984) < sched.predict_ttft(2000)
    assert sched.predict_ttft(2000) > sched.predict_ttft(40)
    for bad, exc in ((0, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(exc):
            sched.predict_ttft(bad)
    with pytest.raises(ValueError, match="num_cached_tokens"):
        sched.predict_ttft(10, num_cached_tokens=10)
    while sched.has_unfinished_requests():
        o = sched.schedule()
        sched.update_from_output(o, {x.request.request_id: 7 for x in o.scheduled if x.samples})
    assert_whole(sched)


def test_displaced_request_status_and_blocks():
    # a displaced request is PREEMPTED, holds no block, and is at its tenant's queue front
    sched = make("priority", max_num_seqs=1)
    tr = Trace()
    add(sched, tr, req("lo", 20, 10, priority=2))
    step(sched, tr)
    add(sched, tr, req("hi", 20, 2, priority=0))
    add(sched, tr, req("lo2", 20, 2, priority=2))
    out = sched.schedule()
    lo = sched.requests["lo"]
    assert out.preempted == ["lo"] and lo.status == RequestStatus.PREEMPTED
    assert sched.kv.num_request_blocks("lo") == 0 and sched.waiting[0] is lo
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    step_until_done(sched, tr)
    assert_whole(sched)


@pytest.mark.parametrize("seed", range(3))
def test_fair_displacement_under_tight_seats_and_blocks_never_loops(seed):
    # three weighted tenants, random sizes and arrivals, 4 seats and 24 blocks: decode-phase
    # preemptions and displacements interleave; every request ends with its reference tokens,
    # the hysteresis holds, and the run ends (no preemption loop)
    rng = random.Random(seed)
    sched = make(
        "fair",
        num_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        tenant_weights={"a": 2.0},
    )

    def new_req(n: int) -> Request:
        t = rng.choice(["a", "b", "c"])
        return req(f"{t}{n}", rng.randint(4, 70), rng.randint(1, 30), tenant=t)

    run_random_arrivals(sched, rng, 60, 0.6, new_req, max_steps=20_000)


def test_fair_seat_verdict_skips_a_tenant_at_its_share_before_any_prefix_lookup():
    sched = make("fair", max_num_seqs=2)
    tr = Trace()
    for rid in ("h0", "h1", "h2"):
        add(sched, tr, req(rid, 20, 30, "heavy"))
    step(sched, tr)  # h0, h1 take both seats; h2 waits
    pol, waiting = sched.policy, list(sched.waiting)
    h2 = waiting[0]
    # one tenant active: nobody to be fair to, admission stops at it
    assert pol.seat_verdict(h2, sched.running, waiting, 2, 512) == "stop"
    light = req("l0", 20, 4, "light")
    add(sched, tr, light)
    waiting = list(sched.waiting)
    # two tenants: heavy holds 2 of its 1 seat: passed over; light holds 0 of 1: ask the room
    assert pol.seat_verdict(h2, sched.running, waiting, 2, 512) == "skip"
    assert pol.seat_verdict(light, sched.running, waiting, 2, 512) is None
    looked_up = []
    lookup = sched.kv.get_computed_blocks
    sched.kv.get_computed_blocks = lambda r: looked_up.append(r.request_id) or lookup(r)
    step(sched, tr)
    assert tr.first_scheduled["l0"] == 1  # displaced a heavy request at once
    assert "h2" not in looked_up  # the refused heavy request cost no prefix lookup
    del sched.kv.get_computed_blocks
    step_until_done(sched, tr)
    assert_whole(sched)


def test_fair_light_first_step_runs_alone_and_the_heavy_tenant_every_other_step():
    # the first step of a light request holds its prefill only: the heavy tenant (over its
    # seat share) sits that step out, runs in the next one, and never sits out two in a row
    sched = make("fair", max_num_seqs=SEATS, max_num_batched_tokens=256)
    tr = Trace()
    for i in range(12):
        add(sched, tr, req(f"h{i}", tenant="heavy", **HEAVY))
    for _ in range(5):
        step(sched, tr)
    assert {r.tenant for r in sched.running} == {"heavy"} and len(sched.running) == SEATS

    history: list[set[str]] = []

    def one_step() -> set[str]:
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
        sched.check_invariants()
        history.append({s.request.request_id for s in out.scheduled})
        return history[-1]

    for j in range(4):
        # (a light request waits while its tenant's VTC counter is above heavy's: VTC's
        # order, as for displacement; within a few steps)
        add(sched, tr, req(f"l{j}", tenant="light", **LIGHT))
        for _ in range(10):
            got = one_step()
            if f"l{j}" in got:
                break
        # its first step holds no heavy request (light's own decodes may run beside it)
        assert f"l{j}" in got and not any(rid.startswith("h") for rid in got), got
        got = one_step()  # the next step: the heavy decodes again, with light's
        assert f"l{j}" in got and any(rid.startswith("h") for rid in got), got
    # light requests at once: the heavy tenant never sits out two steps in a row
    for k in range(3):
        add(sched, tr, req(f"m{k}", tenant="light", **LIGHT))
    for _ in range(12):
        one_step()
    assert all(any(rid.startswith(f"m{k}") for got in history for rid in got) for k in range(3))
    for a, b in zip(history, history[1:], strict=False):
        assert any(rid.startswith("h") for rid in a | b), (a, b)
    sched.abort_requests(list(sched.requests))
    assert_whole(sched)


def test_fair_light_first_step_alone_keeps_greedy_outputs_and_bounds():
    # the whole flood script with the first step alone (and without it): greedy outputs
    # unchanged, each light request's first token in the step it arrives for
    sched, tr, info = flood("fair", n_light=6, gap=3)
    assert_greedy_unchanged(tr, info["reqs"])
    for rid, at in info["light_at"].items():
        assert tr.first_token[rid] == at, rid
    _, tr_off, info_off = flood("fair", n_light=6, gap=3, fair_first_step_alone=False)
    assert_greedy_unchanged(tr_off, info_off["reqs"])


def test_fair_hold_back_with_no_first_step_admitted_runs_the_held_requests():
    # a hold that admits no first step (here forced: no light request waits) must not cost
    # the heavy tenant its step: the held requests run in the same step, as without the hold
    twins = [make("fair", max_num_seqs=SEATS, max_num_batched_tokens=256) for _ in range(2)]
    for sched in twins:
        for i in range(10):
            sched.add_request(req(f"h{i}", tenant="heavy", **HEAVY))
        for _ in range(6):
            out = sched.schedule()
            sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
    forced = twins[0]
    forced.policy.hold_back = lambda *a: {"heavy"}  # type: ignore[method-assign]
    outs = [sched.schedule() for sched in twins]
    got = [sorted((s.request.request_id, s.num_new_tokens) for s in o.scheduled) for o in outs]
    assert got[0] == got[1] and len(got[0]) == SEATS
    assert not forced._held_last
    for sched, out in zip(twins, outs, strict=True):
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
        sched.abort_requests(list(sched.requests))
        assert_whole(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair-off", "fair"])
def test_other_policies_never_hold_a_tenant_back(policy):
    # nor fair with fair_first_step_alone off (EngineConfig / --no-fair-first-step-alone)
    cfg = {"fair_first_step_alone": False} if policy == "fair-off" else {}
    sched = make(policy.removesuffix("-off"), max_num_seqs=SEATS, **cfg)
    for i in range(10):
        sched.add_request(req(f"h{i}", tenant="heavy", **HEAVY))
    out = sched.schedule()  # 8 heavy requests take every seat
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
    sched.add_request(req("l0", tenant="light", **LIGHT))
    held = sched.policy.hold_back(sched.running, list(sched.waiting), SEATS, 512)
    assert held == ({"heavy"} if policy == "fair" else set())
    sched.abort_requests(list(sched.requests))
    assert_whole(sched)
