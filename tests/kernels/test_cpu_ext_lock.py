"""A build of the CPU ops killed part-way must not hang every later process.

torch's ``cpp_extension.load`` takes a ``lock`` file in the build folder and waits, without a
timeout, while one exists; a killed build leaves it behind. ``cpu_ext.clear_stale_lock`` removes
one no process holds open (or, where that cannot be told, one older than a build can take) and
waits for a live one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prefixgate.kernels import cpu_ext


def _plant(folder: Path, age_s: float) -> Path:
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_lock_nobody_holds_is_removed_at_once(tmp_path):
    """A young lock no process holds open was left by a killed build: removed without waiting."""
    lock = _plant(tmp_path, 0)
    if cpu_ext.lock_holders(lock) is None:
        pytest.skip("open files of every process not readable here (no /proc, or other users)")
    assert cpu_ext.lock_holders(lock) is False
    t0 = time.monotonic()
    assert cpu_ext.clear_stale_lock(tmp_path) is True
    assert time.monotonic() - t0 < 5 and not lock.exists()


def test_lock_held_open_is_waited_for_not_removed(tmp_path):
    """A lock held open (as torch's FileBaton holds it during a build) belongs to a build in
    flight: wait until its owner releases it, and never remove it."""
    lock = tmp_path / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    if cpu_ext.lock_holders(lock) is None:
        os.close(fd)
        pytest.skip("open files of every process not readable here (no /proc, or other users)")
    assert cpu_ext.lock_holders(lock) is True

    def release() -> None:
        os.close(fd)
        lock.unlink()

    released = threading.Timer(0.3, release)
    released.start()
    t0 = time.monotonic()
    assert cpu_ext.clear_stale_lock(tmp_path, poll_s=0.02) is False
    assert time.monotonic() - t0 >= 0.25
    released.join()


def test_no_lock_returns_at_once(tmp_path):
    assert cpu_ext.clear_stale_lock(tmp_path) is False


@pytest.mark.parametrize("holders", [None, True])
def test_unknown_holders_fall_back_to_the_lock_age(tmp_path, monkeypatch, holders):
    """Where the holders cannot be told (None), a lock older than STALE_LOCK_S is removed and a
    young one waited for; a lock held open is never removed, whatever its age."""
    monkeypatch.setattr(cpu_ext, "lock_holders", lambda lock: holders)
    old = _plant(tmp_path, cpu_ext.STALE_LOCK_S + 5)
    if holders is None:
        assert cpu_ext.clear_stale_lock(tmp_path) is True
        assert not old.exists()
    young = _plant(tmp_path, 0)
    released = threading.Timer(0.3, young.unlink)
    released.start()
    assert cpu_ext.clear_stale_lock(tmp_path, poll_s=0.02) is False
    released.join()


def test_young_lock_turns_stale_while_waiting(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_ext, "lock_holders", lambda lock: None)
    lock = _plant(tmp_path, 0)
    assert cpu_ext.clear_stale_lock(tmp_path, stale_after_s=0.2, poll_s=0.02) is True
    assert not lock.exists()


@pytest.mark.parametrize("age_s", [cpu_ext.STALE_LOCK_S + 5, 0.0])
def test_process_after_a_killed_build_loads_the_ops(tmp_path, age_s):
    """End to end: a copy of the built cache with a killed build's lock planted in it (old, or
    just left: Ctrl-C and start again), and a fresh process pointed at it
    (``TORCH_EXTENSIONS_DIR``) gets the ops instead of hanging."""
    if not cpu_ext.available():
        pytest.skip("prefixgate CPU ops not built here (no AVX2 or no compiler)")
    if age_s == 0 and cpu_ext.lock_holders(Path(__file__)) is None:
        pytest.skip("open files of every process not readable here: a young lock is waited for")
    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory(cpu_ext.EXTENSION_NAME, verbose=False))
    root = tmp_path / "ext"
    copy = root / built.name  # with TORCH_EXTENSIONS_DIR set, torch adds no version folder
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock"))
    _plant(copy, age_s)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    env.pop(cpu_ext.DISABLE_ENV, None)
    code = "from prefixgate.kernels import cpu_ext; print(cpu_ext.available())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stderr
    assert "removed a stale build lock" in done.stderr
    assert not (copy / "lock").exists()
