"""The thread governor: fewer threads while other processes keep the engine's CPUs busy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.thread_governor import (
    BUSY_FIELDS,
    ENV_SWITCH,
    CpuShare,
    ThreadGovernor,
    asked_threads,
    busy_fields,
    make_governor,
    read_cpu_busy,
)

STAT = """cpu  900 0 300 5000 10 0 5 7 0 0
cpu0 100 2 50 2000 4 3 1 9 0 0
cpu1 200 0 60 2000 6 0 4 1 0 0
cpu2 300 0 70 1000 0 0 0 0 0 0
intr 12345
"""


def test_read_cpu_busy_counts_user_nice_system_irq_softirq_of_the_cpus(tmp_path):
    path = tmp_path / "stat"
    path.write_text(STAT)
    hz = os.sysconf("SC_CLK_TCK")
    # cpu0: 100 + 50 + 3 + 1 (iowait 4 and steal 9 are not another process's work, nor nice 2
    # while this process is not niced itself)
    assert read_cpu_busy([0], str(path), BUSY_FIELDS) == pytest.approx(154 / hz)
    assert read_cpu_busy([0, 1], str(path), BUSY_FIELDS) == pytest.approx((154 + 264) / hz)
    assert read_cpu_busy([0], str(path), (*BUSY_FIELDS, 1)) == pytest.approx(156 / hz)
    assert read_cpu_busy([0, 7], str(path)) is None  # a CPU missing: not a partial sum
    assert read_cpu_busy([0], str(tmp_path / "missing")) is None


def test_a_niced_process_counts_only_when_this_one_is_niced_too():
    """A nice-19 process beside the engine takes ~1/70 of a core: not a reason to stop
    spinning (a helper's simulator at nice 19 kept the engine on one thread). Where the engine
    itself runs niced, its own time is in ``nice``, so that field counts."""
    niced = os.nice(0) > 0  # the suite itself run under nice (a helper's, a CI's choice)
    assert busy_fields() == ((*BUSY_FIELDS, 1) if niced else BUSY_FIELDS)
    code = "import os; os.nice(5); from prefixgate.engine import thread_governor as t; print(t.busy_fields())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str((*BUSY_FIELDS, 1)), out.stderr[-2000:]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def share(clock: Clock, busy: list[float], own: list[float], cpus: int = 2) -> CpuShare:
    """A CpuShare whose busy seconds and own CPU seconds are the last of ``busy`` / ``own``."""
    return CpuShare(range(cpus), lambda _c: busy[-1], lambda: own[-1], clock)


def test_cpu_share_is_others_busy_cpus_over_wall_time():
    clock, busy, own = Clock(), [10.0], [3.0]
    s = share(clock, busy, own)
    assert s.sample() is None  # the first sample is the baseline
    clock.t, busy[-1], own[-1] = 1.0, 11.8, 3.9  # 1.8 CPU-s busy, 0.9 ours
    assert s.sample() == pytest.approx(0.9)
    clock.t, busy[-1], own[-1] = 2.0, 12.8, 4.9  # all of it ours
    assert s.sample() == pytest.approx(0.0)
    clock.t, busy[-1], own[-1] = 3.0, 13.0, 5.5  # rounding: ours > busy reads as 0, not < 0
    assert s.sample() == 0.0
    assert s.sample() is None  # no wall time passed


def test_governor_lowers_at_once_and_raises_after_two_quiet_samples():
    clock, busy, own = Clock(), [0.0], [0.0]
    applied: list[int] = []
    g = ThreadGovernor(2, share(clock, busy, own), applied.append, clock, interval_s=0.5)

    def advance(others: float, ours: float = 1.0) -> int:
        clock.t += 0.5
        busy[-1] += 0.5 * (others + ours)
        own[-1] += 0.5 * ours
        return g.tick()

    assert advance(0.0) == 2 and applied == []  # quiet: as asked
    assert advance(1.0) == 1 and applied == [1]  # a busy process: one CPU left, at once
    assert advance(1.0) == 1
    assert advance(0.0) == 1  # one quiet sample is not enough
    assert advance(1.0) == 1  # and the vote starts again
    assert advance(0.0) == 1
    assert advance(0.0) == 2 and applied == [1, 2]
    assert advance(0.4) == 2  # under half a CPU busy: rounds to both CPUs free
    clock.t += 0.1
    assert g.tick() == 2  # between samples: nothing read


def test_a_sample_over_an_idle_spell_is_a_baseline_not_a_verdict():
    """An engine idle for a minute beside a process that was busy then (a peer bench's other
    server, paused since) ticked once on resuming and read the whole minute: one thread for its
    first second of work. A sample spanning more than STALE_INTERVALS intervals only resets."""
    clock, busy, own = Clock(), [0.0], [0.0]
    applied: list[int] = []
    g = ThreadGovernor(2, share(clock, busy, own), applied.append, clock, interval_s=0.5)
    clock.t += 60.0
    busy[-1] += 60.0  # another process kept one CPU busy all that minute, then stopped
    assert g.tick() == 2 and applied == []  # the minute is not read
    clock.t += 0.5
    busy[-1] += 0.5  # this half second: ours only
    own[-1] += 0.5
    assert g.tick() == 2 and applied == []
    clock.t += 0.5
    busy[-1] += 1.0  # and now another process is busy: down at once, as before
    own[-1] += 0.5
    assert g.tick() == 1 and applied == [1]


def test_a_sample_over_one_long_step_is_a_verdict():
    """A prefill step of seconds (2,048 tokens at one thread: ~4 s) spans more than
    STALE_INTERVALS intervals while the engine runs through it: taken for an idle spell, every
    sample of a prefill-heavy load was dropped, so the governor never lowered beside a busy
    process (nor raised once it left) until short decode steps came."""
    clock, busy, own = Clock(), [0.0], [0.0]
    applied: list[int] = []
    g = ThreadGovernor(2, share(clock, busy, own), applied.append, clock, interval_s=0.5)
    clock.t += 4.0  # one step of 4 s beside a process keeping one CPU busy
    busy[-1] += 4.0 * 2
    own[-1] += 4.0 * 1
    assert g.tick() == 1 and applied == [1]
    for _ in range(2):  # the competitor left; two long steps at one thread
        clock.t += 4.0
        busy[-1] += 4.0
        own[-1] += 4.0
        g.tick()
    assert applied == [1, 2]


def test_governor_never_goes_under_one_or_over_what_was_asked():
    clock, busy, own = Clock(), [0.0], [0.0]
    g = ThreadGovernor(3, share(clock, busy, own, cpus=4), lambda n: None, clock)
    assert g.target(0.0) == 3  # 4 CPUs free, 3 asked
    assert g.target(1.4) == 3
    assert g.target(1.6) == 2
    assert g.target(3.9) == 1
    assert g.target(8.0) == 1
    with pytest.raises(ValueError):
        ThreadGovernor(0, share(clock, busy, own), lambda n: None, clock)


def test_an_engine_made_after_a_lowering_starts_from_the_count_asked(aidreams_path, monkeypatch):
    """torch's thread count is process-wide: an engine made (threads unset) after another
    engine's governor lowered it to one started on one thread for good (the new governor asks
    at most what it finds). It reads the asked count back; a count set since by anyone else
    stays theirs. (This process imported torch first, where ``threads=None`` runs at one
    thread on purpose; the engine package imported first is modelled.)"""
    from prefixgate.engine import threads

    monkeypatch.setattr(threads, "waits_actively", lambda: False)
    before = torch.get_num_threads()
    clock, busy, own = Clock(), [0.0], [0.0]
    try:
        torch.set_num_threads(2)
        g = ThreadGovernor(2, share(clock, busy, own), torch.set_num_threads, clock)
        clock.t, busy[-1], own[-1] = 1.0, 2.0, 1.0  # one CPU kept busy by another process
        assert g.tick() == 1 and torch.get_num_threads() == 1
        assert asked_threads(1) == 2
        assert asked_threads(3) == 3  # set by someone else since
        llm = LLM(aidreams_path, num_kv_blocks=64)
        assert torch.get_num_threads() == 2
        assert llm.engine._governor is None or llm.engine._governor.threads == 2
        llm2 = LLM(aidreams_path, threads=1, num_kv_blocks=64)  # asked: one, as given
        assert torch.get_num_threads() == 1
        llm.check_invariants()
        llm2.check_invariants()
    finally:
        torch.set_num_threads(before)


def test_no_governor_when_switched_off(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert make_governor(2) is None
    monkeypatch.delenv(ENV_SWITCH)
    if read_cpu_busy(CpuShare().cpus) is None:
        pytest.skip("no /proc/stat here")
    assert make_governor(2) is not None


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs",
)
def test_engine_runs_on_one_thread_beside_a_busy_process_and_back(aidreams_path):
    """The engine's own governor, with a real busy process on every CPU but one: its thread
    count goes down within a few samples, its answers stay what they were, and once the process
    is gone it goes back up."""
    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    try:
        llm = LLM(aidreams_path, threads=2, num_kv_blocks=64)
        governor = llm.engine._governor
        assert governor is not None and governor.current == 2
        governor.interval_s = 0.1
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        quiet = llm.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
        hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(cpus - 1)]
        try:
            deadline = time.monotonic() + 20
            while governor.current > 1 and time.monotonic() < deadline:
                llm.generate([[1, 2, 3, 4]], params)
                time.sleep(0.05)
            assert governor.current == 1
            assert torch.get_num_threads() == 1
            busy = llm.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        deadline = time.monotonic() + 20
        while governor.current < 2 and time.monotonic() < deadline:
            llm.generate([[1, 2, 3, 4]], params)
            time.sleep(0.05)
        assert governor.current == 2 and torch.get_num_threads() == 2
        assert busy == quiet
        llm.check_invariants()
    finally:
        torch.set_num_threads(before)
