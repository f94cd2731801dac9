"""The engine's torch thread policy (torch-free: ``prefixgate serve`` reads it before torch).

``passive_wait_env()``: OpenMP's passive waiting (``OMP_WAIT_POLICY=PASSIVE``,
``KMP_BLOCKTIME=0``: a thread with no work sleeps instead of spinning for the next parallel
region), which OpenMP reads once when torch loads, so ``prefixgate serve`` sets it before
anything imports torch (a variable the user set wins). Measured with
``engine/bench/threads.py`` on a shared 2-core host: with OpenMP's default (active) waiting,
2-thread single-stream decode collapsed to a fraction of 1-thread decode, with passive
waiting it did not (docs/benchmarks/threads.md).

``default_threads()``: the CPUs this process may run on (``os.sched_getaffinity``: a container's
or ``taskset``'s CPU set, not the host's count), at most ``MAX_DEFAULT_THREADS`` (past that a
small model's per-op work is too small to share). ``EngineConfig.threads`` is applied once,
with ``torch.set_num_threads``, before the model is built (``LLMEngine``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

MAX_DEFAULT_THREADS = 8
"""Cap of the default thread count."""


PASSIVE_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
"""OpenMP's passive waiting (GNU libgomp reads the first, Intel's the second)."""


def passive_wait_env(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> dict[str, str]:
    """Set ``PASSIVE_WAIT_ENV`` in ``environ`` where unset; returns what was set. Nothing is
    set once torch is imported (``"torch" in modules``): OpenMP has read its settings then."""
    if "torch" in modules:
        return {}
    done = {}
    for key, value in PASSIVE_WAIT_ENV.items():
        if key not in environ:
            environ[key] = value
            done[key] = value
    return done


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has no affinity call), >= 1."""
    getaff = getattr(os, "sched_getaffinity", None)
    if getaff is not None:
        return max(1, len(getaff(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """The default ``--threads``: ``min(available_cpus(), MAX_DEFAULT_THREADS)``."""
    return min(available_cpus(), MAX_DEFAULT_THREADS)


def apply_threads(num_threads: int | None) -> None:
    """``torch.set_num_threads(num_threads)`` (``None``: torch's setting is left alone).

    Raises:
        ValueError: ``num_threads < 1``.
    """
    if num_threads is None:
        return
    if num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
