"""Runnable scripts beside the product (not in the wheel); ``examples.benchmarks`` holds the
benchmarks, run from the repository root as ``python -m examples.benchmarks.NAME``."""
