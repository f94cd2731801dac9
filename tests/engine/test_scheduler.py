"""Scheduler + KV cache manager driven with a fake deterministic 'model' (no weights needed).

The fake sampler picks the next token as a hash of the whole context, like greedy decoding:
the same context always gives the same token, so outputs must not depend on batching,
chunking, preemption or the prefix cache.
"""

from __future__ import annotations

import random
import time
import zlib
from array import array
from dataclasses import dataclass, field

import pytest
from conftest import assert_pool_whole as assert_whole
from prefixgate.engine import kv_cache_manager as pins_module
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import CacheCapacityError
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.load_model import estimate_ttft
from prefixgate.engine.request import Request, RequestStatus
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.scheduler_output import SchedulerOutput

BS = 16
EOS = 2
VOCAB = 1000


def fake_token(context: list[int]) -> int:
    """Deterministic 'greedy' next token of a context (never EOS)."""
    return 3 + zlib.crc32(array("q", context).tobytes()) % (VOCAB - 3)


@dataclass
class Run:
    sched: Scheduler
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    prefill_tokens: int = 0


def make(num_blocks: int = 256, max_model_len: int = 4096, hash_fn=None, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, **cfg)
    kv = KVCacheManager.from_config(config, num_blocks, hash_fn=hash_fn)
    return Scheduler(config, kv, max_model_len)


def request(
    rid: str, prompt: list[int], max_tokens: int = 8, salt: str | None = None, **params
) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(rid, prompt, sp, eos_token_ids=[EOS], max_tokens=max_tokens, cache_salt=salt)


def step(run: Run, sampler=fake_token) -> list[Request]:
    s = run.sched
    out = s.schedule()
    run.steps.append(out)
    assert out.num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(out.scheduled) <= s.max_num_seqs
    assert out.num_scheduled_tokens == sum(x.num_new_tokens for x in out.scheduled)
    decode_flags = [x.is_decode for x in out.scheduled]
    assert decode_flags == sorted(decode_flags, reverse=True), "decodes must come first"
    sampled = {}
    for x in out.scheduled:
        r = x.request
        assert len(x.block_ids) * BS >= x.num_computed_tokens + x.num_new_tokens
        assert x.num_computed_tokens == r.num_computed_tokens
        if not x.is_decode or x.num_computed_tokens < r.num_prompt_tokens:
            run.prefill_tokens += x.num_new_tokens
        if x.samples:
            sampled[r.request_id] = sampler(r.all_token_ids)
    done = s.update_from_output(out, sampled)
    for r in done:
        run.outputs[r.request_id] = list(r.output_token_ids)
        run.finish[r.request_id] = r.finish_reason
    s.check_invariants()
    return done


def drive(
    sched: Scheduler,
    reqs: list[Request] = (),
    max_steps: int = 10_000,
    arrivals=None,
    pinned_ok: bool = False,
) -> Run:
    """Add ``reqs`` (or per-step ``arrivals[step] -> list``) and step until all finish."""
    run = Run(sched)
    for r in reqs:
        sched.add_request(r)
    n = 0
    while sched.has_unfinished_requests() or (arrivals and n < max(arrivals) + 1):
        for r in (arrivals or {}).get(n, []):
            sched.add_request(r)
        step(run)
        n += 1
        assert n < max_steps, "no progress: endless preemption or starvation"
    assert_whole(sched, pinned_ok)
    return run


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = fake_token(ctx)
        out.append(t)
        ctx.append(t)
    return out


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


# ---- continuous batching basics -------------------------------------------------------------


def test_continuous_batching_matches_reference() -> None:
    ps = prompts(20)
    reqs = [request(f"r{i}", p, max_tokens=1 + i % 7) for i, p in enumerate(ps)]
    run = drive(make(max_num_batched_tokens=128, max_num_seqs=8), reqs)
    for i, p in enumerate(ps):
        assert run.outputs[f"r{i}"] == reference(p, 1 + i % 7)
        assert run.finish[f"r{i}"] == "length"
    # prefill and decode shared steps; max_num_seqs bounded the batch
    assert any(
        any(x.is_decode for x in o.scheduled) and any(not x.is_decode for x in o.scheduled)
        for o in run.steps
    )
    assert max(len(o.scheduled) for o in run.steps) == 8


def test_chunked_prefill_respects_budget() -> None:
    sched = make(max_num_batched_tokens=32)
    long = request("long", list(range(3, 103)), max_tokens=3)
    short = request("short", [5, 6, 7], max_tokens=4)
    run = drive(sched, [long, short])
    chunks = [
        x.num_new_tokens
        for o in run.steps
        for x in o.scheduled
        if x.request is long and not x.is_decode
    ]
    assert chunks[:3] == [32, 32, 32] and sum(chunks) == 100
    assert all(o.num_scheduled_tokens <= 32 for o in run.steps)
    assert run.outputs["long"] == reference(list(range(3, 103)), 3)
    assert run.outputs["short"] == reference([5, 6, 7], 4)


def test_decodes_not_starved_by_long_prefill() -> None:
    sched = make(max_num_batched_tokens=16)
    run = Run(sched)
    sched.add_request(request("d", [5, 6], max_tokens=20))
    step(run)  # d prefilled
    sched.add_request(request("p", list(range(3, 200)), max_tokens=2))
    for _ in range(5):
        step(run)
        assert any(x.request.request_id == "d" for x in run.steps[-1].scheduled)
    while sched.has_unfinished_requests():
        step(run)
    assert_whole(sched)


def test_stop_conditions() -> None:
    def sampler(ctx: list[int]) -> int:
        return EOS if len(ctx) == 5 else 40 if len(ctx) == 6 else 41

    sched = make(max_model_len=9)
    run = Run(sched)
    for r in [
        request("eos", [10, 11, 12, 13, 14], max_tokens=8),
        request("ignore", [10, 11, 12, 13, 14], max_tokens=3, ignore_eos=True),
        request("stoptok", [10, 11, 12, 13, 14, 15], max_tokens=8, stop_token_ids=[40]),
        request("len", [10, 11, 12], max_tokens=2),
        request("mml", [10, 11, 12, 13, 14, 15, 16], max_tokens=8),
    ]:
        sched.add_request(r)
    reqs = dict(sched.requests)
    while sched.has_unfinished_requests():
        step(run, sampler)
    assert run.finish == {
        "eos": "stop",
        "ignore": "length",
        "stoptok": "stop",
        "len": "length",
        "mml": "length",
    }
    assert reqs["eos"].output_token_ids == [EOS] and reqs["eos"].stop_reason is None
    assert reqs["ignore"].output_token_ids == [EOS, 40, 41]
    assert (
        reqs["stoptok"].stop_reason == 40
        and reqs["stoptok"].status == RequestStatus.FINISHED_STOPPED
    )
    assert reqs["mml"].num_tokens == 9  # capped by max_model_len
    assert_whole(sched)


# ---- bad input, abort, finish ----------------------------------------------------------------


def test_add_request_errors_disturb_nothing() -> None:
    sched = make(num_blocks=4, max_model_len=100)
    sched.add_request(request("ok", [5, 6, 7]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(request("ok", [5]))
    with pytest.raises(CacheCapacityError):  # 60 + 20 tokens > 4 blocks of 16
        sched.add_request(request("big", list(range(3, 63)), max_tokens=20))
    sched.add_request(request("fits", list(range(3, 63)), max_tokens=5))  # 64 KV tokens: 4 blocks
    run = drive(sched)
    assert set(run.outputs) == {"ok", "fits"}


def test_abort_frees_everything() -> None:
    sched = make(max_num_batched_tokens=32, max_num_seqs=2)
    run = Run(sched)
    reqs = [request(f"r{i}", list(range(3, 60)), max_tokens=50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(4):
        step(run)
    assert sched.num_running == 2 and sched.num_waiting == 2
    with pytest.raises(ValueError, match="unknown"):
        sched.abort_requests(["r0", "nope"])
    assert reqs[0].status == RequestStatus.RUNNING  # nothing aborted
    out = sched.schedule()  # abort between schedule() and update_from_output()
    aborted = sched.abort_requests(["r0", "r3"])
    assert [r.finish_reason for r in aborted] == ["abort", "abort"]
    sched.update_from_output(out, {x.request.request_id: 7 for x in out.scheduled if x.samples})
    sched.check_invariants()
    assert sched.schedule().finished_ids == ["r0", "r3"]
    sched.abort_requests(["r1", "r2"])
    assert_whole(sched)
    assert sched.stats()["kv_blocks_cached_free"] > 0  # computed blocks stay cached


def test_finish_requests_for_stop_strings() -> None:
    sched = make()
    run = Run(sched)
    r = request("a", [5, 6, 7], max_tokens=10)
    sched.add_request(r)
    step(run)
    step(run)
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED, stop_reason="###") == [r]
    assert r.finish_reason == "stop" and r.stop_reason == "###"
    assert sched.finish_requests(["a", "gone"], RequestStatus.FINISHED_STOPPED) == []
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    assert_whole(sched)


# ---- preemption ----------------------------------------------------------------------------


def test_preemption_resumes_and_matches_reference() -> None:
    ps = prompts(12, seed=1, lo=20, hi=40)
    mk = [30 + i % 5 for i in range(12)]
    for caching in (True, False):
        sched = make(num_blocks=12, max_num_batched_tokens=64, enable_prefix_caching=caching)
        run = drive(sched, [request(f"r{i}", p, max_tokens=mk[i]) for i, p in enumerate(ps)])
        assert sched.num_preemptions > 0
        assert any(o.preempted for o in run.steps)
        for i, p in enumerate(ps):
            assert run.outputs[f"r{i}"] == reference(p, mk[i])


def test_preempts_most_recently_admitted() -> None:
    sched = make(num_blocks=6, max_num_batched_tokens=256)
    run = Run(sched)
    a = request("a", list(range(3, 35)), max_tokens=40)  # 2 blocks, grows
    b = request("b", list(range(100, 140)), max_tokens=40)  # 3 blocks, grows
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished_requests():
        step(run)
        preempted += run.steps[-1].preempted
    assert preempted and set(preempted) == {"b"}
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert run.outputs["b"] == reference(list(range(100, 140)), 40)
    assert_whole(sched)


def test_no_endless_preemption_under_heavy_pressure() -> None:
    ps = prompts(40, seed=2, lo=10, hi=60)
    sched = make(num_blocks=8, max_num_batched_tokens=48, max_num_seqs=16, max_model_len=128)
    reqs = [request(f"r{i}", p, max_tokens=64) for i, p in enumerate(ps)]
    reqs = [r for r in reqs if sched.kv.blocks_needed(min(r.num_prompt_tokens + 63, 127)) <= 8]
    run = drive(sched, reqs, max_steps=20_000)
    assert len(run.outputs) == len(reqs)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, len(r.output_token_ids))


# ---- static vs continuous ------------------------------------------------------------------


def test_static_admits_only_when_drained() -> None:
    def admissions(mode: str) -> list[tuple[int, int]]:
        sched = make(max_num_seqs=4, scheduling=mode)
        arrivals = {
            0: [request(f"a{i}", [5, 6, 7 + i], max_tokens=3 + 4 * i) for i in range(4)],
            2: [request(f"b{i}", [8, 9, 10 + i], max_tokens=3) for i in range(4)],
        }
        run = drive(sched, arrivals=arrivals)
        # (step, running count before admission) for each first schedule of a b-request
        firsts = {}
        for n, o in enumerate(run.steps):
            for x in o.scheduled:
                firsts.setdefault(x.request.request_id, n)
        return sorted(firsts[f"b{i}"] for i in range(4)), firsts

    static, sf = admissions("static")
    cont, cf = admissions("continuous")
    last_a_static = max(sf[f"a{i}"] for i in range(4))
    assert min(static) > last_a_static
    # static: b's start only after all a's finished (a3 runs 15 tokens)
    assert min(static) >= 15
    assert min(cont) <= 5


# ---- prefix caching through the scheduler ---------------------------------------------------


def test_in_flight_dedup_16_requests_share_prefix_once() -> None:
    prefix = list(range(100, 164))  # 64 tokens = 4 blocks, uncached
    suffixes = prompts(16, seed=3, lo=5, hi=12)
    reqs = [request(f"r{i}", prefix + s, max_tokens=4) for i, s in enumerate(suffixes)]
    sched = make(max_num_batched_tokens=256, max_num_seqs=32)
    run = drive(sched, reqs)
    assert run.prefill_tokens == 64 + sum(len(s) for s in suffixes)
    assert sorted(r.num_cached_tokens for r in reqs) == [0] + [64] * 15
    for i, s in enumerate(suffixes):
        assert run.outputs[f"r{i}"] == reference(prefix + s, 4)
    st = sched.stats()
    # the shared prefix is stored once: 4 prefix blocks + 1 block per request (suffix + output)
    assert st["kv_blocks_used_peak"] <= 4 + 16 * 1
    assert st["prefix_cache_hits"] == 15 * 64
    assert st["prefix_cache_queries"] == sum(r.num_prompt_tokens for r in reqs)


def test_in_flight_dedup_with_chunked_owner_and_others_behind() -> None:
    prefix = list(range(100, 164))
    sched = make(max_num_batched_tokens=24, max_num_seqs=32)
    reqs = [
        request("o", prefix + [1, 2], max_tokens=3),
        request("w", prefix + [4, 5], max_tokens=3),
        request("x", list(range(500, 520)), max_tokens=3),
    ]
    run = drive(sched, reqs)
    assert reqs[1].num_cached_tokens == 64
    assert run.prefill_tokens == 66 + 2 + 20
    first = {}
    for n, o in enumerate(run.steps):
        for s in o.scheduled:
            first.setdefault(s.request.request_id, n)
    assert first["x"] < first["w"]  # x went ahead while w waited for the owner's blocks


def test_preempted_owner_releases_pending_marks() -> None:
    prefix = list(range(100, 164))
    sched = make(max_num_batched_tokens=16, max_num_seqs=8)
    run = Run(sched)
    owner, waiter = (
        request("o", prefix + [1], max_tokens=2),
        request("w", prefix + [2], max_tokens=2),
    )
    sched.add_request(owner)
    sched.add_request(waiter)
    step(run)
    assert [x.request.request_id for x in run.steps[-1].scheduled] == ["o"]
    sched.abort_requests(["o"])
    step(run)
    assert run.steps[-1].scheduled[0].request is waiter
    assert waiter.num_cached_tokens == 16  # the owner's finished first block
    while sched.has_unfinished_requests():
        step(run)
    assert_whole(sched)


@pytest.mark.parametrize(
    "scenario", ["k_blocks", "k_plus_partial", "repeat", "eviction", "chunked"]
)
def test_prefix_cache_on_off_identical(scenario: str) -> None:
    prefix = list(range(200, 264))
    rng = random.Random(4)
    if scenario == "k_blocks":
        ps = [prefix] * 3 + [prefix + [rng.randrange(3, 999) for _ in range(16)] for _ in range(3)]
    elif scenario == "k_plus_partial":
        ps = [prefix + [rng.randrange(3, 999) for _ in range(5)] for _ in range(6)]
    elif scenario == "repeat":
        ps = [prompts(1, seed=5)[0]] * 6
    else:
        ps = [prefix + p for p in prompts(8, seed=6, lo=1, hi=40)]
    kw = (
        dict(num_blocks=14, max_num_batched_tokens=24)
        if scenario in ("eviction", "chunked")
        else {}
    )
    outs = []
    for caching in (True, False):
        sched = make(enable_prefix_caching=caching, **kw)
        arrivals = {i * 3: [request(f"r{i}", p, max_tokens=6)] for i, p in enumerate(ps)}
        run = drive(sched, arrivals=arrivals)
        outs.append(run.outputs)
        if caching and scenario in ("k_blocks", "repeat", "k_plus_partial"):
            assert sched.stats()["prefix_cache_hits"] > 0
    assert outs[0] == outs[1]
    assert outs[0] == {f"r{i}": reference(p, 6) for i, p in enumerate(ps)}


def test_salted_requests_share_nothing() -> None:
    prefix = list(range(300, 364))
    sched = make()
    run = Run(sched)
    a = request("a", prefix + [1], salt="tenant-a")
    sched.add_request(a)
    while sched.has_unfinished_requests():
        step(run)
    b, c = request("b", prefix + [2], salt="tenant-b"), request("c", prefix + [3], salt="tenant-a")
    d = request("d", prefix + [4])
    for r in (b, c, d):
        sched.add_request(r)
    while sched.has_unfinished_requests():
        step(run)
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (0, 64, 0)
    assert_whole(sched)


def test_collision_hook_through_scheduler() -> None:
    sched = make(hash_fn=lambda data: 42)
    ps = prompts(6, seed=7, lo=20, hi=70)
    run = drive(sched, arrivals={i * 4: [request(f"r{i}", p)] for i, p in enumerate(ps)})
    assert sched.stats()["prefix_cache_hits"] == 0
    assert run.outputs == {f"r{i}": reference(p, 8) for i, p in enumerate(ps)}


def test_pins_expire_in_schedule_and_survive_pressure(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = make(num_blocks=10, max_num_batched_tokens=64)
    run = Run(sched)
    sp = list(range(400, 432))  # 2 blocks
    sched.add_request(request("warm", sp + [1], max_tokens=1))
    while sched.has_unfinished_requests():
        step(run)
    pin = sched.kv.pin(sp, ttl_s=60.0)
    assert pin.num_tokens == 32
    fillers = [
        request(f"f{i}", list(range(600 + 40 * i, 640 + 40 * i)), max_tokens=10) for i in range(4)
    ]
    drive(sched, fillers, pinned_ok=True)  # 8 free blocks, fillers need 4 each: evictions
    assert sched.stats()["prefix_cache_evictions"] > 0
    r = request("hit", sp + [9])
    drive(sched, [r], pinned_ok=True)
    assert r.num_cached_tokens == 32
    later = time.monotonic() + 61.0
    monkeypatch.setattr(pins_module.time, "monotonic", lambda: later)
    sched.schedule()  # expire_pins runs every step
    assert sched.stats()["pinned_blocks"] == 0
    assert_whole(sched)


def test_pins_yield_to_a_lone_request() -> None:
    sched = make(num_blocks=8, max_num_batched_tokens=64)
    sp = list(range(700, 764))  # 4 blocks = max_pinned_fraction 0.5 of 8
    drive(sched, [request("warm", sp + [1], max_tokens=1)])
    pin = sched.kv.pin(sp)
    assert pin.num_tokens == 64 and pin.expires_at is None
    big = request("big", list(range(800, 900)), max_tokens=20)  # 119 KV tokens: all 8 blocks
    run = drive(sched, [big])
    assert run.outputs["big"] == reference(list(range(800, 900)), 20)
    assert sched.kv.num_pins_revoked == 1 and sched.stats()["pinned_blocks"] == 0
    with pytest.raises(KeyError):
        sched.kv.unpin(pin.id)


def test_request_counts() -> None:
    # a Request checks nothing: InputProcessor.prepare validated what it is built from
    # (tests/engine/test_engine_inputs.py, test_engine_request.py)
    r = Request("a", (5, 6), None, eos_token_ids={2}, max_tokens=3)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_cached_tokens, r.finish_reason) == (
        2,
        2,
        0,
        None,
    )
    r.append_output_token(9)
    assert r.all_token_ids == [5, 6, 9] and r.output_token_ids == [9] and r.num_tokens == 3
    assert not r.is_finished() and RequestStatus.FINISHED_ABORTED.is_finished()
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH)
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"


@pytest.mark.parametrize("seed", range(6))
def test_randomized_stress_keeps_invariants(seed: int) -> None:
    """Random arrivals, aborts, stop-string finishes, pins and a tight cache: invariants after
    every step, every request accounted for, outputs of the rest equal the reference."""
    rng = random.Random(seed)
    sched = make(
        num_blocks=rng.choice([10, 16, 40]),
        max_num_batched_tokens=rng.choice([8, 32, 128]),
        max_num_seqs=rng.choice([2, 6, 32]),
        max_model_len=160,
        enable_prefix_caching=rng.random() < 0.8,
        scheduling=rng.choice(["continuous", "static"]),
    )
    shared = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([16, 24, 40]))] for _ in range(3)]
    run = Run(sched)
    live: dict[str, Request] = {}
    ended: dict[str, Request] = {}
    pins: list[str] = []
    for n in range(5000):
        if n < 300 and rng.random() < 0.4:
            p = rng.choice(shared) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]
            r = request(
                f"r{n}", p, max_tokens=rng.randrange(1, 24), salt=rng.choice([None, None, "t"])
            )
            try:
                sched.add_request(r)
                live[r.request_id] = r
            except CacheCapacityError:
                pass
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            sched.abort_requests([rid])
            ended[rid] = live.pop(rid)
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            if live[rid].output_token_ids:
                sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED, stop_reason="stop")
                ended[rid] = live.pop(rid)
        if sched.kv.enable_prefix_caching and rng.random() < 0.05:
            try:
                pins.append(
                    sched.kv.pin(rng.choice(shared), ttl_s=rng.choice([None, 1e-3, 60.0])).id
                )
            except ValueError:
                pass
        if pins and rng.random() < 0.05:
            try:
                sched.kv.unpin(pins.pop(rng.randrange(len(pins))))
            except KeyError:
                pass  # expired or revoked already
        for r in step(run):
            ended[r.request_id] = live.pop(r.request_id)
        if n >= 300 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests() and not live, (
        n,
        sched.stats(),
        sched.running,
        list(sched.waiting),
        sched.kv.pins,
    )
    for p in pins:
        try:
            sched.kv.unpin(p)
        except KeyError:
            pass
    assert_whole(sched)
    for r in ended.values():
        assert r.is_finished()
        assert r.output_token_ids == reference(r.prompt_token_ids, len(r.output_token_ids))
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens >= 160


def test_static_mode_admits_shared_prefix_batch_together() -> None:
    prefix = list(range(100, 164))
    reqs = [request(f"r{i}", prefix + [i + 3], max_tokens=3) for i in range(4)]
    run = drive(make(scheduling="static", max_num_batched_tokens=512), reqs)
    assert len(run.steps[0].scheduled) == 4  # one static batch, no waiting for the owner
    assert run.outputs == {f"r{i}": reference(prefix + [i + 3], 3) for i in range(4)}


def test_missing_sampled_token_changes_nothing() -> None:
    sched = make()
    run = Run(sched)
    a, b = request("a", [5, 6, 7]), request("b", [8, 9])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {"a": 11})
    assert (a.num_computed_tokens, b.num_computed_tokens, a.output_token_ids) == (0, 0, [])
    sched.update_from_output(out, {"a": 11, "b": 12})
    assert (a.output_token_ids, b.output_token_ids) == ([11], [12])
    sched.abort_requests(["a", "b"])
    assert_whole(sched)
    assert run.outputs == {}


def test_load_stats_are_stats_load_keys_at_every_step() -> None:
    """``load_stats()`` (what a first-token prediction reads) holds the same values as
    ``stats()`` under its keys, whatever the queues hold, and leaves the per-tenant table out."""
    sched = make(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=40)
    reqs = [request(f"r{i}", p, max_tokens=6) for i, p in enumerate(prompts(7, seed=3))]
    arrivals = {0: reqs[:4], 2: reqs[4:6], 5: reqs[6:]}
    run = Run(sched)
    n = 0
    while sched.has_unfinished_requests() or n <= 5:
        for r in arrivals.get(n, []):
            sched.add_request(r)
        load, full = sched.load_stats(), sched.stats()
        assert load == {k: full[k] for k in load}
        assert "tenants" not in load and "kv_blocks_used" not in load
        assert {"num_running", "num_waiting", "queued_prefill_tokens", "running_decodes"} <= set(
            load
        )
        assert sched.predict_ttft(9) == estimate_ttft(full, 3, 40, 9)
        step(run)
        n += 1
        assert n < 1000
