"""One OpenMP pool per process: the thread that built an engine another thread steps gives its
pool back, or GNU libgomp stops spinning (its threads outnumber the CPUs: passive waiting in
effect, docs/cpu-performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's /proc and two CPUs (a pool of one thread has no worker to release)",
)


def run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_release_ends_the_calling_threads_idle_workers():
    """A parallel region leaves a worker thread parked in the calling thread's pool; releasing
    the pool ends it, and the next region makes a new one (results unchanged)."""
    out = run(
        """
        import os
        import prefixgate.engine
        import torch
        from prefixgate.engine.threads import release_openmp_pool
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        ref = a @ a
        import time
        before = len(os.listdir("/proc/self/task"))
        released = release_openmp_pool()
        deadline = time.monotonic() + 10  # the worker ends just after the call returns
        while len(os.listdir("/proc/self/task")) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        print(released, before - len(os.listdir("/proc/self/task")))
        again = a @ a
        print(torch.equal(ref, again), len(os.listdir("/proc/self/task")) == before)
        """
    )
    assert out.splitlines() == ["True 1", "True True"]


def test_async_engine_releases_the_pool_of_the_thread_that_built_it(aidreams_path, monkeypatch):
    """``AsyncEngine`` (stepped by its own thread) releases the building thread's pool, which
    the model load's parallel regions made, in that thread; its answers are unchanged."""
    import threading

    from prefixgate.engine import LLM, AsyncEngine, SamplingParams
    from prefixgate.engine import async_engine as mod

    calls: list[int] = []
    monkeypatch.setattr(mod, "release_openmp_pool", lambda: calls.append(threading.get_ident()))
    built: list[AsyncEngine] = []
    builder = threading.Thread(
        target=lambda: built.append(AsyncEngine(model=aidreams_path, num_kv_blocks=64))
    )
    builder.start()
    builder.join()
    assert calls == [builder.ident]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main() -> list[int]:
        ids: list[int] = []
        async for out in built[0].generate([1, 2, 3, 4], params, "r1"):
            ids.extend(out.delta_token_ids)
        await built[0].shutdown()
        return ids

    import asyncio

    got = asyncio.run(main())
    want = LLM(aidreams_path, num_kv_blocks=64).generate([[1, 2, 3, 4]], params)[0]
    assert got == list(want.outputs[0].token_ids)
    built[0].engine.check_invariants()


def test_the_runtime_is_found_through_the_maps_when_not_in_the_global_table():
    """When the process's global symbol table has no OpenMP runtime (torch loaded it
    ``RTLD_LOCAL``, as an embedding interpreter may), ``_openmp_library`` finds the one mapped
    into the process in ``/proc/self/maps`` and releasing still ends the idle worker."""
    out = run(
        """
        import ctypes, os, time
        import prefixgate.engine
        import torch
        from prefixgate.engine import threads

        real = ctypes.CDLL
        class NoGlobal:
            def __init__(self, name, *args, **kwargs):
                if name is not None:
                    self._lib = real(name, *args, **kwargs)
                    self._name = name
                else:
                    self._lib = None
            def __getattr__(self, attr):
                if self._lib is None:
                    raise AttributeError(attr)
                return getattr(self._lib, attr)
        threads.ctypes.CDLL = NoGlobal
        lib = threads._openmp_library()
        print(os.path.basename(lib._name).split(".")[0] if lib is not None else None)
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        a @ a
        before = len(os.listdir("/proc/self/task"))
        released = threads.release_openmp_pool()
        deadline = time.monotonic() + 10
        while len(os.listdir("/proc/self/task")) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        print(released, before - len(os.listdir("/proc/self/task")))
        """
    )
    name, release = out.splitlines()
    assert name.startswith(("libgomp", "libiomp", "libomp")), name
    assert release == "True 1"
