"""Overload through the real gateway: is ``Retry-After`` the truth, and do TTFT budgets keep
goodput at capacity?

A ``prefixgate serve`` process (built-in ``tiny-random`` preset unless ``--model``;
``--max-num-seqs`` seats, ``--max-queued-requests`` places in the admission queue) is measured
over streaming HTTP:

1. **capacity**: ``2 x max-num-seqs`` clients send requests back to back (a closed loop, so
   the queue stays bounded) for ``--capacity-s`` seconds: completed requests per second.
2. **overload**: for each factor of ``--factors`` (default 1 2 4) and each mode (without and
   with a TTFT budget, header ``x-prefixgate-ttft-budget-ms`` = ``--budget-ms``), requests
   arrive as a Poisson process of rate factor x capacity for ``--duration-s`` seconds. A
   refused request (429) sleeps exactly the ``retry-after-ms`` it was told and retries, until
   admitted (the wait is capped only by the server's own 60 s).

Reported per run: for every 429, the relative error ``|stated wait - actual wait until
admission| / actual wait`` (actual: from the 429 to the send of the attempt that was admitted;
a request refused twice makes its first 429's error ``second wait / total wait``), its p50 /
p90; the share of admitted requests whose TTFT (admitted attempt sent -> first content chunk)
met the budget; goodput = requests answered within the offered window whose TTFT met the
budget, per second, over capacity (without budgets: every answered request counts).

    python -m examples.benchmarks.overload [--json out.json]

Bounded: about ``capacity-s + 2 x len(factors) x (duration-s + drain)`` seconds. Figures only,
no timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from prefixgate.sdk.bench.targets import free_port

from examples.benchmarks.gateway_overhead import start_serve
from examples.benchmarks.options import add_flags

BUDGET_HEADER = "x-prefixgate-ttft-budget-ms"
GIVE_UP_S = 120.0  # a request still refused after this long gives up (counted as failed)


@dataclass(slots=True)
class Attempt:
    """One request's life: every 429's (time, stated wait), the admitted attempt's send time,
    its first content chunk and its end (monotonic seconds)."""

    arrived: float
    refusals: list[tuple[float, float]] = field(default_factory=list)
    admitted: float | None = None
    first: float | None = None
    done: float | None = None
    status: int = 0
    predicted: float | None = None  # the gateway's x-prefixgate-predicted-ttft-ms, seconds
    codes: list[str] = field(default_factory=list)  # each 429's error code, in order


async def one(
    http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], into: list[Attempt]
) -> None:
    """Send ``body`` until it is admitted, sleeping exactly each 429's stated wait."""
    rec = Attempt(time.monotonic())
    into.append(rec)
    while True:
        sent = time.monotonic()
        try:
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code == 429:
                    await r.aread()
                    try:
                        rec.codes.append(str(r.json()["error"]["code"]))
                    except (ValueError, KeyError, TypeError):
                        rec.codes.append("?")
                    if sent - rec.arrived > GIVE_UP_S:  # the bench stays bounded
                        rec.status = 429
                        return
                    ms = r.headers.get("retry-after-ms")
                    wait = int(ms) / 1000.0 if ms else float(r.headers.get("Retry-After", "1"))
                    rec.refusals.append((time.monotonic(), wait))
                    await asyncio.sleep(wait)
                    continue
                rec.admitted, rec.status = sent, r.status_code
                if "x-prefixgate-predicted-ttft-ms" in r.headers:
                    rec.predicted = int(r.headers["x-prefixgate-predicted-ttft-ms"]) / 1000.0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and rec.first is None:
                        rec.first = time.monotonic()
                rec.done = time.monotonic()
                return
        except httpx.HTTPError:
            rec.status = -1
            return


def _body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny-random",
        "prompt": f"request {i}: tell me a story about the number {i}",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def capacity(http: httpx.AsyncClient, clients: int, seconds: float, max_tokens: int) -> float:
    """Completed requests per second with ``clients`` back-to-back clients."""
    got: list[Attempt] = []
    stop = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def loop() -> None:
        while time.monotonic() < stop:
            await one(http, _body(next(counter), max_tokens), {}, got)

    t0 = time.monotonic()
    await asyncio.gather(*(loop() for _ in range(clients)))
    done = [a for a in got if a.status == 200 and a.done is not None]
    return len(done) / (time.monotonic() - t0)


async def overload(
    http: httpx.AsyncClient, rate: float, seconds: float, max_tokens: int, budget_ms: float | None
) -> tuple[list[Attempt], float, float]:
    """Poisson arrivals at ``rate``/s for ``seconds``; returns the attempts and the window."""
    rng = random.Random(0)
    got: list[Attempt] = []
    tasks: list[asyncio.Task[None]] = []
    headers = {BUDGET_HEADER: f"{budget_ms:.0f}"} if budget_ms else {}
    t0 = time.monotonic()
    t, i = t0, 0
    while True:
        t += rng.expovariate(rate)
        if t - t0 > seconds:
            break
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        tasks.append(asyncio.create_task(one(http, _body(10**6 + i, max_tokens), headers, got)))
        i += 1
    t1 = t0 + seconds
    await asyncio.gather(*tasks)
    return got, t0, t1


def summarize(
    got: list[Attempt], t0: float, t1: float, cap: float, budget_ms: float | None, b: float
) -> dict[str, Any]:
    """The figures of one overload run (see the module docstring)."""
    errors = []
    for a in got:
        if a.admitted is None:
            continue
        for when, stated in a.refusals:
            actual = a.admitted - when
            if actual > 0:
                errors.append(abs(stated - actual) / actual)
    admitted = [a for a in got if a.status == 200 and a.first is not None]
    ttft = [a.first - a.admitted for a in admitted if a.admitted is not None and a.first]
    limit = (budget_ms or b) / 1000.0
    met = [x for x in ttft if x <= limit]
    good = [
        a
        for a in admitted
        if a.done is not None
        and a.done <= t1
        and (a.first - a.admitted if a.first and a.admitted else 1e9) <= limit
    ]
    answered = [a for a in admitted if a.done is not None and a.done <= t1]
    # over the whole run (arrivals, then the retries' drain): no edge of the window
    met_all = [a for a in admitted if a.first and a.admitted and a.first - a.admitted <= limit]
    end = max((a.done for a in admitted if a.done is not None), default=t1)

    def q(xs: list[float], p: float) -> float | None:
        if not xs:
            return None
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]

    # how far the gateway's prediction is from the TTFT the client saw (seconds, actual - predicted)
    miss = [
        a.first - a.admitted - a.predicted
        for a in admitted
        if a.first and a.admitted and a.predicted is not None
    ]
    return {
        "predicted_ttft_miss_p50_s": q(miss, 50),
        "predicted_ttft_miss_p90_s": q(miss, 90),
        "requests": len(got),
        "refusals": sum(len(a.refusals) for a in got),
        "refused_requests": sum(1 for a in got if a.refusals),
        "refused_twice_or_more": sum(1 for a in got if len(a.refusals) > 1),
        # which bound refused: every 429, and the 429s met again on coming back as told
        "refusal_codes": dict(Counter(c for a in got for c in a.codes)),
        "refused_again_codes": dict(Counter(c for a in got for c in a.codes[1:])),
        "failed": sum(1 for a in got if a.status not in (200,)),
        "retry_after_error_p50": q(errors, 50),
        "retry_after_error_p90": q(errors, 90),
        "ttft_p50_s": q(ttft, 50),
        "ttft_p90_s": q(ttft, 90),
        "met_budget": len(met) / len(ttft) if ttft else None,
        "goodput_per_s": len(good) / (t1 - t0),
        "goodput_vs_capacity": len(good) / (t1 - t0) / cap if cap else None,
        "answered_vs_capacity": len(answered) / (t1 - t0) / cap if cap else None,
        "run_s": end - t0,
        "run_goodput_vs_capacity": len(met_all) / (end - t0) / cap if cap else None,
        "run_answered_vs_capacity": len(admitted) / (end - t0) / cap if cap else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--log-level", "WARNING"]
    flags += ["--max-queued-requests", str(args.max_queued_requests), "--no-access-log"]
    if args.model:
        flags += ["--model", args.model]
    proc = start_serve(port, flags, timeout_s=180.0)
    out: dict[str, Any] = {"args": vars(args)}
    try:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=300.0, limits=limits
        ) as http:
            await capacity(http, args.max_num_seqs, 2.0, args.max_tokens)  # warm-up
            cap = await capacity(http, 2 * args.max_num_seqs, args.capacity_s, args.max_tokens)
            out["capacity_per_s"] = cap
            print(f"capacity: {cap:.1f} requests/s", flush=True)
            for factor in args.factors:
                for budget in (None, args.budget_ms):
                    got, t0, t1 = await overload(
                        http, factor * cap, args.duration_s, args.max_tokens, budget
                    )
                    row = summarize(got, t0, t1, cap, budget, args.budget_ms)
                    name = f"{factor:g}x {'budget' if budget else 'no budget'}"
                    out[name] = row
                    print(f"{name}: {json.dumps(row, default=_round)}", flush=True)
                    await asyncio.sleep(2.0)  # promises lapse, the queue empties
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def _round(x: Any) -> Any:
    return round(x, 3) if isinstance(x, float) else x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: tiny-random preset)")
    add_flags(
        p,
        max_num_seqs=8,
        max_queued_requests=16,
        max_tokens=32,
        capacity_s=8.0,
        duration_s=10.0,
    )
    p.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--budget-ms", type=float, default=1000.0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args()
    out = asyncio.run(run(args))
    text = json.dumps(out, indent=2, default=_round)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
