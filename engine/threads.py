"""The engine's torch thread policy (torch-free: ``prefixgate serve`` reads it before torch).

``default_threads()``: the CPUs this process may run on (``os.sched_getaffinity``: a container's
or ``taskset``'s CPU set, not the host's count), at most ``MAX_DEFAULT_THREADS`` (past that a
small model's per-op work is too small to share). ``EngineConfig.threads`` is applied once,
with ``torch.set_num_threads``, before the model is built (``LLMEngine``).
"""

from __future__ import annotations

import os

MAX_DEFAULT_THREADS = 8
"""Cap of the default thread count."""


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
