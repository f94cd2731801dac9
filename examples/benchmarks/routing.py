"""Routing across engine replicas: prefix hit rate, TTFT and load per ``--routing`` policy.

Three ``prefixgate serve`` engine replicas (the tiny-random preset by default, one process
each) behind one gateway per policy in upstream mode (``--routing``), all started at once;
each policy's requests go in ``--rounds`` slices taken in turn (the order rotating), so a
shared machine's load spikes hit every policy alike. The workload: 12 system
prompts (the workload CSV's real system prompts, cut to ``--system-chars``) with skewed
popularity (Zipf, s = 1.1) and several users each (their own user turn); streamed, with
usage, ``--concurrency`` in flight. Each phase uses its own 12 prompts (a phase tag in the
text), so no phase finds another's blocks cached.

Per policy: prefix hit rate (cached / prompt tokens, from the answers' usage), TTFT p50/p99
(first content chunk) and requests per replica (the gateway's ``/ready``); "single" is one
replica served directly, the hit rate the others are held against. Then a hot-prompt phase
(one prompt takes ``--hot-share`` of the requests): requests per replica and the most loaded
replica's share over the mean.

Targets: cache_aware hit rate >= 90 % of a single replica's, cache_aware TTFT p50 <= 0.6x
round_robin's, and with one hot prompt no replica serving more than 1.5x the mean.

Usage::

    python -m examples.benchmarks.routing [--requests 48] [--concurrency 6] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prefixgate.sdk.bench.targets import free_port
from prefixgate.sdk.bench.workload import SAMPLE_SYSTEM_PROMPTS, SAMPLE_USER_TASKS

from examples.benchmarks.options import add_flags

POLICIES = ("cache_aware", "rendezvous", "round_robin", "least_loaded")


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """``prefixgate serve ARGS`` on a free loopback port; returns (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--port", str(port)]
        + ["--no-access-log", "--stats-interval-s", "0", "--log-level", "WARNING", *args],
        stdout=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(urls: list[str], procs: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for url, proc in zip(urls, procs, strict=True):
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{url} did not become ready")
            time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def prompt_texts(path: str | os.PathLike[str] = SAMPLE_SYSTEM_PROMPTS) -> list[str]:
    """The ``prompt`` column of a system-prompts CSV file."""
    with open(path, newline="") as f:
        return [row["prompt"] for row in csv.DictReader(f)]


def system_prompts(tag: str, n: int, chars: int) -> list[str]:
    texts = prompt_texts()
    out = []
    for i in range(n):
        body = " ".join(texts[(i + j) % len(texts)] for j in range(4))
        out.append(f"[{tag} assistant {i}] " + body[:chars])
    return out


def user_turns(
    n: int, chars: int = 120, path: str | os.PathLike[str] = SAMPLE_USER_TASKS
) -> list[str]:
    """The first ``n`` instructions of a user-tasks JSONL file, each cut to ``chars`` characters."""
    with open(path) as f:
        return [json.loads(line)["instruction"][:chars] for line in itertools.islice(f, n)]


def workload(
    tag: str, n: int, args: argparse.Namespace, hot: float = 0.0, seed: int = 0
) -> list[dict]:
    """``n`` chat bodies: Zipf-popular system prompts (or one hot one) x users."""
    rng = random.Random(seed)
    systems = system_prompts(tag, args.prompts, args.system_chars)
    users = user_turns(args.users * args.prompts)
    weights = [1.0 / (i + 1) ** 1.1 for i in range(args.prompts)]
    bodies = []
    for _ in range(n):
        if hot and rng.random() < hot:
            p = 0
        else:
            p = (
                rng.choices(range(args.prompts), weights)[0]
                if not hot
                else rng.randrange(1, args.prompts)
            )
        u = p * args.users + rng.randrange(args.users)
        bodies.append(
            {
                "model": "any",
                "messages": [
                    {"role": "system", "content": systems[p]},
                    {"role": "user", "content": f"user {u}: {users[u % len(users)]}"},
                ],
                "max_tokens": args.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


async def stream_result(resp: httpx.Response, t0: float) -> dict:
    """Read a streamed chat completion to its end: ``ttft`` (seconds from ``t0``, a
    ``time.perf_counter()`` value, to the first chunk with choices; None if none came), and the
    ``prompt`` and ``cached`` tokens of its last ``usage`` (0 when absent)."""
    ttft = None
    usage = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if ttft is None and chunk.get("choices"):
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            usage = chunk["usage"]
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "prompt": (usage or {}).get("prompt_tokens", 0), "cached": cached}


async def one(client: httpx.AsyncClient, url: str, body: dict, model: str) -> dict:
    t0 = time.perf_counter()
    async with client.stream(
        "POST", url + "/v1/chat/completions", json={**body, "model": model}
    ) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                code = json.loads(raw)["error"].get("code") or ""
            except (ValueError, KeyError, TypeError, AttributeError):
                code = ""
            return {"error": f"{resp.status_code} {code}".strip()}
        return await stream_result(resp, t0)


async def drive(url: str, bodies: list[dict], concurrency: int, model: str) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def run(body: dict) -> dict:
            async with sem:
                return await one(client, url, body, model)

        return await asyncio.gather(*(run(b) for b in bodies))


def interleave(
    targets: dict[str, str],
    phase: str,
    n: int,
    hot: float | None,
    args: argparse.Namespace,
    model: str,
) -> dict[str, list[dict]]:
    """Each target's own workload (``n`` requests, its own prompts), sent in ``--rounds``
    slices taken in turn, the order rotating each round: a load spike on the shared machine
    falls on every policy alike instead of on whichever phase ran during it."""
    loads = {name: workload(name + phase, n, args, hot=hot or 0.0) for name in targets}
    out: dict[str, list[dict]] = {name: [] for name in targets}
    names = list(targets)
    size = -(-n // args.rounds)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            part = loads[name][r * size : (r + 1) * size]
            if part:
                out[name] += asyncio.run(drive(targets[name], part, args.concurrency, model))
    return out


def served(gateway: str) -> list[int]:
    ready = httpx.get(gateway + "/ready", timeout=5).json()
    return [u["served"] for u in ready["upstreams"]]


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] for r in ok)
    prompt = sum(r["prompt"] for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": dict(collections.Counter(str(r["error"]) for r in results if "error" in r)),
        "hit_rate": sum(r["cached"] for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        if ttfts
        else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model of the replicas (default tiny-random)")
    add_flags(
        ap,
        replicas=3,
        prompts=12,
        users=(4, "users per system prompt"),
        system_chars=600,
        requests=(48, "requests per policy"),
        hot_requests=36,
        hot_share=0.6,
        concurrency=6,
        max_tokens=4,
        balance_abs_threshold=2,
        rounds=(6, "slices per phase, policies taken in turn"),
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    engine_args = ["--num-kv-blocks", "4096", "--max-model-len", "2048"]
    if args.model:
        engine_args += ["--model", args.model]
    replicas = [start(engine_args) for _ in range(args.replicas)]
    procs = [p for p, _ in replicas]
    urls = [u for _, u in replicas]
    results: dict[str, dict] = {}
    try:
        wait_ready(urls, procs)
        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        # Warm-up: every replica's first request (lazy initialisation) off the clock.
        for url in urls:
            asyncio.run(drive(url, workload("warmup", 2, args), 1, model))
        t0 = time.monotonic()
        gateways = {
            policy: start(
                [f"--upstream={u}" for u in urls]
                + ["--routing", policy, "--balance-abs-threshold", str(args.balance_abs_threshold)]
            )
            for policy in POLICIES
        }
        try:
            wait_ready([u for _, u in gateways.values()], [g for g, _ in gateways.values()])
            targets = {"single": urls[0]} | {p: u for p, (_, u) in gateways.items()}
            main_out = interleave(targets, "", args.requests, None, args, model)
            before = {p: served(u) for p, (_, u) in gateways.items()}
            hot_out = interleave(
                {p: u for p, (_, u) in gateways.items()},
                "-hot",
                args.hot_requests,
                args.hot_share,
                args,
                model,
            )
            results["single"] = summarize(main_out["single"])
            for policy, (_, gw_url) in gateways.items():
                row = summarize(main_out[policy])
                row["per_replica"] = before[policy]
                per = [a - b for a, b in zip(served(gw_url), before[policy], strict=True)]
                row["hot_per_replica"] = per
                row["hot_max_over_mean"] = max(per) / (sum(per) / len(per)) if sum(per) else 0
                row["hot_hit_rate"] = summarize(hot_out[policy])["hit_rate"]
                results[policy] = row
        finally:
            stop([g for g, _ in gateways.values()])
        wall = time.monotonic() - t0
    finally:
        stop(procs)

    load = os.getloadavg()[0]
    base = results["single"]["hit_rate"] or 1.0
    rr = results["round_robin"]["ttft_p50_ms"]
    print(
        f"routing over {args.replicas} replicas, {args.requests} requests per policy, "
        f"concurrency {args.concurrency}, {wall:.0f} s, load average {load:.1f}"
    )
    print(
        f"{'policy':<13}{'hit rate':>9}{'vs single':>10}{'TTFT p50':>10}{'p99':>9}"
        f"{'p50/rr':>8}  {'requests per replica':<22}{'hot: per replica':<18}{'max/mean':>8}"
    )
    for name, row in results.items():
        print(
            f"{name:<13}{row['hit_rate']:>9.1%}{row['hit_rate'] / base:>10.2f}"
            f"{row['ttft_p50_ms']:>8.1f}ms{row['ttft_p99_ms']:>7.1f}ms"
            f"{row['ttft_p50_ms'] / rr:>8.2f}  {str(row.get('per_replica', '-')):<22}"
            f"{str(row.get('hot_per_replica', '-')):<18}"
            f"{row.get('hot_max_over_mean', float('nan')):>8.2f}"
        )
        if row["errors"]:
            kinds = ", ".join(f"{k}: {n}" for k, n in row["error_kinds"].items())
            print(f"  {name}: {row['errors']} requests failed ({kinds or 'no first token'})")
    ca = results["cache_aware"]
    targets = {
        "cache_aware hit rate >= 90% of single": ca["hit_rate"] >= 0.9 * base,
        "cache_aware TTFT p50 <= 0.6x round_robin": ca["ttft_p50_ms"] <= 0.6 * rr,
        "hot prompt: no replica > 1.5x mean (cache_aware)": ca["hot_max_over_mean"] <= 1.5,
    }
    for name, met in targets.items():
        print(f"target {name}: {'met' if met else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "targets": targets}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
