"""``examples/demo.sh`` installs into the first ``python3`` on PATH: it refuses the system's
own interpreter (a new user's shell without ``. .venv/bin/activate`` got torch and its
dependencies installed into the system Python), and refuses a busy ``PORT`` before any install
(it ran both installs first). ``python3`` here is a shim that runs the real interpreter but
records every ``python3 -m pip`` instead of running it: these tests install nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.sh"
SYSTEM_PYTHON = getattr(sys, "_base_executable", None) or sys.executable


def _shim(tmp_path: Path, real: str) -> tuple[dict[str, str], Path]:
    """An environment whose ``python3`` is ``real`` except that ``-m pip`` is only logged."""
    bin_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    bin_dir.mkdir()
    shim = bin_dir / "python3"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$@" >> {log}; exit 0; fi\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "DEMO_ANY_PYTHON")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    env.pop("VIRTUAL_ENV", None)
    return env, log


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(DEMO)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the suite run from a venv")
def test_the_systems_python_is_refused_before_any_install(tmp_path, busy_port):
    env, log = _shim(tmp_path, SYSTEM_PYTHON)
    env["PORT"] = str(busy_port)  # had it gone on, the port check would stop it, not a server
    r = _run(env)
    assert r.returncode == 1
    assert "is not a virtual environment" in r.stderr and "DEMO_ANY_PYTHON=1" in r.stderr
    assert not log.exists(), log.read_text()  # pip never ran
    env["DEMO_ANY_PYTHON"] = "1"  # asked for: it goes on (to the busy port's refusal here)
    assert "already listens" in _run(env).stderr


def test_a_busy_port_is_refused_before_any_install(tmp_path, busy_port):
    env, log = _shim(tmp_path, sys.executable)  # this suite's own virtual environment
    env["PORT"] = str(busy_port)
    env["DEMO_ANY_PYTHON"] = "1"  # whatever interpreter runs the suite
    r = _run(env)
    assert r.returncode == 1
    assert f"already listens on 127.0.0.1:{busy_port}" in r.stderr
    assert not log.exists(), log.read_text()  # refused at once, before the installs
