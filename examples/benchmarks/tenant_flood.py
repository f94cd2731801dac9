"""A light tenant during a heavy tenant's flood, measured through the real gateway.

For each scheduling policy (``--policies``, default ``fcfs fair``) a fresh ``prefixgate serve``
process (built-in ``tiny-random`` preset unless ``--model``; ``--max-num-seqs`` seats) serves two
API keys, tenants ``heavy`` and ``light`` (weight 1 each). Then, over streaming HTTP:

1. **solo**: ``light`` sends short requests one after another (its TTFT: request sent ->
   first content chunk);
2. **flood**: ``heavy`` keeps ``--heavy-streams`` long streaming requests in flight (a new one as
   each ends) while ``light`` sends the same short requests again one after another; the
   window lasts until light's requests are done. Phases 1 and 2 alternate in ``--rounds``
   rounds (``--light-requests`` split among them), so that the host's varying load weighs
   on solo and flooded figures alike;
3. **both backlogged** (``--shares-s`` seconds, 0: skipped): ``heavy`` keeps its streams and
   ``light`` keeps ``--light-backlog`` streams of the same shape in flight, so both tenants
   have requests waiting throughout; each tenant's share of the tokens served in the window
   is its served share (weights 1 : 1: each is due half; the target is within 10 % of it).

Reported per policy: light's TTFT p50 / p99 solo and flooded (and their ratio: the issue's
target is <= 1.5x under ``fair``), each tenant's share of the tokens served during the flood,
total output tokens/s during it (``fair`` vs ``fcfs``: the cost of fairness), heavy's longest
wait for a first token and its longest stall between two tokens (a displaced stream's wait)
beside the starvation bound (the steps one heavy request takes alone, ``1 + heavy-tokens``,
times heavy's median step), and the engine's displacement count from ``/metrics``. Where
light's first tokens went: each light request's ``walk=`` from the server's access log
(``gateway/local/token_walk.py``: admission, hand-over to the engine, engine wait and steps
waited, its first step's size and time, delivery to the handler, the SSE write), p50 / p99 per
part, solo beside flooded. The offered
load is ``heavy-streams`` concurrent long requests against one short request at a time
(10 : 1 by default, in concurrent requests; far more in tokens). ``--light-requests-fcfs``
gives ``fcfs`` fewer light requests (each waits for the flood to drain: a few are enough for
its throughput, the reference of ``fair``'s). The load average is printed at the start of
each policy's server and at the end.

    python -m examples.benchmarks.tenant_flood [--json out.json]

Bounded: each policy's server lives about ``30 + solo + flood + shares`` seconds (about 2 minutes for
the defaults on a quiet 2-core machine). No timed assertion anywhere: figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from prefixgate.gateway.local.token_walk import parse_walk
from prefixgate.sdk.bench.targets import free_port, terminate

from examples.benchmarks.gateway_overhead import start_serve
from examples.benchmarks.options import add_flags, write_results

KEYS = {"heavy": "sk-heavy-tenant", "light": "sk-light-tenant"}


@dataclass(slots=True)
class Stream:
    """One streamed request's timings (monotonic seconds) and the arrival time of each content
    chunk (one a token: the gateway sends a chunk per engine step of the request)."""

    sent: float
    first: float | None = None
    chunks: list[float] = field(default_factory=list)
    status: int = 0


@dataclass(slots=True)
class Phase:
    light: list[Stream] = field(default_factory=list)
    heavy: list[Stream] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0


def start_server(
    port: int, policy: str, args: argparse.Namespace, keys: Path, log: IO[str]
) -> subprocess.Popen:
    """``prefixgate serve`` with the two tenants' keys under ``policy``, once ready; its log
    (access lines included) goes to ``log``."""
    base = policy.removesuffix("-mixed").removesuffix("-eager")
    flags = ["--scheduling-policy", base, "--keys-file", str(keys)]
    if policy == "fair-mixed":  # fair without the first step alone (nor anticipation)
        flags += ["--no-fair-first-step-alone", "--fair-anticipation-ms", "0"]
    if policy == "fair-eager":  # fair without anticipation: the previous round's fair
        flags += ["--fair-anticipation-ms", "0"]
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--log-level", "INFO"]
    flags += ["--max-queued-requests", "1024", "--stats-interval-s", "3600"]
    if args.model:
        flags += ["--model", args.model]
    flags += shlex.split(args.serve_args)
    return start_serve(port, flags, timeout_s=180.0, log=log)


def light_walks(log_text: str) -> list[dict[str, float]]:
    """The ``walk=`` of each light request's access line, in the order they ended."""
    out = []
    for line in log_text.splitlines():
        if "prefixgate.access" in line and " key=light " in line and " walk=" in line:
            out.append(parse_walk(line.split(" walk=", 1)[1].split()[0]))
    return out


def split_walks(
    walks: list[dict[str, float]], warmup: int, sizes: list[int]
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``(solo, flooded)`` walks of a server's light requests, which ran ``warmup`` first,
    then in each round ``sizes[i]`` solo and ``sizes[i]`` flooded, one after another."""
    at, solo, flood = warmup, [], []
    for size in sizes:
        solo += walks[at : at + size]
        flood += walks[at + size : at + 2 * size]
        at += 2 * size
    return solo, flood


def round_sizes(n: int, rounds: int) -> list[int]:
    """``n`` requests split into at most ``rounds`` rounds (at least one), as even as can be."""
    k = max(1, min(rounds, n))
    return [n // k + (i < n % k) for i in range(k)]


WALK_PARTS = ("admit", "to_engine", "wait", "steps", "step_tokens", "step_ms", "chunk")
WALK_PARTS += ("to_token", "deliver", "write")


def walk_summary(walks: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Part → (p50, p99) over ``walks``."""
    return {
        part: (pct(vals, 0.5), pct(vals, 0.99))
        for part in WALK_PARTS
        if (vals := [w[part] for w in walks if part in w])
    }


async def stream_one(
    http: httpx.AsyncClient,
    tenant: str,
    model: str,
    prompt: str,
    max_tokens: int,
    into: list[Stream],
) -> Stream:
    """One streaming chat request, recorded in ``into`` from its start (a request cut by the
    end of the window still counts what it got); TTFT = first chunk with content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    s = Stream(sent=time.monotonic())
    into.append(s)
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        s.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                if c.get("delta", {}).get("content"):
                    now = time.monotonic()
                    s.chunks.append(now)
                    if s.first is None:
                        s.first = now
    return s


async def run_shares(port: int, model: str, args: argparse.Namespace) -> Phase:
    """Both tenants backlogged: ``heavy`` keeps ``--heavy-streams`` long streams in flight and
    ``light`` keeps ``--light-backlog`` streams of the same shape (prompt and output length)
    in flight, for ``--shares-s`` seconds after a warm-up; the tokens each tenant got in that
    window are its served share (weights 1 : 1, so each is due half)."""
    phase = Phase()
    limits = httpx.Limits(max_connections=args.heavy_streams + args.light_backlog + 8)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
    ) as http:
        stop = asyncio.Event()

        async def worker(tenant: str, i: int, into: list[Stream]) -> None:
            while not stop.is_set():
                prompt = f"{tenant} tenant stream {i} " * 8
                await stream_one(http, tenant, model, prompt, args.heavy_tokens, into)

        workers = [
            asyncio.create_task(worker("heavy", i, phase.heavy)) for i in range(args.heavy_streams)
        ]
        workers += [
            asyncio.create_task(worker("light", i, phase.light)) for i in range(args.light_backlog)
        ]
        await asyncio.sleep(args.warmup_s)
        phase.t0 = time.monotonic()
        await asyncio.sleep(args.shares_s)
        phase.t1 = time.monotonic()
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return phase


async def run_phase(
    port: int, model: str, args: argparse.Namespace, flood: bool, n: int | None = None
) -> Phase:
    """``n`` (default ``--light-requests``) light requests one after another, during the
    heavy tenant's flood when ``flood``."""
    n = args.light_requests if n is None else n
    phase = Phase(t0=time.monotonic())
    limits = httpx.Limits(max_connections=args.heavy_streams + 8)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
    ) as http:
        stop = asyncio.Event()

        async def heavy_worker(i: int) -> None:
            while not stop.is_set():
                prompt = f"heavy tenant stream {i} " * 8
                await stream_one(http, "heavy", model, prompt, args.heavy_tokens, phase.heavy)

        workers = (
            [asyncio.create_task(heavy_worker(i)) for i in range(args.heavy_streams)]
            if flood
            else []
        )
        if flood:
            await asyncio.sleep(args.warmup_s)  # the flood holds every seat first
            phase.t0 = time.monotonic()  # the window: the flood's steady state
        for j in range(n):
            if args.light_think_s > 0:  # open the loop: arrivals off the step boundaries
                await asyncio.sleep(random.uniform(0.0, args.light_think_s))
            prompt = f"light tenant question {j}"
            await stream_one(http, "light", model, prompt, args.light_tokens, phase.light)
        stop.set()
        phase.t1 = time.monotonic()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return phase


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def ttfts(streams: list[Stream]) -> list[float]:
    return [s.first - s.sent for s in streams if s.first is not None]


COUNTERS = {
    "displacements": "prefixgate_engine_displacements",
    "anticipation_waits": "prefixgate_engine_anticipation_waits_total",
    "anticipation_hits": "prefixgate_engine_anticipation_hits_total",
    "anticipation_wait_s": "prefixgate_engine_anticipation_wait_seconds_total",
}
"""Engine figures read from ``/metrics`` at the end of a policy's run (None: absent)."""


def engine_counters(port: int) -> dict[str, float | None]:
    """:data:`COUNTERS` from the server's ``/metrics``."""
    auth = {"Authorization": f"Bearer {KEYS['light']}"}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth, timeout=5).text
    values = {line.split()[0]: line.split()[-1] for line in text.splitlines() if line[:1] != "#"}
    return {k: float(values[m]) if m in values else None for k, m in COUNTERS.items()}


@dataclass(slots=True)
class Run:
    """One policy's server and what its rounds measured so far."""

    policy: str
    args: argparse.Namespace
    port: int
    proc: subprocess.Popen
    log: IO[str]
    model: str = ""
    sizes: list[int] = field(default_factory=list)
    solos: list[Phase] = field(default_factory=list)
    floods: list[Phase] = field(default_factory=list)


def start_run(policy: str, args: argparse.Namespace, keys: Path) -> Run:
    """Start ``policy``'s server, warm it up (first-use costs) and split light's requests
    into its rounds."""
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    run = Run(policy, args, port, start_server(port, policy, args, keys, log), log)
    auth = {"Authorization": f"Bearer {KEYS['light']}"}
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=auth, timeout=5)
    run.model = models.json()["data"][0]["id"]
    asyncio.run(run_phase(port, run.model, args, flood=False))  # warm-up
    run.sizes = round_sizes(args.light_requests, args.rounds)
    return run


def run_round(run: Run, i: int) -> None:
    """Round ``i`` of ``run`` (if it has one): a solo phase, then a flooded one."""
    if i >= len(run.sizes):
        return
    n = run.sizes[i]
    run.solos.append(asyncio.run(run_phase(run.port, run.model, run.args, flood=False, n=n)))
    run.floods.append(asyncio.run(run_phase(run.port, run.model, run.args, flood=True, n=n)))


def measure(run: Run) -> dict[str, Any]:
    """The shares phase, then stop the server and summarize ``run``."""
    args, sizes, floods, solos = run.args, run.sizes, run.floods, run.solos
    policy, proc, log = run.policy, run.proc, run.log
    try:
        shares = asyncio.run(run_shares(run.port, run.model, args)) if args.shares_s > 0 else None
        counters = engine_counters(run.port)
    finally:
        terminate(proc)
    log.seek(0)
    walks = light_walks(log.read())
    log.close()
    solo_walks, flood_walks = split_walks(walks, args.light_requests, sizes)
    window = sum(f.t1 - f.t0 for f in floods)
    heavy_in_window = [s for f in floods for s in f.heavy if s.first is not None]

    def in_window(streams: list[Stream], ph: Phase) -> int:
        return sum(1 for s in streams for c in s.chunks if ph.t0 <= c <= ph.t1)

    light_tokens = sum(in_window(f.light, f) for f in floods)
    heavy_tokens = sum(in_window(f.heavy, f) for f in floods)
    solo = Phase(light=[s for p in solos for s in p.light])
    flood = Phase(
        light=[s for f in floods for s in f.light], heavy=[s for f in floods for s in f.heavy]
    )
    backlogged: dict[str, Any] = {}
    if shares is not None:
        sl, sh = in_window(shares.light, shares), in_window(shares.heavy, shares)
        sgaps = [
            b - a
            for s in shares.heavy + shares.light
            for a, b in zip(s.chunks, s.chunks[1:], strict=False)
        ]
        backlogged = {
            "backlogged_light_share": sl / max(1, sl + sh),
            "backlogged_tokens_per_s": (sl + sh) / (shares.t1 - shares.t0),
            "backlogged_longest_stall_s": max(sgaps, default=None),
            "backlogged_longest_ttft_s": max(
                (s.first - s.sent for s in shares.heavy + shares.light if s.first is not None),
                default=None,
            ),
        }
    gaps = [b - a for s in flood.heavy for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    solo_t, flood_t = ttfts(solo.light), ttfts(flood.light)
    return {
        "policy": policy,
        "light_ttft_solo_p50_s": pct(solo_t, 0.5),
        "light_ttft_solo_p99_s": pct(solo_t, 0.99),
        "light_ttft_flood_p50_s": pct(flood_t, 0.5),
        "light_ttft_flood_p99_s": pct(flood_t, 0.99),
        "p50_ratio": pct(flood_t, 0.5) / pct(solo_t, 0.5),
        "p99_ratio": pct(flood_t, 0.99) / pct(solo_t, 0.99),
        "light_token_share": light_tokens / max(1, light_tokens + heavy_tokens),
        "flood_output_tokens_per_s": (light_tokens + heavy_tokens) / window,
        "heavy_longest_ttft_s": max((s.first - s.sent for s in heavy_in_window), default=None),
        "heavy_longest_stall_s": max(gaps, default=None),
        "heavy_step_p50_s": pct(gaps, 0.5),
        "starvation_bound_s": (1 + args.heavy_tokens) * pct(gaps, 0.5) if gaps else None,
        "heavy_requests": len(flood.heavy),
        "light_walk_solo": walk_summary(solo_walks),
        "light_walk_flood": walk_summary(flood_walks),
        "failed": sum(
            1 for s in solo.light + flood.light + flood.heavy if s.status not in (0, 200)
        ),
        **counters,
        "window_s": window,
        "load_avg_1m": Path("/proc/loadavg").read_text().split()[0],
        **backlogged,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: built-in tiny-random)")
    p.add_argument(
        "--policies",
        nargs="+",
        default=["fcfs", "fair"],
        help="fcfs, priority, fair, fair-eager (fair with --fair-anticipation-ms 0) or "
        "fair-mixed (fair-eager with --no-fair-first-step-alone)",
    )
    add_flags(
        p,
        max_num_seqs=8,
        heavy_streams=10,
        heavy_tokens=256,
        light_requests=20,
        light_tokens=8,
        warmup_s=3.0,
    )
    add_flags(
        p, rounds=(4, "solo and flooded rounds, interleaved (light's requests split among them)")
    )
    p.add_argument(
        "--light-requests-fcfs",
        type=int,
        default=None,
        help="light's requests per phase under fcfs (default: --light-requests; each waits "
        "for the flood, so a few suffice for the throughput reference)",
    )
    add_flags(
        p,
        light_think_s=(
            0.0,
            "light pauses a uniform random 0..this many seconds before each request (0: the "
            "next request follows the last one's final token at once, i.e. just after a step "
            "boundary)",
        ),
        light_backlog=(
            8,
            "shares phase: light's streams in flight (heavy's shape), both tenants backlogged",
        ),
        shares_s=(15.0, "shares phase window (0: no such phase)"),
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="more `prefixgate serve` flags, one string (e.g. the SmolLM2 shape: "
        "'--load-format dummy --hf-overrides {\"num_hidden_layers\": 4}')",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        rows = [{"key": k, "name": name, "weight": 1.0} for name, k in KEYS.items()]
        keys.write_text(json.dumps({"keys": rows}))
        runs: list[Run] = []
        print(f"start: load average {Path('/proc/loadavg').read_text().strip()}")
        try:
            for policy in args.policies:  # every policy's server up at once
                pargs = argparse.Namespace(**vars(args))
                if policy == "fcfs" and args.light_requests_fcfs is not None:
                    pargs.light_requests = args.light_requests_fcfs
                runs.append(start_run(policy, pargs, keys))
            for i in range(max(len(r.sizes) for r in runs)):  # rounds interleaved
                for r in runs:
                    run_round(r, i)
                print(f"round {i + 1}: load average {Path('/proc/loadavg').read_text().strip()}")
            results = [measure(r) for r in runs]
        finally:
            for r in runs:
                if r.proc.poll() is None:
                    r.proc.kill()
        print(f"end: load average {Path('/proc/loadavg').read_text().strip()}")
    head = (
        f"{'policy':8} {'solo p50':>9} {'solo p99':>9} {'flood p50':>10} {'flood p99':>10} "
        f"{'p50 x':>6} {'p99 x':>6} {'light share':>11} {'tok/s':>7} {'heavy max':>9} {'displ':>6} {'fail':>4}"
    )
    print(head)
    for r in results:
        print(
            f"{r['policy']:8} {r['light_ttft_solo_p50_s']:9.3f} {r['light_ttft_solo_p99_s']:9.3f} "
            f"{r['light_ttft_flood_p50_s']:10.3f} {r['light_ttft_flood_p99_s']:10.3f} "
            f"{r['p50_ratio']:6.2f} {r['p99_ratio']:6.2f} {r['light_token_share']:11.3f} "
            f"{r['flood_output_tokens_per_s']:7.1f} {r['heavy_longest_ttft_s'] or 0:9.2f} "
            f"{r['displacements'] if r['displacements'] is not None else '-':>6} {r['failed']:4d}"
        )
    for r in results:
        print(
            f"{r['policy']}: heavy longest stall {r['heavy_longest_stall_s'] or 0:.2f} s, "
            f"starvation bound {r['starvation_bound_s'] or 0:.2f} s "
            f"(1 + {args.heavy_tokens} steps x {r['heavy_step_p50_s']:.4f} s)"
        )
        if r.get("anticipation_waits") is not None:
            print(
                f"  anticipation: {r['anticipation_waits']:.0f} waits, "
                f"{r['anticipation_hits'] or 0:.0f} ended by the tenant's request, "
                f"{(r['anticipation_wait_s'] or 0) * 1e3:.0f} ms waited in all"
            )
        if "backlogged_light_share" in r:
            print(
                f"  both backlogged ({args.shares_s:.0f} s, light {args.light_backlog} streams): "
                f"light's token share {r['backlogged_light_share']:.3f} (due 0.500), "
                f"{r['backlogged_tokens_per_s']:.1f} tokens/s, longest stall "
                f"{r['backlogged_longest_stall_s'] or 0:.2f} s, longest first token "
                f"{r['backlogged_longest_ttft_s'] or 0:.2f} s"
            )
        print("  light's first-token walk, p50 / p99 (ms; steps, tokens counted): solo | flood")
        for part in WALK_PARTS:
            a = r["light_walk_solo"].get(part)
            b = r["light_walk_flood"].get(part)
            if a is None and b is None:
                continue
            show = lambda v: "-" if v is None else f"{v[0]:8.1f} / {v[1]:8.1f}"  # noqa: E731
            print(f"  {part:12} {show(a):>19} | {show(b):>19}")
    if len(results) > 1:
        base = results[0]["flood_output_tokens_per_s"]
        for r in results[1:]:
            ratio = r["flood_output_tokens_per_s"] / base
            print(f"throughput {r['policy']} / {results[0]['policy']}: {ratio:.2f}")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
