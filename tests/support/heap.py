"""``heap_in_use()``: bytes glibc's malloc has handed out and not had back (``mallinfo2``).

Allocated bytes, not RSS: memory the allocator keeps after a ``free`` does not count, so a
rise is memory something still holds (C/C++/Rust allocations included, which tracemalloc
does not see). Skips the calling test on a libc without ``mallinfo2`` (glibc < 2.33).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


def heap_in_use() -> int:
    """Bytes in use: small chunks in every arena (``uordblks``) + mmapped chunks (``hblkhd``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    fn = getattr(libc, "mallinfo2", None)
    if fn is None:
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd
