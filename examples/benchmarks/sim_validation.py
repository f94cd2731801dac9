"""The simulated engine against the real one on the same trace (``docs/sim.md``, "Validation").

    python -m examples.benchmarks.sim_validation --model ../shared/models/aidreams-260k \\
        --profile cpu-aidreams-260k --json out.json

A seeded trace (Poisson arrivals, prompts of a few shared prefixes plus a unique tail, fixed
output lengths) goes to two engine replicas, each prefix always to the same replica (prefix
index mod 2), so both sides see the same per-replica traces and the comparison is of the
engines, not of a routing decision. Real: two ``LLMEngine``s on the model, one process each
(1 torch thread), stepping in wall time as requests arrive. Simulated: two ``LLMEngine``s
with ``runner="sim"`` and the profile, on a virtual clock, the same KV block count. Reported:
TTFT p50 / p90 and the prefix-cache hit rate of each side, and their ratios. Not HTTP: the
gateway's time is in neither side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from typing import Any

import numpy as np

from examples.benchmarks.options import add_flags


def make_trace(
    n: int, rate: float, prefixes: int, prefix_tokens: int, tail_tokens: int, seed: int
) -> list[tuple[float, int, list[int], int]]:
    """``(arrival_s, prefix index, prompt ids, max_tokens)`` per request, in arrival order."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, 250, prefix_tokens).tolist() for _ in range(prefixes)]
    t = 0.0
    out = []
    for _ in range(n):
        t += float(rng.exponential(1.0 / rate))
        p = int(rng.integers(prefixes))
        out.append((t, p, heads[p] + rng.integers(3, 250, tail_tokens).tolist(), 16))
    return out


def _params(max_tokens: int) -> Any:
    from prefixgate.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def run_real(engine: Any, trace: list[tuple[float, int, list[int], int]], t0: float) -> dict:
    """Drive ``engine`` in wall time from ``t0``; ``{request id: (ttft_s, cached)}``."""
    pending = list(enumerate(trace))
    result: dict[str, tuple[float, int]] = {}
    arrival: dict[str, float] = {}
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and pending[0][1][0] <= now:
            i, (t, _, prompt, m) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, _params(m))
            arrival[f"r{i}"] = t
        if engine.has_unfinished_requests():
            for out in engine.step():
                rid = out.request_id
                if rid not in result and out.delta_token_ids:
                    result[rid] = (time.monotonic() - t0 - arrival[rid], out.num_cached_tokens)
        elif pending:
            time.sleep(max(0.0, pending[0][1][0] - (time.monotonic() - t0)))
    return result


def run_sim(engine: Any, clock: Any, trace: list[tuple[float, int, list[int], int]]) -> dict:
    """The same on ``engine`` (``runner="sim"``) over ``clock`` (a ``VirtualClock``)."""
    pending = list(enumerate(trace))
    result: dict[str, tuple[float, int]] = {}
    arrival: dict[str, float] = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= clock.t:
            i, (t, _, prompt, m) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, _params(m), arrival_time=t)
            arrival[f"r{i}"] = t
        if engine.has_unfinished_requests():
            for out in engine.step():
                rid = out.request_id
                if rid not in result and out.delta_token_ids:
                    result[rid] = (clock.t - arrival[rid], out.num_cached_tokens)
        elif pending:
            clock.t = pending[0][1][0]
    return result


def _real_part(common: dict, trace: list, t0: float) -> dict:
    """One real replica in its own process: load, warm up, then the trace from ``t0``."""
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(threads=1, **common))
    eng.add_request("warm", list(range(3, 40)), _params(4))  # first-forward costs out
    while eng.has_unfinished_requests():
        eng.step()
    if time.monotonic() > t0:
        raise RuntimeError("the replica loaded after the trace's start: raise --start-delay-s")
    return run_real(eng, trace, t0)


def summary(results: list[dict], trace: list[tuple[float, int, list[int], int]]) -> dict:
    ttft = [v[0] for r in results for v in r.values()]
    cached = sum(v[1] for r in results for v in r.values())
    total = sum(len(p) for _, _, p, _ in trace)
    return {
        "ttft_p50_s": float(np.quantile(ttft, 0.5)),
        "ttft_p90_s": float(np.quantile(ttft, 0.9)),
        "hit_rate": cached / total,
        "requests": len(ttft),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.benchmarks.sim_validation",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--model", required=True, help="the real engine's model folder")
    ap.add_argument(
        "--profile",
        default="cpu-aidreams-260k",
        help="the simulated side's cost profile: a built-in name or a sim_fit JSON "
        "(default: cpu-aidreams-260k)",
    )
    add_flags(
        ap,
        requests=(120, "requests in the trace"),
        rate=(40.0, "requests/s over both replicas"),
        prefixes=(6, "shared prefixes (each always on the same replica)"),
        prefix_tokens=(64, "tokens of each shared prefix"),
        tail_tokens=(16, "unique tokens after the prefix, per request"),
        num_kv_blocks=(64, "KV blocks per replica, both sides"),
        seed=(0, "the trace's seed"),
        start_delay_s=(30.0, "seconds the real replicas have to load before the trace starts"),
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write the report here")
    args = ap.parse_args(argv)

    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine
    from prefixgate.engine.sim_runner import VirtualClock

    trace = make_trace(
        args.requests, args.rate, args.prefixes, args.prefix_tokens, args.tail_tokens, args.seed
    )
    parts = [[r for r in trace if r[1] % 2 == k] for k in range(2)]
    common = dict(model=args.model, num_kv_blocks=args.num_kv_blocks, device="cpu", seed=0)
    # one process per real replica (as replicas run): two engine threads in one process
    # would share the interpreter lock
    t0 = time.monotonic() + args.start_delay_s  # CLOCK_MONOTONIC: the same in both processes
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        real_out = pool.starmap(_real_part, [(common, parts[k], t0) for k in range(2)])
    sim_out = []
    for k in range(2):
        clock = VirtualClock()
        eng = LLMEngine(
            EngineConfig(runner="sim", sim_profile=args.profile, **common), sim_clock=clock
        )
        sim_out.append(run_sim(eng, clock, parts[k]))
    r, s = summary(real_out, trace), summary(sim_out, trace)
    report = {
        "real": r,
        "sim": s,
        "ttft_p50_sim_over_real": s["ttft_p50_s"] / r["ttft_p50_s"],
        "ttft_p90_sim_over_real": s["ttft_p90_s"] / r["ttft_p90_s"],
        "hit_rate_diff": s["hit_rate"] - r["hit_rate"],
        "config": vars(args),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
