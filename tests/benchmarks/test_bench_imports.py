"""The benchmarks stay beside the product (read from the source, AST): no module of the four
parts imports ``examples`` (a benchmark), at import time or lazily.

``examples/benchmarks/`` is outside the wheel, so a product module that needed a benchmark
would break on an installed ``prefixgate``; a benchmark is a leaf (docs/architecture.md,
"Benchmarks: beside the product").
"""

from __future__ import annotations

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
