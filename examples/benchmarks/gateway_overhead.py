"""Gateway overhead in upstream mode: added latency p50/p99 and requests/s on loopback.

Three processes on this machine: a stub OpenAI upstream (raw asyncio, a fixed chat
completion answer, so it costs next to nothing), the gateway (``prefixgate serve --upstream URL``
started as its own process, one event loop), and this
load generator (raw keep-alive HTTP/1.1 connections, pre-built requests).

1. Latency: ``--latency-requests`` requests one at a time, first straight to the stub, then
   through the gateway; added latency = gateway percentile - direct percentile (p50, p99).
2. Throughput: ``--concurrency`` connections each sending back-to-back requests through the
   gateway for ``--duration`` seconds; requests/s = completed / elapsed.

Targets: added p50 <= 2 ms and >= 1,000 requests/s on this 2-core machine
(LiteLLM publishes 1,035 requests/s on two 4-CPU instances with 12 ms p50 overhead).
Bounded: the default run takes 20-30 s.

    python -m examples.benchmarks.gateway_overhead [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO

import httpx
from prefixgate.sdk.bench.targets import free_port

from examples.benchmarks.options import add_flags

STUB_BODY = json.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21},
    }
).encode()
MODELS_BODY = json.dumps(
    {
        "object": "list",
        "data": [{"id": "stub", "object": "model", "created": 0, "owned_by": "stub"}],
    }
).encode()
MODELS_RESPONSE = (  # GET /v1/models: the gateway routes by model and polls each upstream's list
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(MODELS_BODY)).encode()
    + b"\r\nConnection: keep-alive\r\n\r\n"
    + MODELS_BODY
)
STUB_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(STUB_BODY)).encode()
    + b"\r\nConnection: keep-alive\r\n\r\n"
    + STUB_BODY
)

REQUEST_BODY = json.dumps(
    {
        "model": "stub",
        "max_tokens": 1,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. " * 8},
            {"role": "user", "content": "Say ok."},
        ],
    }
).encode()


def _content_length(head: bytes) -> int:
    """Content-Length of an HTTP head (bytes ending in CRLF); 0 when absent."""
    lower = head.lower()
    i = lower.find(b"content-length:")
    if i < 0:
        return 0
    return int(lower[i + 15 : lower.find(b"\r\n", i)])


# --- stub upstream: a minimal HTTP/1.1 keep-alive server -----------------------------------
class _StubProtocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            length = _content_length(self.buf[: end + 2])
            if len(self.buf) < end + 4 + length:
                return
            models = self.buf.startswith(b"GET /v1/models")
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(MODELS_RESPONSE if models else STUB_RESPONSE)


def _run_stub(port: int, ready: mp.Event) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_StubProtocol, "127.0.0.1", port, backlog=1024)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_serve(
    port: int, args: list[str], timeout_s: float = 60.0, log: IO[str] | None = None
) -> subprocess.Popen:
    """``prefixgate serve --host 127.0.0.1 --port PORT ARGS`` in its own process; returns once
    ``/ready`` answers 200 (the benchmarks of this folder that measure a served gateway).
    Its stderr (the log) goes to ``log`` when given (a file the caller reads), else to a
    temporary file.

    Raises SystemExit when it exits or does not come up within ``timeout_s`` (its stderr shown).
    """
    cmd = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *args]
    if log is None:
        log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"prefixgate serve exited with {proc.returncode}: {log.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1.0).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"prefixgate serve did not start within {timeout_s:.0f} s")


# --- load generator: raw keep-alive connections ----------------------------------------------
class _Conn:
    def __init__(self, port: int, path: bytes) -> None:
        self.port = port
        self.request = (
            b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(REQUEST_BODY)).encode()
            + b"\r\n\r\n"
            + REQUEST_BODY
        )

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def call(self) -> int:
        """One request; returns the HTTP status."""
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        await self.reader.readexactly(_content_length(head))
        return status

    def close(self) -> None:
        self.writer.close()


async def _latencies(port: int, n: int) -> list[float]:
    conn = _Conn(port, b"/v1/chat/completions")
    await conn.open()
    for _ in range(min(200, n)):  # warm-up
        await conn.call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        status = await conn.call()
        out.append(time.perf_counter() - t)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
    conn.close()
    return out


async def _throughput(port: int, concurrency: int, duration: float) -> tuple[float, int, int]:
    conns = [_Conn(port, b"/v1/chat/completions") for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns))
    done = errors = 0
    stop_at = 0.0

    async def worker(c: _Conn) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            if await c.call() == 200:
                done += 1
            else:
                errors += 1

    stop_at = time.perf_counter() + 1.0  # warm-up second
    await asyncio.gather(*(worker(c) for c in conns))
    done = errors = 0
    t0 = time.perf_counter()
    stop_at = t0 + duration
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return done / elapsed, done, errors


def _pct(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=1000, method="inclusive")[int(p * 10) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(
        ap,
        latency_requests=(3000, "sequential requests timed direct and through the gateway"),
        concurrency=(32, "clients of the throughput run"),
        duration=(8.0, "seconds of the throughput run through the gateway"),
    )
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    stub_port, gw_port = free_port(), free_port()
    stub_ready = ctx.Event()
    stub = ctx.Process(target=_run_stub, args=(stub_port, stub_ready), daemon=True)
    stub.start()
    stub_ready.wait(30)
    try:
        gateway = start_serve(
            gw_port,
            ["--upstream", f"http://127.0.0.1:{stub_port}", "--max-queued-requests", "4096"]
            + ["--log-level", "WARNING"],
        )
    except BaseException:
        stub.terminate()
        raise
    try:
        direct = asyncio.run(_latencies(stub_port, args.latency_requests))
        via = asyncio.run(_latencies(gw_port, args.latency_requests))
        rps, done, errors = asyncio.run(_throughput(gw_port, args.concurrency, args.duration))
    finally:
        gateway.terminate()
        gateway.wait(30)
        stub.terminate()
    ms = 1000.0
    res = {
        "direct_p50_ms": _pct(direct, 50) * ms,
        "direct_p99_ms": _pct(direct, 99) * ms,
        "gateway_p50_ms": _pct(via, 50) * ms,
        "gateway_p99_ms": _pct(via, 99) * ms,
        "added_p50_ms": (_pct(via, 50) - _pct(direct, 50)) * ms,
        "added_p99_ms": (_pct(via, 99) - _pct(direct, 99)) * ms,
        "requests_per_s": rps,
        "requests": done,
        "errors": errors,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "latency_requests": args.latency_requests,
    }
    print(
        f"direct to stub      p50 {res['direct_p50_ms']:.3f} ms  p99 {res['direct_p99_ms']:.3f} ms"
    )
    print(
        f"through gateway     p50 {res['gateway_p50_ms']:.3f} ms  p99 {res['gateway_p99_ms']:.3f} ms"
    )
    print(
        f"added by gateway    p50 {res['added_p50_ms']:.3f} ms  p99 {res['added_p99_ms']:.3f} ms"
        f"   (target p50 <= 2 ms)"
    )
    print(
        f"throughput          {rps:.0f} requests/s at concurrency {args.concurrency}"
        f" ({done} ok, {errors} errors)   (target >= 1000)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
