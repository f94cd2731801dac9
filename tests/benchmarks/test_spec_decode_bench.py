"""spec_decode's workloads fit the model's context, and one short round runs end to end with
identical greedy outputs (the benchmark's own check)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.benchmarks.spec_decode import make_engine, run_workload, workloads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_workloads_fit_and_one_round_runs(aidreams_path, workloads_path):
    engines = {
        "plain": make_engine(aidreams_path, "auto", False, 4),
        "ngram": make_engine(aidreams_path, "auto", True, 4),
    }
    tok = engines["plain"].tokenizer
    room = engines["plain"].max_model_len - 17

    def fits(prompt: str) -> bool:
        return len(tok.encode(prompt)) <= room

    wl = workloads(Path(workloads_path) / "user_tasks.jsonl", 3, fits)
    assert set(wl) == {"task-twice", "fresh"}
    for prompts in wl.values():
        assert len(prompts) == 3 and all(fits(p) for p in prompts)
    assert all(p.startswith("Repeat this text exactly.") for p in wl["task-twice"])
    r = run_workload(engines, wl["task-twice"][:2], 16)
    assert r["plain"]["outputs"] == r["ngram"]["outputs"]
    assert r["plain"]["tokens"] == r["ngram"]["tokens"] == 32
    assert 0.0 <= r["ngram"]["acceptance"] <= 1.0


def test_copy_prompts_are_a_text_then_its_start(aidreams_path, workloads_path):
    """``repeat``'s prompts are ``X + newline + X[:cut]`` and ``wanted`` is ``X[cut:]``; greedy
    outputs with and without speculation are identical on them."""
    from examples.benchmarks.spec_decode import copy_prompts, task_texts

    engines = {
        "plain": make_engine(aidreams_path, "auto", False, 4),
        "ngram": make_engine(aidreams_path, "auto", True, 4),
    }
    llm = engines["plain"]
    newline = llm.tokenizer.encode("\n")
    insts = [inst for inst, _ in task_texts(Path(workloads_path) / "user_tasks.jsonl", 2)]
    prompts, wanted = copy_prompts(llm, insts, text_tokens=24, cut=6, rounds=2)
    assert len(prompts) == len(wanted) == 2
    for p, w in zip(prompts, wanted, strict=True):
        x = p[: len(w) + 6]
        assert p == x + newline + x[:6] and w == x[6:]
    r = run_workload(engines, prompts, 12)
    assert r["plain"]["outputs"] == r["ngram"]["outputs"]
