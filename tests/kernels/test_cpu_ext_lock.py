"""A build of the CPU ops killed part-way must not hang every later process.

torch's ``cpp_extension.load`` takes a ``lock`` file in the build folder and waits, without a
timeout, while one exists; a killed build leaves it behind. ``cpu_ext.clear_stale_lock`` removes
one older than a build can take and waits for a younger one.
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


def test_stale_lock_is_removed(tmp_path):
    lock = _plant(tmp_path, cpu_ext.STALE_LOCK_S + 5)
    assert cpu_ext.clear_stale_lock(tmp_path) is True
    assert not lock.exists()


def test_no_lock_returns_at_once(tmp_path):
    assert cpu_ext.clear_stale_lock(tmp_path) is False


def test_live_lock_is_waited_for_not_removed(tmp_path):
    """A young lock belongs to a build in flight: wait until its owner releases it."""
    lock = _plant(tmp_path, 0)
    released = threading.Timer(0.3, lock.unlink)
    released.start()
    t0 = time.monotonic()
    assert cpu_ext.clear_stale_lock(tmp_path, poll_s=0.02) is False
    assert time.monotonic() - t0 >= 0.25
    released.join()


def test_young_lock_turns_stale_while_waiting(tmp_path):
    lock = _plant(tmp_path, 0)
    assert cpu_ext.clear_stale_lock(tmp_path, stale_after_s=0.2, poll_s=0.02) is True
    assert not lock.exists()


def test_process_after_a_killed_build_loads_the_ops(tmp_path):
    """End to end: a copy of the built cache with a stale lock planted in it, and a fresh
    process pointed at it (``TORCH_EXTENSIONS_DIR``) gets the ops instead of hanging."""
    if not cpu_ext.available():
        pytest.skip("prefixgate CPU ops not built here (no AVX2 or no compiler)")
    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory(cpu_ext.EXTENSION_NAME, verbose=False))
    root = tmp_path / "ext"
    copy = root / built.name  # with TORCH_EXTENSIONS_DIR set, torch adds no version folder
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock"))
    _plant(copy, cpu_ext.STALE_LOCK_S + 5)
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
