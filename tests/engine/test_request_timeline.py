"""A request's first-token timeline in ``Request.metrics``: the steps it waited, the size of
the step that first scheduled it, its own chunk of it, and that step's time."""

from __future__ import annotations

from conftest import assert_pool_whole
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.request import Request
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler


def _req(rid: str, n: int, max_tokens: int) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [5 + i for i in range(n)], sp, max_tokens=max_tokens)


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})


def test_metrics_count_the_steps_waited_and_the_first_step():
    config = EngineConfig(block_size=16, max_num_seqs=1, max_num_batched_tokens=64)
    sched = Scheduler(config, KVCacheManager.from_config(config, 64), 1024)
    first, second = _req("a", 40, 3), _req("b", 100, 2)
    sched.add_request(first)
    sched.add_request(second)
    assert "steps_waited" not in second.metrics  # not admitted yet
    for _ in range(3):  # "a": one prefill step, then two decodes; "b" waits for the seat
        _step(sched)
    assert first.metrics["steps_waited"] == 0
    assert first.metrics["first_step_tokens"] == 40 == first.metrics["first_chunk_tokens"]
    assert first.metrics["first_step_s"] >= 0.0
    _step(sched)  # "b" admitted: its first chunk is the budget's 64 tokens
    m = second.metrics
    assert m["steps_waited"] == 3
    assert m["first_step_tokens"] == 64 == m["first_chunk_tokens"]
    assert m["arrival"] <= m["first_scheduled"] and m["first_step_s"] >= 0.0
    while sched.has_unfinished_requests():
        _step(sched)
    assert second.metrics["steps_waited"] == 3  # later steps change nothing
    assert second.metrics["first_step_tokens"] == 64
    assert_pool_whole(sched)
