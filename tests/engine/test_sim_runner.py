"""The simulated runner (``runner="sim"``): the real scheduler, block pool, prefix cache and KV
events over modelled time; the same lifecycle checks as the real engine."""

from __future__ import annotations

import contextlib
import json

import pytest
from conftest import assert_pool_whole
from prefixgate.engine import kv_cache_manager as kv_module
from prefixgate.engine import llm_engine as llm_engine_module
from prefixgate.engine import request as request_module
from prefixgate.engine import scheduler as scheduler_module
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.cost_model import PROFILES, CostProfile, StepShape, load_profile
from prefixgate.engine.kv_events import KVEventCollector
from prefixgate.engine.llm_engine import LLMEngine
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.sim_runner import VirtualClock

PROMPT = list(range(10, 74))  # 64 tokens: 4 full blocks of 16


def _engine(clock=None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(runner="sim", **kw), sim_clock=clock or VirtualClock())


@contextlib.contextmanager
def _on_clock(clock: VirtualClock):
    """The engine modules' ``time`` read ``clock`` (as ``prefixgate sim``'s ``virtual_time``)."""
    mods = [scheduler_module, request_module, kv_module, llm_engine_module]
    saved = [m.time for m in mods]
    for m in mods:
        m.time = clock
    try:
        yield
    finally:
        for m, t in zip(mods, saved, strict=True):
            m.time = t


def _run(eng: LLMEngine, limit: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.delta_token_ids)
    return out


def test_step_time_is_the_profiles_on_the_virtual_clock():
    clock = VirtualClock()
    eng = _engine(clock)
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=3))
    _run(eng)
    p = PROFILES["h100-llama3-8b"]
    prefill = p.step_s(StepShape(64, 0, 64))
    decodes = p.step_s(StepShape(0, 1, 65)) + p.step_s(StepShape(0, 1, 66))
    assert clock.t == pytest.approx(prefill + decodes)
    assert eng.runner.busy_s == pytest.approx(clock.t)
    assert_pool_whole(eng)


def test_a_prefill_over_a_cached_prefix_is_a_continued_row(tmp_path):
    """The second prompt's prefill continues the first one's cached blocks: its step is
    ``StepShape(16, 0, 80, 1)`` and costs ``e`` more than the same row fresh would."""
    import json

    profile = CostProfile("p", 1e-3, 1e-5, 2e-5, 1e-8, num_kv_blocks=64, e_s_per_continued_row=5e-4)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    clock = VirtualClock()
    eng = _engine(clock, sim_profile=str(path))
    eng.add_request("a", PROMPT + [5], SamplingParams(max_tokens=1))
    _run(eng)
    eng.add_request("b", PROMPT + list(range(100, 116)), SamplingParams(max_tokens=1))
    before = clock.t
    eng.step()
    assert eng.runner.last_shape == StepShape(16, 0, 80, 1)
    assert clock.t - before == pytest.approx(1e-3 + 16e-5 + 80e-8 + 5e-4)
    assert profile.step_s(StepShape(16, 0, 80, 1)) - profile.step_s(
        StepShape(16, 0, 80)
    ) == pytest.approx(5e-4)
    _run(eng)
    assert_pool_whole(eng)


def test_a_step_after_an_idle_spell_pays_the_profiles_wake_up(tmp_path):
    """``wake_s * (1 - exp(-idle / tau))`` on the first step after ``idle`` seconds without
    one (the whole of it on the engine's first step), nothing on a step back to back; a
    decode stretch at once (``plan_decodes``) charges it on its first step too."""
    import json
    import math

    from prefixgate.engine.sim_runner import apply_decodes, plan_decodes

    profile = CostProfile("w", 1e-3, 1e-5, 2e-5, 0.0, num_kv_blocks=64, wake_s=4e-3, wake_tau_s=0.1)
    assert profile.wake_up_s(0.0) == 0.0 and profile.wake_up_s(-1.0) == 0.0
    assert profile.wake_up_s(math.inf) == pytest.approx(4e-3)
    assert profile.wake_up_s(0.1) == pytest.approx(4e-3 * (1 - math.exp(-1)))
    assert PROFILES["h100-llama3-8b"].wake_up_s(math.inf) == 0.0  # built-in: none
    with pytest.raises(ValueError, match="wake_tau_s"):
        CostProfile("w", 1e-3, 1e-5, 2e-5, 0.0, wake_tau_s=0.0)
    with pytest.raises(ValueError, match="wake_s"):
        CostProfile("w", 1e-3, 1e-5, 2e-5, 0.0, wake_s=-1e-3)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(profile.to_json()))
    assert load_profile(str(path)) == profile
    clock = VirtualClock()
    eng = _engine(clock, sim_profile=str(path))
    eng.output_processor.detokenizer_cls = lambda *_: None  # token ids only, as the fleet
    sp = SamplingParams(max_tokens=2)
    eng.add_request("a", PROMPT, sp)
    eng.step()  # the engine's first step: the whole wake-up
    assert clock.t == pytest.approx(profile.step_s(StepShape(64, 0, 64)) + 4e-3)
    before = clock.t
    eng.step()  # back to back
    assert clock.t - before == pytest.approx(profile.step_s(StepShape(0, 1, 65)))
    clock.t += 0.05  # idle 50 ms
    eng.add_request("b", list(range(100, 116)), sp)
    before = clock.t
    eng.step()
    assert clock.t - before == pytest.approx(
        profile.step_s(StepShape(16, 0, 16)) + 4e-3 * (1 - math.exp(-0.5))
    )
    _run(eng)
    clock.t += 1.0  # idle a second, then a stretch of decodes planned at once
    eng.add_request("c", list(range(120, 136)), SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()  # its prefill (and first token): pays the wake-up
    start = clock.t
    ends = plan_decodes(eng, min_steps=2)
    assert ends is not None
    assert ends[0] - start == pytest.approx(profile.step_s(StepShape(0, 1, 17)))  # not idle
    clock.t += 0.2  # idle again before the stretch runs: its first step pays
    start = clock.t
    ends = plan_decodes(eng, min_steps=2)
    assert ends is not None
    wake = 4e-3 * (1 - math.exp(-2.0))
    assert ends[0] - start == pytest.approx(profile.step_s(StepShape(0, 1, 17)) + wake)
    assert ends[1] - ends[0] == pytest.approx(profile.step_s(StepShape(0, 1, 18)))
    apply_decodes(eng, start, ends)
    assert eng.runner.last_end == pytest.approx(ends[-1])
    _run(eng)
    assert_pool_whole(eng)


def test_outputs_honour_max_tokens_and_are_deterministic_whatever_the_batch():
    a = _engine()
    a.add_request("x", PROMPT, SamplingParams(max_tokens=7))
    alone = _run(a)["x"]
    b = _engine()
    for i in range(5):
        b.add_request(f"y{i}", PROMPT[i:], SamplingParams(max_tokens=9))
    b.add_request("x", PROMPT, SamplingParams(max_tokens=7))
    together = _run(b)
    assert len(alone) == 7 and together["x"] == alone
    assert all(len(t) == 9 for k, t in together.items() if k != "x")
    assert_pool_whole(a)
    assert_pool_whole(b)


def test_eos_probability_ends_requests_early_and_min_tokens_holds():
    eng = _engine(sim_eos_probability=0.3, num_kv_blocks=256)
    for i in range(20):
        eng.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=50, min_tokens=3))
    out = _run(eng)
    lengths = [len(t) for t in out.values()]
    assert all(n >= 3 for n in lengths) and min(lengths) < 50 and max(lengths) <= 50
    assert_pool_whole(eng)
    never = _engine(sim_eos_probability=1.0)
    never.add_request("i", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(_run(never)["i"]) == 5
    assert_pool_whole(never)


def test_prefix_cache_hits_on_a_repeated_prompt():
    eng = _engine()
    eng.add_request("first", PROMPT + [5], SamplingParams(max_tokens=2))
    _run(eng)
    eng.add_request("second", PROMPT + [6], SamplingParams(max_tokens=2))
    eng.step()
    req_hits = eng.stats()["prefix_cache_hits"]
    _run(eng)
    assert req_hits == 64
    assert_pool_whole(eng)


def test_abort_frees_the_blocks():
    eng = _engine()
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=100))
    eng.add_request("b", PROMPT[1:], SamplingParams(max_tokens=100))
    for _ in range(3):
        eng.step()
    assert eng.abort_request("a").finish_reason == "abort"
    _run(eng)
    assert_pool_whole(eng)


def test_preemption_under_a_small_kv_budget_finishes_everyone():
    eng = _engine(num_kv_blocks=12)
    for i in range(4):
        eng.add_request(f"p{i}", [i + 1] + PROMPT[:40], SamplingParams(max_tokens=60))
    out = _run(eng)
    assert eng.stats()["num_preemptions"] > 0
    assert sorted(out) == [f"p{i}" for i in range(4)]
    assert all(len(t) == 60 for t in out.values())
    assert_pool_whole(eng)


def test_kv_events_are_published_from_the_sim_engine():
    eng = _engine()
    collector = KVEventCollector(16, 100, first_seq=0)
    eng.kv_cache_manager.pool.events = collector
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=2))
    _run(eng)
    collector.flush()
    stored = []
    while not collector.queue.empty():
        item = collector.queue.get_nowait()
        for kind, entries in getattr(item, "events", []):
            if kind == "stored":
                stored.extend(entries)
    assert len(stored) == 4  # the prompt's 4 full blocks
    assert [t for c in stored for t in c.token_ids] == PROMPT
    assert_pool_whole(eng)


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 2),
        ("logit_bias", {5: 1.0}),
        ("allowed_token_ids", [5, 6]),
    ],
)
def test_fields_the_sim_cannot_honour_are_refused_by_name(field, value):
    eng = _engine()
    with pytest.raises(ValueError, match=field) as info:
        eng.add_request("a", PROMPT, SamplingParams(**{field: value}))
    assert_pool_whole(eng)
    # the gateway's 400 names the field (a new user's logprobs=true came back with param null)
    from prefixgate.gateway.local.exchange import engine_error

    error = engine_error(info.value)
    assert (error.status, error.param) == (400, field)


def test_config_checks_the_sim_options(tmp_path):
    with pytest.raises(ValueError, match="sim_profile"):
        EngineConfig(runner="sim", sim_profile="no-such-gpu")
    with pytest.raises(ValueError, match="sim_eos_probability"):
        EngineConfig(runner="sim", sim_eos_probability=1.5)
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(runner="sim", speculative_method="ngram")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(CostProfile("here", 1e-3, 1e-5, 2e-5, 1e-8).to_json()))
    assert load_profile(str(path)).a_s == 1e-3
    path.write_text(json.dumps({"name": "bad", "a_s": -1}))
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(str(path))


def test_sim_fit_recovers_known_coefficients_despite_spikes():
    import numpy as np
    from prefixgate.engine.sim_fit import fit

    rng = np.random.default_rng(0)
    true = np.array([2e-3, 1e-5, 3e-5, 4e-7, 8e-4])
    rows = []
    for _ in range(400):
        p, d = int(rng.integers(0, 500)), int(rng.integers(0, 32))
        cont = int(rng.integers(0, 4)) if p else 0
        ctx = p + d * int(rng.integers(1, 128)) + cont * int(rng.integers(16, 64))
        y = true @ [1, p, d, ctx, cont]
        if rng.random() < 0.1:  # a descheduled step
            y *= 3
        rows.append((p, d, ctx, cont, y))
    coef, quality = fit(rows)
    assert np.allclose(coef, true, rtol=0.05)
    assert quality["median_rel_error"] < 0.01


def test_sim_fit_times_fresh_and_continued_prefills_and_decodes():
    # collect() on the built-in preset: every kind of row the model has a term for is timed,
    # and the engine is left empty and whole
    from prefixgate.engine.sim_fit import collect

    eng = LLMEngine(EngineConfig(threads=1, device="cpu"))
    rows = collect(eng, repeats=1)
    assert all(len(r) == 5 and r[4] > 0 for r in rows)
    assert any(p and not c for p, _, _, c, _ in rows)  # fresh prefill rows
    assert any(c for _, _, _, c, _ in rows)  # continued rows
    assert any(d and not p for p, d, _, _, _ in rows)  # decode steps
    assert not eng.has_unfinished_requests()
    assert_pool_whole(eng)


def test_sim_fit_recovers_a_known_wake_up_and_times_first_steps_after_idle():
    import math

    import numpy as np
    from prefixgate.engine.sim_fit import WAKE_GAPS_S, collect_wake, fit_wake

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(12):
        for gap in WAKE_GAPS_S:
            y = 2.5e-3 + 3e-3 * -math.expm1(-gap / 0.05) + float(rng.normal(0, 5e-5))
            rows.append((gap, y * (3 if rng.random() < 0.05 else 1)))  # a descheduled step
    wake, tau = fit_wake(rows)
    assert wake == pytest.approx(3e-3, rel=0.1) and tau == 0.05
    assert fit_wake([(0.0, 1e-3)]) == (0.0, 0.1)  # nothing after idle: no term
    assert fit_wake([(0.1, 1e-3), (0.0, 2e-3)])[0] == 0.0  # faster after idle: none, not < 0
    # collect_wake on the built-in preset (sleeping replaced): one row per gap per repeat,
    # the engine left empty and whole
    slept: list[float] = []
    eng = LLMEngine(EngineConfig(threads=1, device="cpu"))
    got = collect_wake(eng, repeats=2, sleep=slept.append)
    assert [g for g, _ in got] == list(WAKE_GAPS_S) * 2 and all(s > 0 for _, s in got)
    assert slept == list(WAKE_GAPS_S) * 3  # the warm-up pass too
    assert not eng.has_unfinished_requests()
    assert_pool_whole(eng)


def test_a_decode_stretch_at_once_leaves_the_state_k_steps_leave():
    # plan_decodes / apply_decodes (prefixgate sim's pure-decode stretches) against k calls
    # of step(): the same tokens, computed counts, blocks used, cached block keys, counters
    # and modelled time
    from prefixgate.engine.sim_runner import apply_decodes, plan_decodes

    def started() -> tuple[LLMEngine, VirtualClock]:
        clock = VirtualClock()
        eng = _engine(clock, scheduling_policy="fair")
        eng.output_processor.detokenizer_cls = lambda *_: None  # token ids only, as the fleet
        with _on_clock(clock):
            for i in range(4):  # prompts of 64..61 tokens: blocks fill at different steps
                sp = SamplingParams(max_tokens=40 - 10 * (i % 2))  # r1, r3 end in the last step
                eng.add_request(f"r{i}", PROMPT[i:], sp, tenant=f"t{i % 2}")
            s = eng.scheduler
            while s.waiting or any(r.num_output_tokens == 0 for r in s.running):
                eng.step()
        return eng, clock

    a, clock_a = started()
    b, clock_b = started()
    start = clock_a.t
    assert plan_decodes(a, until=start) is None  # no step starts before start
    ends = plan_decodes(a)
    assert ends is not None and len(ends) == 30 - 1 - 1  # r1's and r3's last steps after it
    assert plan_decodes(a, max_steps=1, min_steps=1) == ends[:1]
    ends = plan_decodes(a, through_finish=True)
    assert ends is not None and len(ends) == 30 - 1  # up to r1's and r3's last tokens
    with _on_clock(clock_a):
        outs = apply_decodes(a, start, ends)
    with _on_clock(clock_b):
        outs_b = [o for _ in ends for o in b.step()]

    def state(eng: LLMEngine) -> tuple:
        s, kv = eng.scheduler, eng.kv_cache_manager
        return (
            {r.request_id: (list(r.output_token_ids), r.num_computed_tokens) for r in s.running},
            {rid: len(st.blocks) for rid, st in kv._reqs.items()},
            kv.pool.num_free,
            {rid: len(st.chain_uids) for rid, st in kv._reqs.items()},  # blocks cached
            s.tokens_decoded,
            s._steps_scheduled,
            {t: (v.served_output_tokens, v.counter) for t, v in s.policy.tenants.items()},
            sorted(s.requests),
            s._finished_ids,
            s.load.mean_output_tokens,
            list(s.load._holds),
            (s.load.decode_tokens_per_s, s.load.finished_per_s),
        )

    assert state(a) == state(b)
    assert [r.request_id for r in a.scheduler.running] == ["r0", "r2"]
    finished = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert finished == {o.request_id: o.finish_reason for o in outs_b if o.finish_reason}
    assert finished == {"r1": "length", "r3": "length"}
    assert clock_a.t == pytest.approx(clock_b.t, rel=1e-12)
    assert a.runner.busy_s == pytest.approx(b.runner.busy_s, rel=1e-12)
    assert {o.request_id: len(o.delta_token_ids) for o in outs} == {
        f"r{i}": len(ends) for i in range(4)
    }
    assert [o.metrics for o in outs if o.finish_reason] == [
        o.metrics for o in outs_b if o.finish_reason
    ]
    with _on_clock(clock_a):
        rest_a = _run(a)
    with _on_clock(clock_b):
        rest_b = _run(b)
    assert rest_a == rest_b  # the rest, step by step, the same
    assert_pool_whole(a)
    assert_pool_whole(b)


def test_tokens_at_once_are_the_tokens_one_by_one():
    # SimRunner.tokens (a stretch's k tokens, the id hashed once) against token() per position:
    # plain, with stop ids and EOS ids that the draw hits (vocabulary of 7), with EOS possible
    from types import SimpleNamespace

    from prefixgate.engine.cost_model import PROFILES
    from prefixgate.engine.sim_runner import SimRunner

    for vocab, eos_p, eos, stop, ignore in [
        (32000, 0.0, [2], [], True),
        (7, 0.0, [2], [3, 5], False),
        (7, 0.3, [2], [4], False),
        (7, 0.3, [2], [], True),
        (7, 0.0, [], [], False),
    ]:
        runner = SimRunner(PROFILES["h100-llama3-8b"], vocab, seed=5, eos_probability=eos_p)
        sp = SamplingParams(max_tokens=100, stop_token_ids=stop, ignore_eos=ignore, min_tokens=3)
        req = SimpleNamespace(request_id="s17-2", sampling_params=sp, eos_token_ids=eos)
        for pos, k in [(0, 1), (0, 40), (13, 17)]:
            assert runner.tokens(req, pos, k) == [runner.token(req, p) for p in range(pos, pos + k)]


def test_decode_steps_at_once_fold_as_steps_one_by_one():
    # LoadModel.on_decode_steps against on_step per step: the same state, bit for bit
    from prefixgate.engine.load_model import LoadModel

    a, b = LoadModel(), LoadModel()
    for m in (a, b):
        m.on_step(0.05, 1.0, 900, 3, 0, True)  # a prefill step, then an idle gap
        m.on_step(0.01, 1.2, 0, 3, 1, False)
    ends = [1.5 + 0.0071 * j + 0.00003 * j * j for j in range(1, 200)]
    ends.insert(50, ends[49])  # a step of no time
    a.on_decode_steps(1.5, ends, 7)
    before = 1.5
    for end in ends:
        b.on_step(end - before, end, 0, 7, 0, True)
        before = end

    def state(m: LoadModel) -> tuple:
        return (
            m.decode_tokens_per_s,
            m.prefill_tokens_per_s,
            m.finished_per_s,
            m._busy_since,
            list(m._finish_rate._steps),
            m._finish_rate._seconds,
            list(m._step_time._steps),
            m._step_time._seconds,
            list(m._step_time._recent),
            m._step_time._recent_s,
        )

    assert state(a) == state(b)
