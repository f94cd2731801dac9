"""Anticipation: the loop waits a moment for a light tenant's next request, never otherwise.

Unit level with explicit clocks (``Anticipation``), scheduler level with a fake clock and the
fake greedy model of ``test_displacement`` (steps counted, never timed; the pool whole after
each scenario), and the real ``AsyncEngine`` on aidreams-260k (greedy tokens equal with it on
and off).
"""

from __future__ import annotations

import asyncio

import pytest
from prefixgate.engine import AsyncEngine, EngineConfig, SamplingParams
from prefixgate.engine import scheduler as scheduler_module
from prefixgate.engine.anticipation import MIN_THINK_TIMES, Anticipation
from prefixgate.engine.protocol import EngineRequest

from .test_displacement import Trace, assert_whole, make, reference, req, step


# ---- the think-time rule ------------------------------------------------------------------
def test_a_tenant_is_waited_for_only_after_it_came_back_quickly_often_enough():
    a = Anticipation(0.030)
    t = 100.0
    for i in range(MIN_THINK_TIMES):
        a.on_idle("light", t)
        assert a.deadline(t + 0.001, lambda _: True) is None, i  # not enough think times yet
        t += 0.005
        a.on_arrival("light", t)
        t += 1.0
    a.on_idle("light", t)
    assert a.window("light") == pytest.approx(0.012)  # 2 x median 5 ms + 2 ms, under 30 ms
    assert a.deadline(t + 0.001, lambda _: True) == pytest.approx(t + 0.012)
    assert a.deadline(t + 0.002, lambda _: True) == pytest.approx(t + 0.012)  # one wait
    assert a.num_waits == 1 and a.num_hits == 0
    assert a.deadline(t + 0.013, lambda _: True) is None  # the window has passed
    a.on_arrival("light", t + 0.004)
    assert a.num_hits == 1 and a.stats()["anticipation_hits"] == 1


def test_slow_tenants_ineligible_ones_and_a_zero_cap_are_never_waited_for():
    a = Anticipation(0.030)
    t = 0.0
    for _ in range(MIN_THINK_TIMES + 2):
        a.on_idle("slow", t)
        a.on_arrival("slow", t + 0.050)  # think time 50 ms > the 30 ms cap
        a.on_idle("quick", t)
        a.on_arrival("quick", t + 0.100 if _ == 0 else t + 0.002)
        t += 1.0
    a.on_idle("slow", t)
    a.on_idle("quick", t)
    assert a.window("slow") is None
    assert a.window("quick") == pytest.approx(0.006)  # the median ignores one slow return
    assert a.deadline(t, lambda name: name != "quick") is None  # the policy says no
    off = Anticipation(0.0)
    for i in range(5):
        off.on_idle("light", float(i))
        off.on_arrival("light", i + 0.001)
    off.on_idle("light", 9.0)
    assert off.deadline(9.0, lambda _: True) is None and off.num_waits == 0
    with pytest.raises(ValueError, match="max_wait_s"):
        Anticipation(-1.0)


# ---- in the scheduler ---------------------------------------------------------------------
class Clock:
    """A stand-in for the ``time`` module in ``engine.scheduler``: ``monotonic()`` is ``now``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def drive(policy: str, monkeypatch, think_s: float, **cfg):
    """A heavy tenant on all 4 seats (8 requests); light sends 6 short requests one after
    another, each ``think_s`` after its last ended (the fake clock advances 20 ms a step, and
    the step that ends a request counts: a think time is ``20 ms + think_s``).
    Returns the scheduler, the trace and, per light request, the deadline the scheduler gave
    just after its predecessor ended."""
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    sched = make(policy, max_num_seqs=4, **cfg)
    tr = Trace()
    for i in range(8):
        r = req(f"h{i}", 40, 60, tenant="heavy")
        tr.prompts[r.request_id] = list(r.prompt_token_ids)
        sched.add_request(r)
    for _ in range(3):
        step(sched, tr)
        clock.now += 0.020
    deadlines: list[float | None] = []
    for i in range(6):
        r = req(f"l{i}", 4, 2, tenant="light")
        tr.prompts[r.request_id] = list(r.prompt_token_ids)
        sched.add_request(r)
        while r.request_id not in tr.finished_at:
            step(sched, tr)
            clock.now += 0.020
        clock.now += think_s / 2
        deadlines.append(sched.anticipation_deadline())
        clock.now += think_s / 2
    while sched.has_unfinished_requests():
        step(sched, tr)
        clock.now += 0.020
        assert tr.steps < 3000
    return sched, tr, deadlines


LIGHT_WEIGHT = {"light": 2.0}
"""Light's weight in the fair scenarios: with 1 : 1 its VTC counter, lifted to heavy's at each
arrival, runs neck and neck with heavy's in these short scenarios, and a tenant served more
than the over-share one is rightly not waited for (``FairPolicy.anticipates``, as
``hold_back``); weight 2 keeps light the less served."""


def test_fair_waits_for_a_quick_light_tenant_whose_request_ends_the_wait(monkeypatch):
    sched, tr, deadlines = drive("fair", monkeypatch, think_s=0.004, tenant_weights=LIGHT_WEIGHT)
    # think times are counted from the second light request on; after MIN_THINK_TIMES of
    # them every end of a light request opened a wait, which its next request ended
    assert deadlines[: MIN_THINK_TIMES - 1] == [None] * (MIN_THINK_TIMES - 1)
    assert all(d is not None for d in deadlines[MIN_THINK_TIMES:-1])
    stats = sched.stats()
    assert stats["anticipation_waits"] == len(deadlines) - MIN_THINK_TIMES
    assert stats["anticipation_hits"] == stats["anticipation_waits"] - 1  # the last: none came
    for rid, prompt in tr.prompts.items():  # greedy tokens as an undisturbed run's
        n = 2 if rid.startswith("l") else 60
        assert tr.outputs[rid] == reference(prompt, n), rid
    assert_whole(sched)


def test_fcfs_slow_tenants_and_a_zero_cap_never_wait(monkeypatch):
    for policy, think_s, cfg in (
        ("fcfs", 0.004, {}),
        ("priority", 0.004, {}),
        ("fair", 0.030, {}),  # think time 50 ms: over the 30 ms default
        ("fair", 0.004, {"fair_anticipation_ms": 0.0}),
        ("fair", 0.004, {"scheduling": "static"}),
    ):
        sched, _, deadlines = drive(policy, monkeypatch, think_s, **cfg)
        assert deadlines == [None] * len(deadlines), (policy, think_s, cfg)
        assert sched.stats().get("anticipation_waits", 0) == 0  # absent unless it can wait
        assert_whole(sched)


def test_no_wait_for_a_tenant_with_requests_in_the_engine_or_without_an_over_share_one(
    monkeypatch,
):
    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    sched = make("fair", max_num_seqs=8)
    tr = Trace()
    sched.add_request(req("h0", 40, 200, tenant="heavy"))  # 1 seat of 8: within its share
    for i in range(MIN_THINK_TIMES + 2):
        sched.add_request(req(f"l{i}", 12, 2, tenant="light"))
        while f"l{i}" not in tr.finished_at:
            step(sched, tr)
            clock.now += 0.020
        clock.now += 0.002
        assert sched.anticipation_deadline() is None  # nobody over its share to hold back
    assert sched.anticipation.window("light") is not None  # it is quick: the policy said no
    sched.abort_requests(["h0"])
    assert_whole(sched)


# ---- the real loop ------------------------------------------------------------------------
def run_flood(aidreams_path: str, anticipation_ms: float, pool_whole) -> tuple[dict, list, list]:
    """6 heavy streams of 300 tokens on 4 seats; light sends 8 short requests one after
    another, 50 ms apart. Returns the engine's stats, light's and heavy's greedy tokens."""
    engine = AsyncEngine(
        EngineConfig(
            model=aidreams_path,
            num_kv_blocks=256,
            max_num_seqs=4,
            scheduling_policy="fair",
            tenant_weights=LIGHT_WEIGHT,
            fair_anticipation_ms=anticipation_ms,
        )
    )

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    async def one(rid: str, prompt: str, n: int, tenant: str) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(EngineRequest(rid, prompt, greedy(n), tenant=tenant)):
            ids += out.delta_token_ids
            last = out
        assert last.finished
        return ids

    async def light() -> list[list[int]]:
        out = []
        for i in range(8):
            # think 50 ms: the loop checks for a wait before the next request is in (with no
            # think time in process the request is often there first: no wait is needed)
            await asyncio.sleep(0.05)
            out.append(await one(f"l{i}", "I am", 3, "light"))
        return out

    async def main():
        heavy = [one(f"h{i}", "I sense the nodes", 300, "heavy") for i in range(6)]
        return await asyncio.gather(light(), *heavy)

    try:
        lights, *heavies = asyncio.run(main())
        pool_whole(engine)
        return engine.stats(), lights, heavies
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.usefixtures("one_thread")
def test_async_engine_waits_for_the_light_tenant_and_greedy_tokens_stay_the_same(
    aidreams_path, pool_whole
):
    off_stats, off_light, off_heavy = run_flood(aidreams_path, 0.0, pool_whole)
    on_stats, on_light, on_heavy = run_flood(aidreams_path, 500.0, pool_whole)
    assert "anticipation_waits" not in off_stats  # cap 0: no anticipation, no counters
    # in process a light request follows its predecessor within a few ms, far under the
    # 500 ms cap: the loop waited for it, and its request ended the wait
    assert on_stats["anticipation_hits"] >= 1, on_stats
    assert on_light == off_light and on_heavy == off_heavy
    assert all(x == on_light[0] for x in on_light)
