"""Workload loading, output-length distributions and seeded Poisson arrivals."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from prefixgate.sdk.bench.workload import (
    SAMPLE_SYSTEM_PROMPTS,
    SAMPLE_USER_TASKS,
    SystemPrompt,
    WorkloadConfig,
    build_requests,
    load_system_prompts,
    load_user_tasks,
    load_workload,
    parse_output_len_dist,
    poisson_arrivals,
    task_text,
)


def test_shipped_sample_loads():
    prompts = load_system_prompts(SAMPLE_SYSTEM_PROMPTS)
    tasks = load_user_tasks(SAMPLE_USER_TASKS)
    assert len(prompts) >= 5 and all(p.text for p in prompts)
    assert len(tasks) >= 20 and all(tasks)
    assert (SAMPLE_SYSTEM_PROMPTS.parent / "README.md").exists()  # attribution ships with it


def test_full_real_files_load(workloads_path):
    prompts = load_system_prompts(workloads_path / "system_prompts.csv")
    tasks = load_user_tasks(workloads_path / "user_tasks.jsonl")
    assert len(prompts) == 166 and len(tasks) == 175
    assert prompts[0].name == "SEO Prompt"


def test_task_text_joins_instruction_and_input():
    assert task_text({"instruction": "Sort.", "instances": [{"input": "b a"}]}) == "Sort.\n\nb a"
    assert task_text({"instruction": "Hi.", "instances": [{"input": ""}]}) == "Hi."
    assert task_text({"instruction": "Hi."}) == "Hi."


def test_build_requests_shares_system_prompts_and_is_seeded():
    prompts = [SystemPrompt(f"p{i}", "x" * (100 * (i + 1))) for i in range(5)]
    tasks = [f"task {i}" for i in range(7)]
    cfg = WorkloadConfig(
        num_requests=20,
        num_system_prompts=2,
        system_prompt_min_chars=300,
        output_len=parse_output_len_dist("uniform:4:9"),
        seed=3,
    )
    reqs = build_requests(prompts, tasks, cfg)
    assert len(reqs) == 20 and [r.index for r in reqs] == list(range(20))
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 2 and all(len(s) >= 300 for s in systems)
    assert [r.system_prompt for r in reqs[:4]] == [0, 1, 0, 1]
    assert all(r.messages[1]["role"] == "user" and 4 <= r.max_tokens <= 9 for r in reqs)
    assert build_requests(prompts, tasks, cfg) == reqs  # same seed, same workload
    other = build_requests(
        prompts, tasks, WorkloadConfig(20, 2, 300, output_len=cfg.output_len, seed=4)
    )
    assert other != reqs


def test_build_requests_without_system_prompt_and_task_filter():
    reqs = build_requests(
        [SystemPrompt("a", "b")],
        ["short", "a much longer task"],
        WorkloadConfig(num_requests=3, num_system_prompts=0, user_task_max_chars=5),
    )
    assert all(
        r.messages == [{"role": "user", "content": "short"}] and r.system_prompt == -1 for r in reqs
    )


def test_build_requests_errors():
    with pytest.raises(ValueError, match="system prompts requested"):
        build_requests(
            [SystemPrompt("a", "b")], ["t"], WorkloadConfig(num_requests=1, num_system_prompts=2)
        )
    with pytest.raises(ValueError, match="no user task"):
        build_requests(
            [SystemPrompt("a", "b")],
            ["long task"],
            WorkloadConfig(num_requests=1, user_task_max_chars=2),
        )
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadConfig(num_requests=0)


def test_load_errors(tmp_path):
    bad_csv = tmp_path / "p.csv"
    bad_csv.write_text("name,text\na,b\n")
    with pytest.raises(ValueError, match="'prompt' column"):
        load_system_prompts(bad_csv)
    bad_jsonl = tmp_path / "t.jsonl"
    bad_jsonl.write_text('{"instruction": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=":2: not JSON"):
        load_user_tasks(bad_jsonl)
    bad_jsonl.write_text(json.dumps({"name": "no instruction"}) + "\n")
    with pytest.raises(ValueError, match="instruction"):
        load_user_tasks(bad_jsonl)
    with pytest.raises(FileNotFoundError):
        load_workload(WorkloadConfig(num_requests=1), tmp_path / "missing.csv")


@pytest.mark.parametrize(
    ("spec", "kind", "values"),
    [
        ("64", "fixed", (64,)),
        ("fixed:8", "fixed", (8,)),
        ("uniform:16:64", "uniform", (16, 64)),
        ("choice:8,32", "choice", (8, 32)),
    ],
)
def test_parse_output_len_dist(spec, kind, values):
    d = parse_output_len_dist(spec)
    assert (d.kind, d.values) == (kind, values)
    xs = d.sample(random.Random(0), 200)
    assert len(xs) == 200 and min(xs) >= min(values) and max(xs) <= max(values)


@pytest.mark.parametrize(
    "spec", ["", "0", "uniform:9:3", "uniform:3", "gauss:1:2", "choice:", "fixed:x", "choice:0,4"]
)
def test_parse_output_len_dist_rejects(spec):
    with pytest.raises(ValueError):
        parse_output_len_dist(spec)


def test_poisson_arrivals_seeded_and_rate():
    a = poisson_arrivals(4.0, 2000, seed=1)
    assert a == poisson_arrivals(4.0, 2000, seed=1) != poisson_arrivals(4.0, 2000, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd == mean
    assert poisson_arrivals(float("inf"), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(0, 3)
