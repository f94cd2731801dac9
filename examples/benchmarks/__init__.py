"""The benchmarks of the engine and the gateway: ``python -m examples.benchmarks.<name>`` from
the repository root (examples/benchmarks/README.md). Outside the wheel; nothing in the product
imports them.
"""
