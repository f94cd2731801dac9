"""engine_throughput's workload: prompts of exactly the asked length from real user tasks."""

from __future__ import annotations

from pathlib import Path

from examples.benchmarks.engine_throughput import load_prompts


def test_prompts_have_exactly_the_asked_length(aidreams_path, workloads_path):
    from prefixgate.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(aidreams_path)
    tasks = Path(workloads_path) / "user_tasks.jsonl"
    prompts = load_prompts(tok, tasks, 40, 128)
    assert len(prompts) == 40
    assert all(len(p) == 128 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 40  # distinct: no prefix cache hits between them
    assert all(p[0] == tok.bos_token_id for p in prompts)
