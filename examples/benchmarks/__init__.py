"""The benchmarks of the engine and the gateway: ``python -m examples.benchmarks.<name>`` from
the repository root (examples/benchmarks/README.md). Outside the wheel; nothing in the product
imports them.
"""

# The engine's package first (torch-free): its import sets OpenMP's bounded spinning before any
# benchmark loads torch (engine/threads.py), whatever a benchmark's own imports put first.
import prefixgate.engine  # noqa: E402, F401
