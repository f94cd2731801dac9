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
