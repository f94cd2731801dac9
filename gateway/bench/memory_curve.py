"""The gateway's memory over many requests: is RSS flat?

Starts ``prefixgate serve`` as its own process, with one API key: ``--mode local`` serves the
built-in tiny-random preset (or ``--model``, e.g. ``../shared/models/aidreams-260k``) on the
local engine; ``--mode proxy`` forwards to a stub OpenAI upstream (``gateway_overhead``'s: a
fixed answer at next to no cost, no streaming), so the gateway's own per-request state is
measured at hundreds of requests per second where the CPU engine serves a few. It sends
``--requests`` chat completions: one at a time on a keep-alive connection, and every
``--every`` requests a burst of ``--burst`` concurrent ones (each on its own connection), a
quarter of them streamed in local mode, each prompt distinct (``request <i>``). After every ``--every``
requests it samples the server's resident set size (``VmRSS`` in ``/proc/<pid>/status``, KiB)
and prints one line; at the end the slope of RSS over the second half (least squares, in KB
per request: the first half includes warm-up, caches filling, the allocator's arenas growing).
A flat server shows a slope near 0; a leak of ``b`` bytes per request shows ``b / 1000``.

    python -m prefixgate.gateway.bench.memory_curve [--mode local|proxy] [--requests 20000]
        [--every 500] [--model PATH] [--json out.json]

Linux only (``/proc``). 20,000 requests take minutes on this 2-core machine (run it niced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import httpx
from prefixgate.gateway.bench.gateway_overhead import _run_stub, start_serve
from prefixgate.sdk.bench.targets import free_port

KEY = "memory-curve-key"


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


def _body(model: str, i: int, max_tokens: int, streams: bool) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"request {i}: say something"}],
        "max_tokens": max_tokens,
        "stream": streams and i % 4 == 0,
        "user": f"user-{i % 97}",
    }


async def _one(http: httpx.AsyncClient, body: dict) -> int:
    if body["stream"]:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code
    return (await http.post("/v1/chat/completions", json=body)).status_code


async def run(args: argparse.Namespace, url: str, pid: int, model: str) -> dict:
    streams = args.mode == "local"
    headers = {"Authorization": f"Bearer {KEY}"}
    points: list[tuple[int, int]] = [(0, rss_kib(pid))]
    statuses: dict[int, int] = {}
    print(f"{'requests':>9} {'RSS MiB':>9} {'req/s':>7}")
    print(f"{0:>9} {points[0][1] / 1024:>9.1f}")
    done = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        while done < args.requests:
            for _ in range(args.every - args.burst):
                code = await _one(http, _body(model, done, args.max_tokens, streams))
                statuses[code] = statuses.get(code, 0) + 1
                done += 1
            async with httpx.AsyncClient(  # one connection per concurrent request
                base_url=url, headers=headers, timeout=120
            ) as side:
                codes = await asyncio.gather(
                    *(
                        _one(side, _body(model, done + j, args.max_tokens, streams))
                        for j in range(args.burst)
                    )
                )
            for code in codes:
                statuses[code] = statuses.get(code, 0) + 1
            done += args.burst
            points.append((done, rss_kib(pid)))
            rate = done / (time.monotonic() - t0)
            print(f"{done:>9} {points[-1][1] / 1024:>9.1f} {rate:>7.0f}", flush=True)
    half = [p for p in points if p[0] >= args.requests / 2]
    result = {
        "mode": args.mode,
        "requests": done,
        "statuses": statuses,
        "rss_kib": points,
        "start_mib": points[0][1] / 1024,
        "middle_mib": min(points, key=lambda p: abs(p[0] - done / 2))[1] / 1024,
        "end_mib": points[-1][1] / 1024,
        "slope_kb_per_request_second_half": slope_kb_per_request(half),
        "slope_kb_per_request_all": slope_kb_per_request(points),
        "seconds": time.monotonic() - t0,
    }
    print(
        f"RSS {result['start_mib']:.1f} -> {result['middle_mib']:.1f} -> "
        f"{result['end_mib']:.1f} MiB over {done} requests; slope over the second half "
        f"{result['slope_kb_per_request_second_half']:+.3f} KB/request "
        f"(all: {result['slope_kb_per_request_all']:+.3f}); statuses {statuses}"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["local", "proxy"], default="local")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=500, help="requests between RSS samples")
    parser.add_argument("--burst", type=int, default=8, help="concurrent requests per sample")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="served model (default: tiny-random)")
    parser.add_argument("--serve-args", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--json", default=None, help="write the curve here")
    args = parser.parse_args(argv)
    if not 0 <= args.burst < args.every:
        parser.error("--burst must be in [0, --every)")
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
            result = asyncio.run(run(args, f"http://127.0.0.1:{port}", proc.pid, model))
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        if stub is not None:
            stub.terminate()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
