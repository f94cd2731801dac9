"""The engine's torch thread policy (torch-free: ``prefixgate serve`` reads it before torch).

``wait_policy_env()``: OpenMP's bounded spin (``GOMP_SPINCOUNT=1000`` with
``OMP_WAIT_POLICY`` unset: a thread with no work spins about a thousand rounds for the next
parallel region, then sleeps), which OpenMP reads once when torch loads, so ``prefixgate
serve`` sets it before anything imports torch (a variable the user set wins: with
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set nothing is added). torch's CPU wheel links GNU
libgomp (``torch/lib/libgomp.so.1``), which reads ``GOMP_SPINCOUNT``; ``KMP_BLOCKTIME=0`` is
the closest setting of Intel's OpenMP (passive, not measured here). Measured with
``engine/bench/threads.py`` on the shared 2-core host (README, "Threads on a busy host"):
OpenMP's default (spin ~300,000 rounds) collapsed 2-thread single-stream decode beside one
competing process; passive waiting (``OMP_WAIT_POLICY=PASSIVE``) held up there but cost
~0.7x on a quiet host; the bounded spin held up beside the competitor as passive did and
matched the default quietly.

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


WAIT_POLICY_ENV = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
"""The serve default: GNU libgomp's bounded spin (the first), Intel OpenMP's passive wait (the
second)."""

USER_WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""A user's GNU OpenMP wait setting: with either set, ``GOMP_SPINCOUNT`` is left alone."""


def wait_policy_env(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> dict[str, str]:
    """Set ``WAIT_POLICY_ENV`` in ``environ`` where unset; returns what was set.

    ``GOMP_SPINCOUNT`` is not set when the user set ``OMP_WAIT_POLICY`` (their choice of
    waiting wins over the spin count libgomp would prefer); ``KMP_BLOCKTIME`` only where it is
    unset. Nothing is set once torch is imported (``"torch" in modules``): OpenMP has read its
    settings then.
    """
    if "torch" in modules:
        return {}
    done = {}
    for key, value in WAIT_POLICY_ENV.items():
        if key in environ or (key == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in environ):
            continue
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
