"""The engine's torch thread policy (torch-free: ``prefixgate serve`` reads it before torch).

``bounded_wait_env()``: OpenMP threads spin a bounded while for their next parallel region,
then sleep (``GOMP_SPINCOUNT=30000`` for GNU libgomp, torch's CPU wheels; ``KMP_BLOCKTIME=1``
ms for Intel's). OpenMP reads these once when torch loads, so ``prefixgate serve`` sets them
before anything imports torch (a variable the user set wins). Why bounded: sleeping at once
(passive waiting) made every parallel region wake a sleeping thread, which on a VM costs an
idle vCPU's wake-up each time (docs/cpu-performance.md); spinning without bound collapses
decode beside another busy process. Beside one,
:class:`~prefixgate.engine.thread_governor.ThreadGovernor` lowers the thread count, so
nothing spins for a core that another process holds.

Every entry point gets it without an environment variable: ``prefixgate serve`` sets it in
``gateway/cli.py``, and importing the ``prefixgate.engine`` package (which ``LLM``,
``AsyncEngine``, ``LLMEngine`` and ``python -m examples.benchmarks.*``, through
``examples/benchmarks/__init__.py``, all do before their own modules load torch) calls
:func:`note_engine_import`, which sets it where torch is not loaded yet. Where torch was
imported first, OpenMP already runs with its default (spinning ~300,000 rounds for the next
parallel region): the process cannot change that any more, so :func:`apply_threads` then runs
an engine whose ``threads`` is unset at one thread (no parallel region, nothing to spin for)
and logs why, once (:func:`waits_actively`). ``python -m examples.benchmarks.threads
--settings`` prints what a process ends up with (:func:`openmp_settings`).

``default_threads()``: the CPUs this process may run on (``os.sched_getaffinity``: a container's
or ``taskset``'s CPU set, not the host's count), at most ``MAX_DEFAULT_THREADS`` (past that a
small model's per-op work is too small to share). ``EngineConfig.threads`` is applied once,
with ``torch.set_num_threads``, before the model is built (``LLMEngine``); the governor may
lower it while other processes are busy and raises it back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

from prefixgate.engine.thread_governor import asked_threads

logger = logging.getLogger(__name__)

MAX_DEFAULT_THREADS = 8
"""Cap of the default thread count."""


WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""The variables that choose OpenMP's waiting: one the user set is theirs, never overridden."""

BOUNDED_WAIT_ENV = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}
"""OpenMP's bounded spinning: 30,000 rounds for GNU libgomp (its default 300,000; 0 is passive
waiting), 1 ms for Intel's."""


def bounded_wait_env(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> dict[str, str]:
    """Set ``BOUNDED_WAIT_ENV`` in ``environ`` where none of :data:`WAIT_KEYS` is set (a
    user's own policy is theirs, whole); returns what was set. Nothing is set once torch is
    imported (``"torch" in modules``): OpenMP has read its settings then."""
    if "torch" in modules or any(k in environ for k in WAIT_KEYS):
        return {}
    environ.update(BOUNDED_WAIT_ENV)
    return dict(BOUNDED_WAIT_ENV)


_import_state: dict[str, object] = {}


def note_engine_import(
    environ: MutableMapping[str, str] = os.environ, modules: Mapping[str, object] = sys.modules
) -> dict[str, object]:
    """Called once when the ``prefixgate.engine`` package is imported: :func:`bounded_wait_env`
    (bounded spinning where torch is not loaded yet), and what was found noted for
    :func:`waits_actively`: ``torch_first`` (torch was loaded already), ``users`` (the wait
    variables the user had set), ``set`` (what was set here). Returns that record."""
    if not _import_state:
        users = {k: environ[k] for k in WAIT_KEYS if k in environ}
        torch_first = "torch" in modules
        done = bounded_wait_env(environ, modules)
        _import_state.update(torch_first=torch_first, users=users, set=done)
    return dict(_import_state)


def waits_actively() -> bool:
    """True where OpenMP in this process spins for its next parallel region because of
    prefixgate's import order: torch was imported before ``prefixgate.engine`` and the user
    set none of :data:`WAIT_KEYS` (a user's own policy, active included, is theirs)."""
    return bool(_import_state.get("torch_first")) and not _import_state.get("users")


_warned = False


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
    """``torch.set_num_threads(num_threads)``; ``None`` leaves torch's setting alone, except
    where OpenMP waits actively (:func:`waits_actively`: torch was imported before
    ``prefixgate.engine``): then ``None`` means one thread, since spinning threads beside
    another busy process collapsed decode to 0.06-0.10x its quiet rate (docs/cpu-performance.md).
    Either way, with active waiting and more than one thread, one warning says how to avoid it.

    Raises:
        ValueError: ``num_threads < 1``.
    """
    global _warned
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"threads must be >= 1, got {num_threads}")
    import torch

    if num_threads is None:  # torch's count as asked, not as an earlier engine's governor left it
        asked = asked_threads(torch.get_num_threads())
        if asked != torch.get_num_threads():
            torch.set_num_threads(asked)
    active = waits_actively()
    lowered = num_threads is None and active and torch.get_num_threads() > 1
    if lowered:
        num_threads = 1
    effective = torch.get_num_threads() if num_threads is None else num_threads
    if active and not _warned and (lowered or effective > 1):
        _warned = True
        logger.warning(
            "torch was imported before prefixgate.engine, so OpenMP spins for work without "
            "bound (GOMP_SPINCOUNT could not be set): the engine runs at %s; import "
            "prefixgate.engine before torch, or set GOMP_SPINCOUNT=30000, to run more threads "
            "safely beside other busy processes",
            "1 thread (threads unset)" if lowered else f"{effective} threads as asked",
        )
    if num_threads is None:
        return
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``."""


def _openmp_library() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (its symbols are global: ``torch`` loads its
    dependencies ``RTLD_GLOBAL``), else the first ``libgomp``/``libiomp``/``libomp`` mapped into
    this process (``/proc/self/maps``), else None."""
    try:
        lib = ctypes.CDLL(None)
    except (OSError, TypeError):  # no global symbol table to open (Windows)
        return None
    if hasattr(lib, "omp_pause_resource_all"):
        return lib
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and "omp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
            try:
                found = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
            except OSError:
                continue
            if hasattr(found, "omp_pause_resource_all"):
                return found
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP thread pool (``omp_pause_resource_all(omp_pause_soft)``:
    its idle worker threads end; a later parallel region of this thread makes a new pool).
    Call it in the thread that built an engine which another thread will step
    (:class:`~prefixgate.engine.async_engine.AsyncEngine`). Loads torch.

    Why: OpenMP keeps a pool per thread that ran a parallel region. GNU libgomp spins
    ``GOMP_SPINCOUNT`` rounds for the next region only while the process's OpenMP threads
    (every pool's) number no more than its CPUs (``gomp_managed_threads <=
    gomp_available_cpus``, libgomp's ``wait.h``); past that it spins 100 rounds, passive waiting
    in effect. The model load's pool and the stepping thread's pool at 2 threads on 2 CPUs
    make 3: every step ran as under passive waiting (docs/cpu-performance.md). A later parallel
    region of the calling thread (its own torch work) makes a pool again.

    Returns:
        True where the pool was released; False where no OpenMP runtime with the call is
        loaded, or the call refused (inside a parallel region).
    """
    import torch  # noqa: F401 - its OpenMP runtime is the one to find

    lib = _openmp_library()
    if lib is None:
        return False
    fn = lib.omp_pause_resource_all
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn(OMP_PAUSE_SOFT) == 0


def openmp_settings() -> dict[str, object]:
    """What this process runs with: the wait variables in its environment, the record of
    :func:`note_engine_import`, :func:`waits_actively` and torch's thread count (loads torch)."""
    import torch

    return {
        "environ": {k: os.environ[k] for k in WAIT_KEYS if k in os.environ},
        "engine_import": dict(_import_state),
        "waits_actively": waits_actively(),
        "torch_threads": torch.get_num_threads(),
    }
