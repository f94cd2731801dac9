"""The gateway's memory over many requests: is RSS flat?

Starts ``prefixgate serve`` as its own process, with one API key: ``--mode local`` serves the
built-in tiny-random preset (or ``--model``, e.g. ``../shared/models/aidreams-260k``) on the
local engine; ``--mode proxy`` forwards to a stub OpenAI upstream (``gateway_overhead``'s: a
fixed answer at next to no cost, no streaming), so the gateway's own per-request state is
measured at hundreds of requests per second where the CPU engine serves a few; ``--mode
engine`` runs the same requests on an ``AsyncEngine`` in this process, no gateway (the
bisection's first step: engine alone against the gateway over HTTP), and samples glibc's heap
bytes in use (``mallinfo2``) and the count of Python objects beside RSS. It sends
``--requests`` requests: one at a time on a keep-alive connection, and every ``--every``
requests a burst of ``--burst`` concurrent ones (each on its own connection). In local mode
they are ``--dialects mixed``: chat completions and Anthropic Messages, each streamed and not,
in turn (``DIALECTS``); in proxy mode chat completions (the stub's only kind). Each prompt is
distinct (``request <i>``; ``--prompts fixed``: distinct, all of one length, ``request
<i:06d>``, so one prefill row count; ``identical``: one prompt for all). After every
``--every`` requests it samples the server's resident set size (``VmRSS`` in
``/proc/<pid>/status``, KiB), its heap bytes in use (``prefixgate_process_heap_bytes``) and the
engine's free blocks still holding a cached prefix (``prefixgate_kv_blocks_cached_free``: the
prefix cache fills until they are the whole pool) and prints one line; at the end the slope of
RSS over the second half (least squares, in KB per request: the first half includes warm-up,
caches filling, the allocator's arenas growing). ``--serve-args=--warmup-row-counts`` starts
the server with every GEMM row count compiled (flat after start-up).
A flat server shows a slope near 0; a leak of ``b`` bytes per request shows ``b / 1000``.

    python -m examples.benchmarks.memory_curve [--mode local|proxy|engine]
        [--requests 20000] [--every 500] [--prompts distinct|fixed|identical]
        [--dialects mixed|chat|chat-streams] [--serve-args=...]
        [--trim-every N] [--model PATH] [--json out.json]

Linux only (``/proc``). 20,000 requests take minutes on this 2-core machine (run it niced).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import httpx
from prefixgate.engine.malloc import heap_in_use
from prefixgate.sdk.bench.targets import free_port

from examples.benchmarks.gateway_overhead import _run_stub, start_serve

__all__ = ["heap_in_use", "main", "malloc_trim", "rss_kib", "slope_kb_per_request"]

KEY = "memory-curve-key"


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def malloc_trim() -> bool:
    """``malloc_trim(0)``: glibc gives freed memory back to the OS; False without it."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def rss_kib(pid: int) -> int:
    """The resident set size of process ``pid`` in KiB (``VmRSS``).

    Raises:
        RuntimeError: no ``VmRSS`` line (the process is gone, or not Linux).
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_kb_per_request(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(requests, RSS KiB)`` points, in KB (1,000 bytes) per request;
    0.0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return (sxy / sxx) * 1024 / 1000 if sxx else 0.0


def prompt_text(kind: str, i: int) -> str:
    """Request ``i``'s user message: ``distinct`` (``request <i>``, lengths grow with the
    digits), ``fixed`` (distinct, one length up to a million), ``identical``.

    Raises:
        ValueError: another ``kind``.
    """
    if kind == "distinct":
        return f"request {i}: say something"
    if kind == "fixed":
        return f"request {i:06d}: say something"
    if kind == "identical":
        return "request 0: say something"
    raise ValueError(f"prompts must be distinct, fixed or identical, got {kind!r}")


DIALECTS = ("chat-stream", "chat", "messages", "messages-stream")
"""What request ``i`` of ``--dialects mixed`` is: ``DIALECTS[i % 4]``, OpenAI chat completions
(``/v1/chat/completions``) and Anthropic Messages (``/v1/messages``), each streamed and not."""


def request_of(
    model: str, i: int, max_tokens: int, dialects: str, prompts: str = "distinct"
) -> tuple[str, dict, bool]:
    """Request ``i`` as ``(path, JSON body, streamed)``: ``dialects`` ``chat`` (chat
    completions, not streamed: the proxy's stub answers only those), ``chat-streams`` (a quarter
    of them streamed) or ``mixed`` (:data:`DIALECTS` in turn).

    Raises:
        ValueError: another ``dialects``.
    """
    if dialects == "chat":
        kind = "chat"
    elif dialects == "chat-streams":
        kind = "chat-stream" if i % 4 == 0 else "chat"
    elif dialects == "mixed":
        kind = DIALECTS[i % len(DIALECTS)]
    else:
        raise ValueError(f"dialects must be chat, chat-streams or mixed, got {dialects!r}")
    stream = kind.endswith("-stream")
    messages = [{"role": "user", "content": prompt_text(prompts, i)}]
    user = f"user-{i % 97}"
    if kind.startswith("messages"):
        body = {"model": model, "max_tokens": max_tokens, "messages": messages}
        body |= {"stream": stream, "metadata": {"user_id": user}}
        return "/v1/messages", body, stream
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    body |= {"stream": stream, "user": user}
    return "/v1/chat/completions", body, stream


async def send_one(http: httpx.AsyncClient, request: tuple[str, dict, bool]) -> int:
    """Send ``request`` (path, body, streamed), a stream read to its end; its HTTP status."""
    path, body, stream = request
    if stream:
        async with http.stream("POST", path, json=body) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code
    return (await http.post(path, json=body)).status_code


class _Sample:
    """What one sample holds: RSS (KiB), and where known heap in use (bytes), Python objects,
    free cached blocks."""

    def __init__(self) -> None:
        self.rss_kib: list[tuple[int, int]] = []
        self.heap_bytes: list[tuple[int, int]] = []
        self.py_objects: list[tuple[int, int]] = []
        self.cached_blocks: list[tuple[int, int]] = []

    def line(self) -> str:
        done, rss = self.rss_kib[-1]
        cols = [f"{done:>9}", f"{rss / 1024:>9.1f}"]
        heap = self.heap_bytes[-1][1] / 2**20 if self.heap_bytes else None
        objs = self.py_objects[-1][1] if self.py_objects else None
        cached = self.cached_blocks[-1][1] if self.cached_blocks else None
        cols.append(f"{heap:>9.1f}" if heap is not None else f"{'-':>9}")
        cols.append(f"{objs:>10}" if objs is not None else f"{'-':>10}")
        cols.append(f"{cached:>7}" if cached is not None else f"{'-':>7}")
        return " ".join(cols)


def _metric(text: str, name: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


async def _drive(args: argparse.Namespace, send, send_burst, sample) -> dict:
    """Send ``args.requests`` requests: ``send(i)`` one at a time (returns a status), every
    ``args.every`` a burst ``send_burst(first, n)`` (statuses); ``sample(done)`` after each
    burst. Returns the summary."""
    statuses: dict[int, int] = {}
    print(f"{'requests':>9} {'RSS MiB':>9} {'heap MiB':>9} {'py objects':>10} {'cached':>7} req/s")
    samples = await sample(0)
    print(samples.line(), flush=True)
    done = 0
    t0 = time.monotonic()
    while done < args.requests:
        for _ in range(args.every - args.burst):
            code = await send(done)
            statuses[code] = statuses.get(code, 0) + 1
            done += 1
        codes = await send_burst(done, args.burst)
        for code in codes:
            statuses[code] = statuses.get(code, 0) + 1
        done += args.burst
        await sample(done)
        print(f"{samples.line()} {done / (time.monotonic() - t0):>5.0f}", flush=True)
    points = samples.rss_kib
    half = [p for p in points if p[0] >= args.requests / 2]
    result = {
        "mode": args.mode,
        "prompts": args.prompts,
        "requests": done,
        "statuses": statuses,
        "rss_kib": points,
        "heap_bytes": samples.heap_bytes,
        "py_objects": samples.py_objects,
        "cached_blocks": samples.cached_blocks,
        "start_mib": points[0][1] / 1024,
        "middle_mib": min(points, key=lambda p: abs(p[0] - done / 2))[1] / 1024,
        "end_mib": points[-1][1] / 1024,
        "slope_kb_per_request_second_half": slope_kb_per_request(half),
        "slope_kb_per_request_all": slope_kb_per_request(points),
        "seconds": time.monotonic() - t0,
    }
    if samples.heap_bytes:
        heap_half = [(x, y / 1024) for x, y in samples.heap_bytes if x >= args.requests / 2]
        result["heap_slope_kb_per_request_second_half"] = slope_kb_per_request(heap_half)
    print(
        f"RSS {result['start_mib']:.1f} -> {result['middle_mib']:.1f} -> "
        f"{result['end_mib']:.1f} MiB over {done} requests; slope over the second half "
        f"{result['slope_kb_per_request_second_half']:+.3f} KB/request "
        f"(all: {result['slope_kb_per_request_all']:+.3f})"
        + (
            f"; heap in use {result['heap_slope_kb_per_request_second_half']:+.3f} KB/request"
            if samples.heap_bytes
            else ""
        )
        + f"; statuses {statuses}"
    )
    return result


async def run(args: argparse.Namespace, url: str, pid: int, model: str) -> dict:
    """The served gateway (``--mode local|proxy``): requests over HTTP, its RSS sampled."""
    dialects = args.dialects or ("mixed" if args.mode == "local" else "chat")
    headers = {"Authorization": f"Bearer {KEY}"}
    samples = _Sample()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:

        async def send(i: int) -> int:
            return await send_one(
                http, request_of(model, i, args.max_tokens, dialects, args.prompts)
            )

        async def send_burst(first: int, n: int) -> list[int]:
            async with httpx.AsyncClient(  # one connection per concurrent request
                base_url=url, headers=headers, timeout=120
            ) as side:
                return await asyncio.gather(
                    *(
                        send_one(
                            side,
                            request_of(model, first + j, args.max_tokens, dialects, args.prompts),
                        )
                        for j in range(n)
                    )
                )

        async def sample(done: int) -> _Sample:
            samples.rss_kib.append((done, rss_kib(pid)))
            text = (await http.get("/metrics")).text
            heap = _metric(text, "prefixgate_process_heap_bytes")
            if heap is not None:
                samples.heap_bytes.append((done, heap))
            cached = _metric(text, "prefixgate_kv_blocks_cached_free")
            if cached is not None:
                samples.cached_blocks.append((done, cached))
            return samples

        return await _drive(args, send, send_burst, sample)


async def run_engine(args: argparse.Namespace) -> dict:
    """``--mode engine``: the same requests on an in-process ``AsyncEngine``, no gateway;
    RSS, heap bytes in use and Python objects sampled, ``malloc_trim(0)`` every
    ``--trim-every`` requests when > 0."""
    from prefixgate.engine.async_engine import AsyncEngine
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.sampling_params import SamplingParams

    extra = json.loads(args.engine_args) if args.engine_args else {}
    engine = AsyncEngine(EngineConfig(model=args.model, **extra))
    params = SamplingParams(max_tokens=args.max_tokens)
    samples = _Sample()
    pid = os.getpid()

    async def send(i: int) -> int:
        messages = [{"role": "user", "content": prompt_text(args.prompts, i)}]
        ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
        async for out in engine.generate(ids, params, request_id=f"req-{i}"):
            if out.finished:
                break
        if args.trim_every and (i + 1) % args.trim_every == 0:
            malloc_trim()
        return 200

    async def sample(done: int) -> _Sample:
        samples.rss_kib.append((done, rss_kib(pid)))
        heap = heap_in_use()
        if heap is not None:
            samples.heap_bytes.append((done, heap))
        samples.py_objects.append((done, len(gc.get_objects())))
        samples.cached_blocks.append((done, engine.stats()["kv_blocks_cached_free"]))
        return samples

    async def send_burst(first: int, n: int) -> list[int]:
        return list(await asyncio.gather(*(send(first + j) for j in range(n))))

    try:
        return await _drive(args, send, send_burst, sample)
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["local", "proxy", "engine"], default="local")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=500, help="requests between RSS samples")
    parser.add_argument("--burst", type=int, default=8, help="concurrent requests per sample")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--prompts", choices=["distinct", "fixed", "identical"], default="distinct")
    parser.add_argument(
        "--dialects",
        choices=["chat", "chat-streams", "mixed"],
        default=None,
        help="local: mixed (default; chat completions and Anthropic Messages, streamed and "
        "not, in turn); proxy: chat (the stub's only kind); chat-streams: a quarter streamed",
    )
    parser.add_argument("--model", default=None, help="served model (default: tiny-random)")
    parser.add_argument("--serve-args", default="", help="more `prefixgate serve` flags")
    parser.add_argument(
        "--engine-args",
        default="",
        help='--mode engine: EngineConfig fields as JSON, e.g. {"num_kv_blocks": 512}',
    )
    parser.add_argument(
        "--trim-every", type=int, default=0, help="--mode engine: malloc_trim(0) every N requests"
    )
    parser.add_argument("--json", default=None, help="write the curve here")
    args = parser.parse_args(argv)
    if not 0 <= args.burst < args.every:
        parser.error("--burst must be in [0, --every)")
    start_load = os.getloadavg()
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in start_load)}")
    if args.mode == "engine":
        result = asyncio.run(run_engine(args))
    else:
        result = _serve_and_run(args)
    if args.mode != "engine":  # engine mode sends token ids, no dialect
        result["dialects"] = args.dialects or ("mixed" if args.mode == "local" else "chat")
    result["serve_args"] = args.serve_args
    result["loadavg"] = [start_load, os.getloadavg()]  # (1, 5, 15 min) at start and end
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def _serve_and_run(args: argparse.Namespace) -> dict:
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "name": "bench"}]}))
    flags = ["--keys-file", str(keys), "--log-level", "WARNING", *args.serve_args.split()]
    model = "tiny-random"
    stub = None
    if args.mode == "proxy":
        stub_port = free_port()
        ready = mp.get_context("spawn").Event()
        stub = mp.get_context("spawn").Process(
            target=_run_stub, args=(stub_port, ready), daemon=True
        )
        stub.start()
        ready.wait(30)
        flags += ["--upstream", f"http://127.0.0.1:{stub_port}"]
        model = "stub"
    elif args.model:
        flags += ["--model", args.model]
        model = Path(args.model).name
    port = free_port()
    try:
        proc = start_serve(port, flags, timeout_s=300.0)
        try:
            return asyncio.run(run(args, f"http://127.0.0.1:{port}", proc.pid, model))
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        if stub is not None:
            stub.terminate()


if __name__ == "__main__":
    main()
