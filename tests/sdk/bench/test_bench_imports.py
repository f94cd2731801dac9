"""The benchmark home's import rules: the harness is an SDK client, never a gateway one."""

from __future__ import annotations

import ast
from pathlib import Path

import prefixgate.sdk.bench as bench

BENCH_DIR = Path(bench.__file__).parent
# Modules run with `python -m` that measure an in-process part; they import it when run.
MEASURE_IN_PROCESS = {"engine_throughput", "prefix_cache", "gpu_check", "hf_server", "fairness"}


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_benchmark_imports_the_gateway():
    for path in sorted(BENCH_DIR.glob("*.py")):
        bad = {n for n in _imports(path) if n.startswith("prefixgate.gateway")}
        assert not bad, f"{path.name} imports {bad}: start the server as a process instead"


def test_harness_imports_neither_engine_nor_torch():
    """At import time; `bench compare` loads transformers' tokenizer lazily to count tokens."""
    heavy = ("prefixgate.engine", "prefixgate.kernels", "torch", "transformers", "triton")
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem in MEASURE_IN_PROCESS:
            continue
        bad = {n for n in _imports(path, top_level_only=True) if n.startswith(heavy)}
        assert not bad, f"{path.name} imports {bad}"
