"""vLLM's server in the peer bench starts with its own OpenMP default, not the waiting that
importing prefixgate's engine put in the bench's environment (every run until 6 December 2026,
late, ran vLLM with prefixgate's passive waiting inherited); a wait variable the user set stays."""

from __future__ import annotations

from prefixgate.engine import threads

from examples.benchmarks.vllm_cpu_peer import vllm_env


def test_vllm_gets_its_own_openmp_default(monkeypatch):
    monkeypatch.setattr(
        threads,
        "_import_state",
        {"torch_first": False, "users": {}, "set": dict(threads.BOUNDED_WAIT_ENV)},
    )
    env = {**threads.BOUNDED_WAIT_ENV, "PYTHONHASHSEED": "0", "PATH": "/bin"}
    assert vllm_env(env) == {"PATH": "/bin"}


def test_a_wait_variable_the_user_set_stays(monkeypatch):
    users = {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setattr(threads, "_import_state", {"torch_first": False, "users": users, "set": {}})
    env = {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    assert vllm_env(env) == env


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    try:
        return _state(pid) != "Z"
    except OSError:
        return False


def test_a_server_not_measured_is_paused_and_a_paused_one_still_stops():
    """The bench stops the servers not being measured (their process groups: vLLM's engine
    core is a child), resumes them for their turn, and stops a paused one cleanly."""
    import subprocess
    import sys
    import time

    from examples.benchmarks.vllm_cpu_peer import Server

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    server = Server("stub", [sys.executable, "-c", code], 1, {}, ready="/")
    try:
        time.sleep(0.5)
        server.pause()
        time.sleep(0.2)
        assert _state(server.proc.pid) == "T"
        server.resume()
        time.sleep(0.2)
        assert _state(server.proc.pid) in ("S", "R")
        server.pause()
    finally:
        server.stop()
    assert server.proc.poll() is not None
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-g", str(server.proc.pid)], capture_output=True, text=True)
    alive = [pid for pid in left.stdout.split() if _alive(int(pid))]
    assert alive == []  # its child too (a zombie left for init to reap is not running)
