"""Precise prefix-cache routing against the others, on CPU replicas: hit rate, load, TTFT.

A scaled-down version of llm-d's multi-tenant workload: ``--tenants`` tenants, each with its
own long system prompt (the real prompts of the shared folder's ``workloads/system_prompts.csv``,
else the SDK's sample copy, cut to ``--system-tokens`` tokens of the model's tokenizer) and its
own cache partition (a request ``cache_salt`` per tenant), popularity Zipf (s = ``--zipf``), a
short user turn each, Poisson arrivals at ``--rate`` requests/s, streamed with usage. More
distinct prefixes than one replica's KV holds (``--num-kv-blocks``, printed). ``--warmup``
first sends each tenant's prompt once, one at a time and not measured (the steady state, as
a deployed app's prompts are: not every tenant's first request).

``--replicas`` engines (``prefixgate serve --kv-events``, one process each: aidreams-260k by
default; ``--model`` another, ``--load-format dummy`` for a weightless shape such as
smollm2-135m-shape, ``--layers N`` to cut it, ``--engine-threads`` torch threads each) and
``--gateways`` gateways per policy in upstream mode (``precise`` with ``--tokenizer`` and
``--upstream-kv-events``: each follows every engine's events; ``cache_aware``,
``round_robin``), all started at once, the client sending request ``i`` to gateway ``i mod
N``; "single" is one replica served directly (the hit rate the others are held against).
Each policy runs its own tenants' prompts (a phase tag in the text: no policy finds another's
blocks), one after the other, in the order given.

Per policy: prefix hit rate (cached / prompt tokens, from the answers' usage), requests per
replica (the gateways' ``/ready``, summed) and the hottest replica's over the mean, TTFT
p50/p90 (first chunk with choices) and round robin's p90 over it, and for ``precise`` its
predictions that equalled the reported cached tokens (``/metrics``) and its decisions by
reason (the warm-up's counted apart). ``--json`` keeps every TTFT and every request (Unix
send time, TTFT, prompt and cached tokens, tenant salt, gateway), ``--plot`` draws their CDFs
beside the hit rates (PNG), ``--log-dir`` keeps each precise gateway's picks (DEBUG log:
per request the cached tokens, queued prefill and load of every replica, the choice and its
reason; then the predicted beside the reported cached tokens).

Usage::

    python -m examples.benchmarks.precise_routing [--requests 120] [--rate 4] [--json OUT]
    python -m examples.benchmarks.precise_routing --model ../shared/models/smollm2-135m-shape
        --load-format dummy --layers 2 --engine-threads 1 --block-size 16 --num-kv-blocks 256
        --system-tokens 400 --requests 90 --rate 1.5 --warmup --plot precise.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
from prefixgate.sdk.bench.shared import find_shared
from prefixgate.sdk.bench.targets import free_port
from prefixgate.sdk.bench.workload import SAMPLE_SYSTEM_PROMPTS, SAMPLE_USER_TASKS

from examples.benchmarks.options import add_flags
from examples.benchmarks.routing import (
    prompt_texts,
    stop,
    stream_result,
    user_turns,
    wait_ready,
)

POLICIES = ("precise", "cache_aware", "round_robin", "single")
MODEL = "models/aidreams-260k"  # in the shared test-data folder (sdk.bench.shared)


_TAKEN: set[int] = set()  # ports handed out in this run (released ones are handed out again)


def own_port() -> int:
    """A free loopback port not handed out before in this run: the processes bind theirs a
    moment later, and the OS may hand a released port out twice meanwhile (a run failed on
    two replicas given one port)."""
    while True:
        port = free_port()
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def port_pair() -> int:
    """A free loopback port whose next port is free too (the KV events PUB + replay), neither
    handed out before in this run."""
    import socket

    while True:
        port = own_port()
        if port + 1 >= 65535 or port + 1 in _TAKEN:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        _TAKEN.add(port + 1)
        return port


def start(
    args: list[str], log: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``prefixgate serve ARGS`` on a free loopback port (access log off, warnings only);
    with ``log``, at DEBUG level (precise's per-request picks) into that file. Returns
    (process, base URL)."""
    port = own_port()
    level = "DEBUG" if log is not None else "WARNING"
    cmd = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--port", str(port)]
    cmd += ["--no-access-log", "--stats-interval-s", "0", "--log-level", level, *args]
    err = open(log, "w") if log is not None else None  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})}
    )
    if err is not None:
        err.close()
    return proc, f"http://127.0.0.1:{port}"


def cut_prompts(tokenizer, n: int, tokens: int, tag: str) -> list[str]:
    """``n`` system prompts of at most ``tokens`` tokens (the CSV's texts, tagged)."""
    texts = prompt_texts(find_shared("workloads/system_prompts.csv") or SAMPLE_SYSTEM_PROMPTS)
    out = []
    for i in range(n):
        text = f"[{tag} tenant {i}] " + texts[i % len(texts)]
        ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
        cut = tokenizer.decode(ids)
        while len(tokenizer.encode(cut, add_special_tokens=False)) > tokens:
            cut = cut[:-4]
        out.append(cut)
    return out


def users(n: int) -> list[str]:
    return user_turns(n, 40, find_shared("workloads/user_tasks.jsonl") or SAMPLE_USER_TASKS)


def workload(
    tokenizer, tag: str, args: argparse.Namespace, requests: int | None = None
) -> tuple[list[tuple[float, dict]], list[dict]]:
    """``requests`` (default ``--requests``) ``(arrival offset s, chat body)`` pairs (Zipf
    tenants, Poisson arrivals at ``args.rate``), and the warm-up: one body per tenant (its
    system prompt, another user turn) when ``--warmup``."""
    rng = random.Random(args.seed)
    systems = cut_prompts(tokenizer, args.tenants, args.system_tokens, tag)
    turns = users(50)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.tenants)]

    def body(tenant: int, turn: str) -> dict:
        return {
            "model": "any",
            "messages": [
                {"role": "system", "content": systems[tenant]},
                {"role": "user", "content": turn[: args.user_chars]},
            ],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": f"tenant-{tenant}",
        }

    t = 0.0
    out = []
    for _ in range(args.requests if requests is None else requests):
        t += rng.expovariate(args.rate)
        tenant = rng.choices(range(args.tenants), weights)[0]
        out.append((t, body(tenant, rng.choice(turns))))
    warm = [body(i, "warm up") for i in range(args.tenants)] if args.warmup else []
    return out, warm


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    sent = time.time()
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": resp.status_code, "body": (await resp.aread())[:200]}
        result = await stream_result(resp, t0)
    return {**result, "sent": sent, "salt": body.get("cache_salt"), "gateway": url}


async def drive(
    urls: list[str], load: list[tuple[float, dict]], model: str, warm: list[dict] = ()
) -> list[dict]:
    """The ``warm`` bodies one at a time (not measured), then ``load`` at its offsets; request
    ``i`` goes to ``urls[i % len(urls)]`` (a round-robin client over the gateways)."""
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as c:
        for i, body in enumerate(warm):
            await one(c, urls[i % len(urls)], {**body, "model": model})
        t0 = time.perf_counter()

        async def at(i: int, offset: float, body: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one(c, urls[i % len(urls)], {**body, "model": model})

        return await asyncio.gather(*(at(i, o, b) for i, (o, b) in enumerate(load)))


async def saturate(urls: list[str], bodies: list[dict], model: str, concurrency: int) -> float:
    """Closed loop: ``bodies`` sent with ``concurrency`` in flight (request ``i`` to
    ``urls[i % len(urls)]``); returns the completed requests per second (the fleet's capacity
    on this workload under the policy behind ``urls``)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as c:

        async def go(i: int, body: dict) -> bool:
            async with sem:
                return "error" not in await one(c, urls[i % len(urls)], {**body, "model": model})

        t0 = time.perf_counter()
        done = await asyncio.gather(*(go(i, b) for i, b in enumerate(bodies)))
        return sum(done) / (time.perf_counter() - t0)


def calibrate(urls: list[str], tokenizer, model: str, args: argparse.Namespace) -> float:
    """Round robin's capacity in requests/s on this workload (its own tenants' prompts,
    tagged ``calibrate``, warmed up like the measured phases): ``--calibrate-requests``
    bodies in a closed loop with two per replica in flight."""
    load, warm = workload(tokenizer, "calibrate", args, requests=args.calibrate_requests)
    asyncio.run(drive(urls, [], model, warm))
    return asyncio.run(saturate(urls, [b for _, b in load], model, 2 * args.replicas))


def scrape(gateways: list[str]) -> dict:
    """Summed over ``gateways``: requests served per replica (``/ready``, in upstream order),
    precise's predictions by result and decisions by reason (``/metrics``)."""
    per: list[int] = []
    res: dict[str, float] = {}
    dec: dict[str, float] = {}
    for g in gateways:
        ready = httpx.get(g + "/ready", timeout=10).json()
        served = [u["served"] for u in ready.get("upstreams", [])]
        per = [a + b for a, b in zip(per, served, strict=True)] if per else served
        text = httpx.get(g + "/metrics", timeout=10).text
        for m in re.finditer(
            r'prefixgate_route_predictions_total\{[^}]*result="(\w+)"[^}]*\} (\S+)', text
        ):
            res[m[1]] = res.get(m[1], 0) + float(m[2])
        for m in re.finditer(r'prefixgate_route_decisions_total\{reason="(\w+)"\} (\S+)', text):
            dec[m[1]] = dec.get(m[1], 0) + float(m[2])
    return {"per_replica": per, "predictions": res, "decisions": dec}


def minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def plot(rows: list[dict], path: str, title: str) -> None:
    """A PNG at ``path``: each policy's TTFT CDF (log time axis) beside its hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    for r in rows:
        xs = sorted(r["ttfts"])
        if xs:
            ax.step(
                xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r["policy"]
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.9, color="grey", lw=0.5, ls=":")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    names = [r["policy"] for r in rows]
    bars = bx.bar(names, [r["hit_rate"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    for b, r in zip(bars, rows, strict=True):
        hot = r.get("hot_over_mean")
        label = f"{r['hit_rate']:.2f}" + (f"\nhot {hot:.2f}" if hot else "")
        bx.text(
            b.get_x() + b.get_width() / 2,
            b.get_height(),
            label,
            ha="center",
            va="bottom",
            fontsize=7,
        )
    bx.set_ylim(0, 1.15)
    bx.set_ylabel("prefix hit rate (cached / prompt tokens)")
    bx.tick_params(axis="x", labelsize=7)
    fig.suptitle(textwrap.fill(title, 120), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(out: list[dict]) -> dict:
    ok = [o for o in out if "error" not in o]
    prompt = sum(o["prompt"] for o in ok)
    ttfts = [o["ttft"] for o in ok if o["ttft"] is not None]
    return {
        "requests": len(out),
        "errors": len(out) - len(ok),
        "hit_rate": sum(o["cached"] for o in ok) / prompt if prompt else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p90_s": pct(ttfts, 0.9),
        "ttfts": ttfts,
        "per_request": out,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    found = find_shared(MODEL)
    ap.add_argument("--model", default=str(found) if found else None)
    ap.add_argument(
        "--load-format", default="auto", help="the replicas' weights (dummy: random, for shapes)"
    )
    ap.add_argument("--layers", type=int, default=0, help="cut the model to N layers (0: all)")
    ap.add_argument(
        "--engine-threads", type=int, default=0, help="torch threads per replica (0: torch's)"
    )
    add_flags(
        ap,
        replicas=3,
        gateways=(1, "gateways per policy (round robin)"),
        tenants=24,
        system_tokens=80,
        user_chars=24,
        requests=(120, "per policy"),
        rate=(4.0, "Poisson arrivals, requests/s"),
        rate_of_capacity=(
            0.0,
            "instead of --rate: this fraction of round robin's capacity, measured first "
            "(closed loop, two requests per replica in flight); 0: off",
        ),
        calibrate_requests=30,
        zipf=1.1,
        max_tokens=4,
        block_size=8,
        num_kv_blocks=96,
    )
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="each tenant's prompt once, one at a time, before the measured requests",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    add_flags(
        ap,
        max_load_ratio=(1.3, "precise's X"),
        overlap_weight=(1.0, "precise's weight"),
        seed=0,
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a PNG of TTFT CDFs and hit rates")
    ap.add_argument(
        "--log-dir", default=None, help="precise gateways' DEBUG logs (their picks) go here"
    )
    args = ap.parse_args(argv)
    if not args.model:
        ap.error(f"no {MODEL} in the shared folder: pass --model")
    if args.gateways < 1:
        ap.error("--gateways must be >= 1")
    from prefixgate.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model)
    policies = [p for p in args.policies.split(",") if p]
    model = Path(args.model).name
    procs, urls, feeds = [], [], []
    engine_env = {}
    if args.engine_threads:
        n = str(args.engine_threads)
        engine_env = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
    engine_flags = ["--model", args.model, "--load-format", args.load_format]
    if args.layers:
        engine_flags += ["--hf-overrides", json.dumps({"num_hidden_layers": args.layers})]
    t_start = time.monotonic()
    try:
        for _ in range(args.replicas):
            ev = port_pair()
            proc, url = start(
                [
                    *engine_flags,
                    "--block-size",
                    str(args.block_size),
                    "--num-kv-blocks",
                    str(args.num_kv_blocks),
                    "--kv-events",
                    f"tcp://127.0.0.1:{ev}",
                ],
                env=engine_env,
            )
            procs.append(proc)
            urls.append(url)
            feeds.append(f"{url}=tcp://127.0.0.1:{ev}")
        gateways: dict[str, list[str]] = {}
        for policy in policies:
            if policy == "single":
                gateways[policy] = [urls[0]]
                continue
            extra = ["--routing", policy]
            if policy == "precise":
                extra += ["--tokenizer", args.model]
                extra += ["--precise-max-load-ratio", str(args.max_load_ratio)]
                extra += ["--precise-overlap-weight", str(args.overlap_weight)]
                for f in feeds:  # every gateway follows every engine's events
                    extra += ["--upstream-kv-events", f]
            flags = [x for u in urls for x in ("--upstream", u)]
            gateways[policy] = []
            for g in range(args.gateways):
                log = None
                if args.log_dir and policy == "precise":
                    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                    log = Path(args.log_dir) / f"{policy}-{g}.log"
                proc, url = start([*flags, *extra], log)
                procs.append(proc)
                gateways[policy].append(url)
        proxies = [u for p, us in gateways.items() if p != "single" for u in us]
        wait_ready(urls + proxies, procs, timeout=600)  # 3+ min to start at load 15+
        for g in gateways.get("precise", []):  # until its index holds every replica's snapshot
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                text = httpx.get(g + "/metrics", timeout=10).text
                if text.count("prefixgate_kv_index_synced{") == args.replicas and not re.search(
                    r"prefixgate_kv_index_synced\{[^}]*\} 0", text
                ):
                    break
                time.sleep(0.2)
        capacity = None
        if args.rate_of_capacity > 0:
            rr = gateways.get("round_robin")
            if rr is None:
                raise SystemExit("--rate-of-capacity needs round_robin among --policies")
            capacity = calibrate(rr, tokenizer, model, args)
            args.rate = args.rate_of_capacity * capacity
            print(
                f"round robin's capacity {capacity:.2f} requests/s: rate {args.rate:.2f}/s",
                file=sys.stderr,
            )
        blocks = args.tenants * (args.system_tokens // args.block_size)
        desc = (
            f"{args.replicas} replicas x {args.num_kv_blocks} KV blocks of {args.block_size} "
            f"tokens; {args.tenants} tenants x {args.system_tokens}-token system prompts "
            f"(~{blocks} blocks of prefixes: {blocks / args.num_kv_blocks:.1f}x one replica's "
            f"KV); {args.requests} requests per policy at {args.rate:.3g}/s (Poisson)"
            + (
                f" = {args.rate_of_capacity:g}x round robin's measured {capacity:.2f}/s"
                if capacity
                else ""
            )
            + (f"; {args.gateways} gateways per policy" if args.gateways > 1 else "")
            + ("; warmed up" if args.warmup else "")
        )
        print(desc, file=sys.stderr)
        rows = []
        for policy in policies:
            load, warm = workload(tokenizer, policy, args)
            proxied = policy != "single"
            if proxied:
                before = scrape(gateways[policy])
                asyncio.run(drive(gateways[policy], [], model, warm))
                mid = scrape(gateways[policy])
            else:
                asyncio.run(drive(gateways[policy], [], model, warm))
            out = asyncio.run(drive(gateways[policy], load, model))
            row = {"policy": policy, **summarize(out)}
            if proxied:
                after = scrape(gateways[policy])
                per = [a - b for a, b in zip(after["per_replica"], mid["per_replica"], strict=True)]
                row["per_replica"] = per
                row["hot_over_mean"] = max(per) / (sum(per) / len(per)) if sum(per) else 0.0
            if policy == "precise":
                row["predictions"] = minus(after["predictions"], mid["predictions"])
                row["decisions"] = minus(after["decisions"], mid["decisions"])
                row["warmup_decisions"] = minus(mid["decisions"], before["decisions"])
            rows.append(row)
    finally:
        stop(procs)
    single = next((r for r in rows if r["policy"] == "single"), None)
    rr = next((r for r in rows if r["policy"] == "round_robin"), None)
    print(
        f"{'policy':<12}{'hit':>6}{'/single':>8}{'hot/mean':>9}{'p50 ms':>8}{'p90 ms':>8}"
        f"{'rr/p90':>7}  per replica"
    )
    for r in rows:
        rel = r["hit_rate"] / single["hit_rate"] if single and single["hit_rate"] else float("nan")
        rr_over = rr["ttft_p90_s"] / r["ttft_p90_s"] if rr else float("nan")
        r["hit_vs_single"] = rel
        r["rr_p90_over_p90"] = rr_over
        print(
            f"{r['policy']:<12}{r['hit_rate']:>6.3f}{rel:>8.2f}"
            f"{r.get('hot_over_mean', 1.0):>9.2f}{r['ttft_p50_s'] * 1e3:>8.1f}"
            f"{r['ttft_p90_s'] * 1e3:>8.1f}{rr_over:>7.2f}  {r.get('per_replica', '-')}"
            + (f"  errors={r['errors']}" if r["errors"] else "")
        )
    for r in rows:
        if "predictions" in r:
            total = sum(r["predictions"].values())
            exact = r["predictions"].get("exact", 0)
            print(
                f"precise: predictions exact {exact:.0f}/{total:.0f}"
                f" ({exact / total if total else float('nan'):.3f}); decisions {r['decisions']}"
            )
    print(f"wall {time.monotonic() - t_start:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "capacity": capacity, "rows": rows}, indent=1)
        )
    if args.plot:
        plot(rows, args.plot, desc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
