"""The engine benchmarks' import rules, read from the source (AST): the engine points down only.

An engine benchmark imports the engine (and kernels) in-process, the SDK's shared-folder lookup
(``prefixgate.sdk.bench.shared``) at most, and never ``prefixgate.gateway``, at import time or
lazily (a benchmark of the engine behind the gateway belongs in ``gateway/bench/``).
"""

from __future__ import annotations

from pathlib import Path

import prefixgate.engine.bench as bench
from support.imports import imported_names

BENCH_DIR = Path(bench.__file__).parent


def _benches() -> list[Path]:
    paths = sorted(BENCH_DIR.glob("*.py"))
    assert BENCH_DIR / "engine_throughput.py" in paths
    return paths


def test_engine_benchmarks_import_no_gateway_and_of_the_sdk_only_the_shared_lookup():
    for path in _benches():
        names = imported_names(path)
        gateway = {n for n in names if n.startswith("prefixgate.gateway")}
        assert not gateway, f"{path.name} imports {gateway}"
        sdk = {n for n in names if n.startswith("prefixgate.sdk")}
        assert sdk <= {"prefixgate.sdk.bench.shared", "prefixgate.sdk.bench.shared.shared_dir"}, (
            f"{path.name} imports {sdk}"
        )
