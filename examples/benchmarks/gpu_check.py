"""The prepared GPU run, from a checkout: ``python examples/benchmarks/gpu_check.py --out gpu.json``.

A launcher only: the script lives in the package (``prefixgate.engine.bench.gpu_check``, with
the engine's other benchmarks, see docs/architecture.md "Benchmarks"), so that it runs the
same from an installed wheel. Every argument is passed through (``--dry-run`` checks it on a CPU).
"""

from __future__ import annotations

from prefixgate.engine.bench.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
