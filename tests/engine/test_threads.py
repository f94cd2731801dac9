"""The engine's thread policy: ``EngineConfig.threads`` applied once before the model is built."""

from __future__ import annotations

import pytest
import torch
from prefixgate.engine import LLM, threads
from prefixgate.engine.threads import (
    BOUNDED_WAIT_ENV,
    MAX_DEFAULT_THREADS,
    apply_threads,
    available_cpus,
    default_threads,
)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_affinity_mask_capped():
    import os

    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert available_cpus() == mask
    assert default_threads() == min(mask, MAX_DEFAULT_THREADS) >= 1


BOUNDED_IMPORT = {"torch_first": False, "users": {}, "set": dict(BOUNDED_WAIT_ENV)}
ACTIVE_IMPORT = {"torch_first": True, "users": {}, "set": {}}


def test_apply_threads(restore_threads, monkeypatch):
    monkeypatch.setattr(threads, "_import_state", dict(BOUNDED_IMPORT))
    torch.set_num_threads(2)
    apply_threads(None)
    assert torch.get_num_threads() == 2
    apply_threads(1)
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        apply_threads(0)


def test_apply_threads_with_active_waiting_defaults_to_one(restore_threads, monkeypatch, caplog):
    """torch loaded before prefixgate.engine, no wait variable of the user's: threads unset
    run at 1 (nothing to spin for); an explicit count is kept; one warning says why."""
    monkeypatch.setattr(threads, "_import_state", dict(ACTIVE_IMPORT))
    monkeypatch.setattr(threads, "_warned", False)
    assert threads.waits_actively()
    torch.set_num_threads(2)
    apply_threads(None)
    assert torch.get_num_threads() == 1
    assert "runs at 1 thread (threads unset)" in caplog.text
    apply_threads(2)
    assert torch.get_num_threads() == 2
    assert caplog.text.count("torch was imported before") == 1  # once a process
    users = {"torch_first": True, "users": {"OMP_WAIT_POLICY": "ACTIVE"}, "set": {}}
    monkeypatch.setattr(threads, "_import_state", users)
    assert not threads.waits_actively()  # the user's own policy: theirs
    apply_threads(None)
    assert torch.get_num_threads() == 2


def test_note_engine_import_records_once():
    env: dict[str, str] = {}
    saved = dict(threads._import_state)
    try:
        threads._import_state.clear()
        got = threads.note_engine_import(env, modules={})
        assert got == {"torch_first": False, "users": {}, "set": BOUNDED_WAIT_ENV}
        assert threads.note_engine_import({}, modules={"torch": object()}) == got  # once
    finally:
        threads._import_state.clear()
        threads._import_state.update(saved)


def test_engine_sets_its_threads_before_the_model(restore_threads):
    torch.set_num_threads(2)
    llm = LLM(None, load_format="dummy", threads=1, num_kv_blocks=16)
    assert torch.get_num_threads() == 1
    assert llm.config.threads == 1


def test_bounded_wait_env_only_before_torch_and_never_over_the_users():
    from prefixgate.engine.threads import BOUNDED_WAIT_ENV, bounded_wait_env

    env: dict[str, str] = {}
    assert bounded_wait_env(env, modules={}) == BOUNDED_WAIT_ENV
    assert env == BOUNDED_WAIT_ENV
    # any wait variable of the user's keeps the whole policy theirs: a spin count beside their
    # OMP_WAIT_POLICY=PASSIVE would change what they asked for
    for key, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("KMP_BLOCKTIME", "0")):
        mine = {key: value}
        assert bounded_wait_env(mine, modules={}) == {}
        assert mine == {key: value}
    late: dict[str, str] = {}
    assert bounded_wait_env(late, modules={"torch": object()}) == {}
    assert late == {}


def test_serve_sets_bounded_spinning_before_torch_loads():
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from prefixgate.gateway import cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
    )
    waits = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    env = {k: v for k, v in __import__("os").environ.items() if k not in waits}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "30000 False", out.stderr[-2000:]
