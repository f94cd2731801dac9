"""SDK benchmark: N requests against a stub server that admits R requests/s (429 beyond).

The stub (a separate process, so it does not share the client's event loop) admits requests
through a token bucket of rate R/s and depth ``burst`` requests; an admitted request answers
after ``--service-ms``; any other gets 429 with ``retry-after-ms`` = the time until its next
token. No client can finish N requests faster than the bound ``(N - burst) / R`` seconds, so
the figure of merit is ``elapsed / bound`` (target <= 1.15) with zero failures. The client
process's CPU time is reported too: on a loaded machine a client short of CPU (an httpx
request costs a few ms of CPU) cannot reach high R whatever its flow control.

Modes (the client settings compared):

* ``rate_limit``: ``RateLimit(requests_per_minute=60 R)`` paces the client to the server's rate
  (the pattern the SDK recommends when the limit is known);
* ``adaptive``: no known rate: AIMD concurrency (``adaptive_concurrency=True``) plus retries
  that honour ``retry-after-ms``.

Usage::

    python -m examples.benchmarks.sdk_rate_limit --n 500 --rate 50     # ~10 s per mode
    python -m examples.benchmarks.sdk_rate_limit --mode rate_limit --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time

import anyio
from prefixgate.sdk import AsyncClient, RateLimit, RetryPolicy


def serve(rate: float, burst: float, service_s: float) -> None:
    """Run the stub server on 127.0.0.1:<free port>; print the port; serve until killed."""
    from aiohttp import web

    state = {"level": burst, "stamp": time.monotonic(), "ok": 0, "rejected": 0, "now": 0, "peak": 0}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        now = time.monotonic()
        state["level"] = min(burst, state["level"] + (now - state["stamp"]) * rate)
        state["stamp"] = now
        if state["level"] < 1.0:
            state["rejected"] += 1
            wait_ms = math.ceil((1.0 - state["level"]) / rate * 1000.0)
            return web.json_response(
                {"error": {"message": "rate limit", "type": "rate_limit_error", "code": None}},
                status=429,
                headers={"retry-after-ms": str(wait_ms)},
            )
        state["level"] -= 1.0
        state["ok"] += 1
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        try:
            await asyncio.sleep(service_s)
        finally:
            state["now"] -= 1
        text = body["messages"][-1]["content"]
        return web.json_response(
            {
                "id": "chatcmpl-" + text,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            }
        )

    async def stats(request: web.Request) -> web.Response:
        out = {k: state[k] for k in ("ok", "rejected", "peak")}
        if request.query.get("reset"):
            state.update(ok=0, rejected=0, peak=0, level=burst, stamp=time.monotonic())
        return web.json_response(out)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(main())


async def run_mode(mode: str, base: str, n: int, rate: float, burst: float) -> dict:
    """Send ``n`` requests in one ``batch`` with the client settings of ``mode``."""
    retry = RetryPolicy(max_retries=50, initial_delay=0.05, max_delay=1.0)
    if mode == "rate_limit":
        client = AsyncClient(
            base,
            max_concurrency=64,
            retry_policy=retry,
            rate_limit=RateLimit(requests_per_minute=60 * rate),
        )
    elif mode == "adaptive":
        client = AsyncClient(
            base, max_concurrency=64, adaptive_concurrency=True, retry_policy=retry
        )
    else:
        raise ValueError(f"unknown mode {mode!r}")
    reqs = [{"model": "stub", "messages": [{"role": "user", "content": str(i)}]} for i in range(n)]
    async with client:
        await client._http.get(base.removesuffix("/v1") + "/stats", params={"reset": "1"})
        t0, c0 = time.perf_counter(), time.process_time()
        results = await client.chat.completions.batch(reqs)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        server = (await client._http.get(base.removesuffix("/v1") + "/stats")).json()
        final_limit = client.limiter.limit
    failures = sum(isinstance(r, Exception) for r in results)
    bound = (n - burst) / rate
    return {
        "mode": mode,
        "n": n,
        "rate_per_s": rate,
        "elapsed_s": round(elapsed, 3),
        "bound_s": round(bound, 3),
        "ratio": round(elapsed / bound, 3),
        "failures": failures,
        "client_cpu_s": round(cpu, 2),
        "server_429": server["rejected"],
        "server_peak_in_flight": server["peak"],
        "final_concurrency_limit": final_limit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=500, help="requests per mode")
    ap.add_argument("--rate", type=float, default=50.0, help="server admission rate R (req/s)")
    ap.add_argument("--burst", type=float, default=10.0, help="server bucket depth (requests)")
    ap.add_argument("--service-ms", type=float, default=20.0, help="service time per request")
    ap.add_argument("--mode", choices=["rate_limit", "adaptive", "all"], default="all")
    ap.add_argument("--json", action="store_true", help="print one JSON line per mode")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.rate, args.burst, args.service_ms / 1000.0)
        return
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "examples.benchmarks.sdk_rate_limit",
            "--serve",
            "--rate",
            str(args.rate),
            "--burst",
            str(args.burst),
            "--service-ms",
            str(args.service_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}/v1"
        modes = ["rate_limit", "adaptive"] if args.mode == "all" else [args.mode]
        for mode in modes:
            res = anyio.run(run_mode, mode, base, args.n, args.rate, args.burst)
            if args.json:
                print(json.dumps(res))
            else:
                ok = "PASS" if res["ratio"] <= 1.15 and res["failures"] == 0 else "MISS"
                print(
                    f"{mode:>10}: {res['n']} requests in {res['elapsed_s']:.2f} s, bound "
                    f"{res['bound_s']:.2f} s, ratio {res['ratio']:.3f} [{ok}], failures "
                    f"{res['failures']}, server 429s {res['server_429']}, server peak in flight "
                    f"{res['server_peak_in_flight']}, final limit {res['final_concurrency_limit']}, "
                    f"client CPU {res['client_cpu_s']:.1f} s"
                )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
