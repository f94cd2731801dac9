"""glibc malloc's heap trimming on CPU (torch-free).

torch's CPU tensors come from glibc ``malloc``. When a step's activations are freed, glibc hands
the free top of its heaps back to the kernel once it passes its trim threshold (dynamic: about
twice the largest recent ``mmap``-sized block), and the next step touches those pages again:
each comes back as a zeroed page fault. :func:`keep_freed_memory` sets the threshold once
(``mallopt(M_TRIM_THRESHOLD)``, with the mmap threshold at its usual cap,
:data:`MMAP_THRESHOLD_BYTES`), so freed activations stay with the process for the next step.
The process's peak memory is unchanged (it reached that size anyway); its memory between
bursts stays near the peak. Measured figures: docs/cpu-performance.md ("Steady batched
throughput").

A user's own setting wins: nothing is set where ``MALLOC_TRIM_THRESHOLD_`` or
``GLIBC_TUNABLES`` is in the environment, or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter number of the trim threshold (``malloc.h``)."""

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``)."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks from this size on get their own ``mmap`` (and are faulted in anew each time): 32 MiB,
the largest glibc's ``mallopt`` takes on 64-bit and the cap its dynamic threshold grows to.
Setting the trim threshold switches that growth off, so this is set with it: left at its
128 KiB start, every activation above it would be mapped and faulted in each step (measured:
62,000 faults a decode step, twice the CPU time)."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free heap memory kept by the process instead of returned to the kernel (1 GiB)."""

USER_ENV = ("MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""Environment variables through which a user sets glibc's malloc themselves."""


def keep_freed_memory(
    trim_bytes: int = TRIM_THRESHOLD_BYTES, environ: Mapping[str, str] = os.environ
) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)`` then ``mallopt(M_TRIM_THRESHOLD,
    trim_bytes)`` in this process; True when both were set.

    False (nothing done): not Linux with glibc, a user's :data:`USER_ENV` variable present, or
    ``mallopt`` refused the value.

    Raises:
        ValueError: ``trim_bytes`` < 0 or past a C int.
    """
    if not 0 <= trim_bytes < 2**31:
        raise ValueError(f"trim_bytes must be in [0, 2**31), got {trim_bytes}")
    if not sys.platform.startswith("linux") or any(k in environ for k in USER_ENV):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_bytes)
    )
    if done:
        logger.debug("glibc malloc keeps up to %d MiB of freed memory", trim_bytes >> 20)
    return done


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (``malloc.h``, glibc >= 2.33): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def heap_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not had back in this process (``mallinfo2``:
    small chunks in every arena, ``uordblks``, + mmapped chunks, ``hblkhd``); ``None`` on a
    libc without ``mallinfo2`` (glibc < 2.33, musl, not Linux).

    Allocated bytes, not RSS: memory the allocator keeps after a ``free`` does not count, nor
    memory mapped outside malloc (CPython's object arenas are ``mmap``-ed: Python objects
    show in RSS and in ``gc.get_objects()``, not here)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)
