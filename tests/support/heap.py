"""``heap_in_use()``: bytes glibc's malloc has handed out and not had back (``mallinfo2``).

Allocated bytes, not RSS: memory the allocator keeps after a ``free`` does not count, so a
rise is memory something still holds (C/C++/Rust allocations included, which tracemalloc
does not see). Python objects live in CPython's own ``mmap``-ed arenas, not here: count them
with ``gc`` or tracemalloc. Skips the calling test on a libc without ``mallinfo2`` (glibc <
2.33). The reading itself is ``memory_curve.heap_in_use`` (one implementation for the tests
and the bench).
"""

from __future__ import annotations

import pytest

from examples.benchmarks import memory_curve


def heap_in_use() -> int:
    """Bytes in use: small chunks in every arena (``uordblks``) + mmapped chunks (``hblkhd``)."""
    got = memory_curve.heap_in_use()
    if got is None:
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    return got
