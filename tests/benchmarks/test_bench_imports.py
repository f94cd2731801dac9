"""The benchmarks stay beside the product (read from the source, AST): no module of the four
parts imports ``examples`` (a benchmark), at import time or lazily.

``examples/benchmarks/`` is outside the wheel, so a product module that needed a benchmark
would break on an installed ``prefixgate``; a benchmark is a leaf (docs/architecture.md,
"Benchmarks: beside the product").
"""

from __future__ import annotations

import re
from pathlib import Path

from support.imports import imported_names

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"sdk": "prefixgate.sdk", "gateway": "prefixgate.gateway", "engine": "prefixgate.engine"}
PARTS["kernels"] = "prefixgate.kernels"


def test_the_product_imports_no_benchmark():
    bad = []
    for folder, package in PARTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            names = imported_names(path, ROOT / folder, package)
            found = {n for n in names if n == "examples" or n.startswith("examples.")}
            if found:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(found)}")
    assert bad == []


def test_every_benchmark_is_in_examples():
    assert not (ROOT / "gateway" / "bench").exists()
    assert not (ROOT / "engine" / "bench").exists()
    assert (ROOT / "examples" / "benchmarks" / "engine_throughput.py").is_file()


FILE_COMMAND = re.compile(r"python3?\s+examples/benchmarks/(\w+)\.py")


def test_a_benchmark_run_as_a_file_imports_no_other_benchmark():
    """A command in the docs that runs a benchmark as a file (``python
    examples/benchmarks/NAME.py``) names one that works so: run as a file, ``examples`` is not
    importable, so a benchmark importing ``examples.*`` must be shown as ``python -m
    examples.benchmarks.NAME`` (vllm_cpu_peer's page showed the file form, which stopped at
    its first import)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.md"))
    bad = []
    for page in pages:
        for name in set(FILE_COMMAND.findall(page.read_text(encoding="utf-8"))):
            script = ROOT / "examples" / "benchmarks" / f"{name}.py"
            names = imported_names(script, ROOT / "examples", "examples")
            if any(n == "examples" or n.startswith("examples.") for n in names):
                bad.append(f"{page.relative_to(ROOT)}: python examples/benchmarks/{name}.py")
    assert bad == []
