"""Why batched throughput swings: a per-step trace of rounds of one batch on ``LLMEngine``.

Each round adds ``--num-requests`` prompts of ``--prompt-len`` tokens at once (greedy,
``--output-len`` tokens, ``ignore_eos``) and steps until they finish. Each step records its
wall time, the process's CPU time (``time.process_time``: all threads), minor page faults and
involuntary context switches (``getrusage``), the requests it served and the Python GC runs
during it (``gc.callbacks``). Per round it prints output tok/s, the number of steps and their
kinds (by rows served), the totals, the decode steps' wall and CPU time (min / median / max)
and the load average: wall swinging with CPU time steady points at the host; page faults that
vary from round to round at the allocator; GC of generation 2 at Python; a change of step
kinds at scheduling or preemption. Findings: docs/cpu-performance.md.

    python -m examples.benchmarks.step_trace [--rounds 3] [--num-requests 32]
        [--prompt-len 128] [--output-len 64] [--threads 2] [--kv-mib 1024] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time
from typing import Any

from prefixgate.sdk.bench.shared import shared_dir

from examples.benchmarks.options import add_common_options, parse_with_threads, write_results


def trace_round(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> list[dict]:
    """Add ``prompts`` at once and step until all finish; one record per step."""
    runs: list[int] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(int(info["generation"]))

    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    steps = []
    gc.callbacks.append(on_gc)
    try:
        while engine.has_unfinished_requests():
            ru0, c0, t0, g0 = (
                resource.getrusage(resource.RUSAGE_SELF),
                time.process_time(),
                time.perf_counter(),
                len(runs),
            )
            outs = engine.step()
            t1, c1, ru1 = (
                time.perf_counter(),
                time.process_time(),
                resource.getrusage(resource.RUSAGE_SELF),
            )
            steps.append(
                {
                    "wall_s": t1 - t0,
                    "cpu_s": c1 - c0,
                    "minflt": ru1.ru_minflt - ru0.ru_minflt,
                    "nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
                    "outputs": len(outs),
                    "gc": runs[g0:],
                }
            )
    finally:
        gc.callbacks.remove(on_gc)
    return steps


def summary(steps: list[dict], n: int, output_len: int, wall: float) -> dict:
    """A round's figures (see the module docstring)."""
    decode = [s for s in steps if s["outputs"] == n]

    def spread(key: str) -> list[float]:
        v = sorted(s[key] * 1000 for s in decode)
        return [round(v[0], 1), round(statistics.median(v), 1), round(v[-1], 1)] if v else []

    return {
        "tok_s": round(n * output_len / wall, 1),
        "steps": len(steps),
        "outputs_per_step": [s["outputs"] for s in steps if s["outputs"] != n],
        "full_decode_steps": len(decode),
        "cpu_s": round(sum(s["cpu_s"] for s in steps), 2),
        "minflt": sum(s["minflt"] for s in steps),
        "nivcsw": sum(s["nivcsw"] for s in steps),
        "gc_runs": sum(len(s["gc"]) for s in steps),
        "gc_gen2": sum(s["gc"].count(2) for s in steps),
        "decode_wall_ms": spread("wall_s"),
        "decode_cpu_ms": spread("cpu_s"),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(shared_dir() / "models" / "smollm2-135m-shape"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=1024)
    add_common_options(ap, "write every round's figures and steps here")
    args = parse_with_threads(ap)
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine
    from prefixgate.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            dtype="float32",
            device="cpu",
            threads=args.threads,
            kv_cache_memory=args.kv_mib << 20,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n = args.num_requests
    rounds = []
    for r in range(args.rounds):
        prompts = [
            [10 + (i * 7 + r * 13 + k) % 40000 for k in range(args.prompt_len)] for i in range(n)
        ]
        t0 = time.perf_counter()
        steps = trace_round(engine, prompts, params, f"r{r}")
        s = summary(steps, n, args.output_len, time.perf_counter() - t0)
        print(f"round {r}: {s}", flush=True)
        rounds.append({"summary": s, "steps": steps})
    write_results(args.json_out, {"args": vars(args), "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
