"""Fair share across tenants: FCFS vs the fair (VTC) scheduling policy, side by side.

Two tenants on the SmolLM2-135M-shaped config with dummy weights, driven in-process through
``LLMEngine`` (one step loop, wall clock):

- tenant A keeps ``--a-backlog`` (64) long requests outstanding: ``--a-prompt`` (1,024)-token
  prompts, ``--a-output`` tokens each; a new one is queued as soon as one finishes;
- tenant B sends one short request per ``--b-interval`` second(s) (``--b-prompt`` tokens,
  ``--b-output`` tokens).

The same arrival script runs under ``fcfs`` and ``fair`` side by side: one process, the two
engines stepping in turn on one clock, so the host's load (shared, varying) weighs on both
alike; each engine gets about half the CPU, so absolute times are about twice a lone
engine's. After ``--duration`` seconds no new
request arrives and the engine runs until every B request has its first token (so FCFS TTFTs
are measured, not censored). Reported per policy: B's TTFT p50 / p99, A's and the total
throughput (prompt + output tokens computed per second within the timed window), and the
largest service difference between the tenants over any interval in which both were
backlogged (weighted tokens ``w_in * input + w_out * output``, VTC's measure) against VTC's
bound ``2 * max(w_in * L_in + w_out * L_out)``. A PNG plots each tenant's cumulative service.

Targets: under fair, B's p99 TTFT <= 1/4 of FCFS's; total throughput within 5 % of FCFS's;
the service difference within VTC's bound.

The engine has seats (``--max-num-seqs`` 128) and KV blocks for every outstanding request:
what the tenants compete for is each step's token budget (``--max-num-batched-tokens`` 2,048,
i.e. about two 1,024-token prefills a step), which is where FCFS makes B wait behind A's queue.

By default the model keeps SmolLM2-135M's width (hidden 576, 9 heads, 3 KV heads, vocabulary
49,152) but only ``--layers`` (1) of its 30 layers, so that the 64 x 1,024-token backlog turns
over in minutes on a shared 2-core CPU (the scheduling decisions only depend on token counts,
not on depth).

Usage::

    python -m examples.benchmarks.fairness [--model DIR] [--duration 60] [--layers 1]
        [--threads N] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixgate.sdk.bench.shared import shared_dir

from examples.benchmarks.options import add_flags

SHARED = shared_dir()


@dataclass
class PolicyRun:
    """What one policy's run measured."""

    policy: str
    b_ttft_s: list[float] = field(default_factory=list)
    tokens_a: int = 0  # A's prompt tokens admitted + output tokens sampled within the window
    # (throughput: tokens of the rounds begun within the window, over that common time)
    tokens_total: int = 0
    busy_s: float = 0.0  # this engine's own step time within the window (the other's excluded)
    window_s: float = 0.0
    max_service_gap: float = 0.0
    preemptions: int = 0  # engine preemptions within the run (recomputes)
    displacements: int = 0  # of them, running requests displaced for a waiting one
    steps: int = 0  # this engine's steps within the window
    schedule_s: float = 0.0  # of its busy time, in the scheduler (schedule())
    forward_s: float = 0.0  # of its busy time, in the model's forward passes
    trace: list[tuple[float, float, float]] = field(default_factory=list)  # t, W_A, W_B

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.b_ttft_s)
        return {
            "policy": self.policy,
            "b_requests": len(ttft),
            "b_ttft_p50_s": statistics.median(ttft) if ttft else None,
            "b_ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "a_tokens_per_s": self.tokens_a / self.window_s,
            "total_tokens_per_s": self.tokens_total / self.window_s,
            # per second of the engine's own steps: the engines step in turn, so the window
            # rate counts tokens per step; a policy whose steps are cheaper shows here
            "total_tokens_per_busy_s": self.tokens_total / self.busy_s if self.busy_s else 0.0,
            "max_service_gap": self.max_service_gap,
            "preemptions": self.preemptions,
            "displacements": self.displacements,
            "steps": self.steps,
            "tokens_per_step": self.tokens_total / self.steps if self.steps else 0.0,
            "schedule_ms_per_step": 1000 * self.schedule_s / self.steps if self.steps else 0.0,
            "forward_ms_per_step": 1000 * self.forward_s / self.steps if self.steps else 0.0,
        }


def _percentile_ok(x: float | None) -> float:
    return float("nan") if x is None else x


class _Side:
    """One policy's engine and bookkeeping in the side-by-side run."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        from prefixgate.engine.config import EngineConfig
        from prefixgate.engine.llm_engine import LLMEngine

        cfg = EngineConfig(
            model=str(args.model),
            load_format="dummy",
            dtype="float32",
            device="cpu",
            hf_overrides={"num_hidden_layers": args.layers} if args.layers else {},
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            # room for every outstanding request at once: the contention measured is the
            # step's token budget (prefill), not KV blocks
            num_kv_blocks=(args.a_backlog + 16) * (-(-(args.a_prompt + args.a_output) // 16)),
            scheduling_policy=policy,
            fair_input_weight=args.w_in,
            fair_output_weight=args.w_out,
        )
        self.engine = LLMEngine(cfg)
        self.run = PolicyRun(policy)
        self.a_live: set[str] = set()
        self.b_waiting: set[str] = set()  # B requests without a first token yet
        self.n_a = 0
        self.tokens = 0
        self.interval_start: tuple[float, float] | None = None


def run_side_by_side(args: argparse.Namespace) -> list[PolicyRun]:
    """Run the two-tenant script under every policy of ``args.policies`` in one process, the
    engines stepping in turn on one clock and one arrival script (so the machine's load, which
    varies on a shared host, weighs on every policy alike)."""
    import torch
    from prefixgate.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    sides = [_Side(args, policy) for policy in args.policies]
    vocab = sides[0].engine.model_config.vocab_size
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:  # distinct random ids: no prefix-cache hits
        return [rng.randrange(3, vocab) for _ in range(n)]

    for side in sides:  # warm-up (first forward passes allocate; not timed)
        side.engine.add_request("warm", prompt(args.a_prompt), SamplingParams(max_tokens=2))
        while side.engine.has_unfinished_requests():
            side.engine.step()

    pa = SamplingParams(temperature=0.0, max_tokens=args.a_output, ignore_eos=True)
    pb = SamplingParams(temperature=0.0, max_tokens=args.b_output, ignore_eos=True)
    a_prompts = [prompt(args.a_prompt) for _ in range(args.a_backlog * 2)]  # reused in turn
    arrivals: dict[str, float] = {}
    n_b = 0
    base = {id(s): s.engine.stats()["tenants"] for s in sides}
    tok0 = {id(s): _tokens(s.engine) for s in sides}
    pre0 = {
        id(s): (s.engine.stats()["num_preemptions"], s.engine.stats().get("num_displacements", 0))
        for s in sides
    }
    t0 = time.monotonic()
    next_b = t0
    window_end = t0 + args.duration
    while True:
        now = time.monotonic()
        open_ = now < window_end
        new_b: list[tuple[str, list[int], float]] = []
        while open_ and next_b <= now:
            rid = f"B{n_b}"
            n_b += 1
            new_b.append((rid, prompt(args.b_prompt), next_b))
            arrivals[rid] = next_b
            next_b += args.b_interval
        if not open_ and not any(s.b_waiting for s in sides):
            break
        for side in sides:
            eng, run = side.engine, side.run
            for rid, ids, at in new_b:
                eng.add_request(rid, ids, pb, arrival_time=at, tenant="B")
                side.b_waiting.add(rid)
            while open_ and len(side.a_live) < args.a_backlog:
                rid = f"A{side.n_a}"
                ids = a_prompts[side.n_a % len(a_prompts)]
                ids = [side.n_a % 1000 + 3, *ids[1:]]  # first token differs: no cache hit
                side.n_a += 1
                eng.add_request(rid, ids, pa, arrival_time=time.monotonic(), tenant="A")
                side.a_live.add(rid)
            if not eng.has_unfinished_requests():
                continue
            began = time.monotonic()
            timing = dict(eng.timing)
            outs = eng.step()
            done = time.monotonic()
            if open_:
                run.busy_s += done - began
                run.steps += eng.timing["steps"] - timing["steps"]
                run.schedule_s += eng.timing["schedule_s"] - timing["schedule_s"]
                run.forward_s += eng.timing["forward_s"] - timing["forward_s"]
            for out in outs:
                rid = out.request_id
                if rid in side.b_waiting and out.delta_token_ids:
                    side.b_waiting.discard(rid)
                    run.b_ttft_s.append(done - arrivals[rid])
                if out.finished:
                    side.a_live.discard(rid)
            tenants = eng.stats()["tenants"]
            b0 = base[id(side)]
            w_a = _served(tenants.get("A"), args) - _served(b0.get("A"), args)
            w_b = _served(tenants.get("B"), args) - _served(b0.get("B"), args)
            run.trace.append((done - t0, w_a, w_b))
            if open_:  # rounds begun in the window count (throughput): as many for each
                run.tokens_total = _tokens(eng) - tok0[id(side)]
                run.tokens_a = _raw(tenants.get("A")) - _raw(b0.get("A"))
            both = all(tenants.get(t, {}).get("num_waiting", 0) > 0 for t in ("A", "B"))
            if both:
                if side.interval_start is None:
                    side.interval_start = (w_a, w_b)
                start_a, start_b = side.interval_start
                gap = abs((w_a - start_a) - (w_b - start_b))
                run.max_service_gap = max(run.max_service_gap, gap)
            else:
                side.interval_start = None
        if open_:  # one window for all: the end of the last round begun in it
            for side in sides:
                side.run.window_s = time.monotonic() - t0
    for side in sides:  # A's backlog is left: abort it, the pool must end whole
        eng = side.engine
        s = eng.stats()
        side.run.preemptions = s["num_preemptions"] - pre0[id(side)][0]
        side.run.displacements = s.get("num_displacements", 0) - pre0[id(side)][1]
        for rid in list(eng.scheduler.requests):
            eng.abort_request(rid)
        eng.step()
        eng.check_invariants()
        assert eng.stats()["kv_blocks_used"] == 0
    return [side.run for side in sides]


def _served(row: dict | None, args: argparse.Namespace) -> float:
    """VTC's weighted service of one tenant (unweighted by tenant weight)."""
    if not row:
        return 0.0
    return args.w_in * row["served_input_tokens"] + args.w_out * row["served_output_tokens"]


def _raw(row: dict | None) -> int:
    if not row:
        return 0
    return row["served_input_tokens"] + row["served_output_tokens"]


def _tokens(engine: Any) -> int:
    s = engine.stats()
    return s["prompt_tokens_prefilled"] + s["tokens_decoded"]


def plot(runs: list[PolicyRun], path: Path) -> None:
    """Cumulative service (weighted tokens) of each tenant over time, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), sharey=True)
    for ax, run in zip(axes, runs, strict=True):
        t = [x[0] for x in run.trace]
        ax.plot(t, [max(x[1], 1) for x in run.trace], label="tenant A (64 backlogged, long)")
        ax.plot(t, [max(x[2], 1) for x in run.trace], label="tenant B (1 short req/s)")
        ax.set_yscale("log")
        ax.set_title(f"{run.policy}: cumulative service")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("weighted tokens served (w_in·in + w_out·out)")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    p.add_argument("--layers", type=int, default=1, help="layers kept (0 = all 30)")
    p.add_argument("--duration", type=float, default=60.0, help="arrival window, seconds")
    add_flags(
        p,
        a_backlog=64,
        a_prompt=1024,
        a_output=16,
        b_interval=1.0,
        b_prompt=32,
        b_output=16,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        w_in=1.0,
        w_out=2.0,
        threads=2,
        seed=0,
    )
    p.add_argument("--policies", nargs="+", default=["fcfs", "fair"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"model config not found: {args.model} (set PREFIXGATE_SHARED or --model)")
        return 2
    runs = run_side_by_side(args)
    rows = [r.summary() for r in runs]
    bound = 2 * max(
        args.w_in * args.a_prompt + args.w_out * args.a_output,
        args.w_in * args.b_prompt + args.w_out * args.b_output,
    )
    print(
        f"{'policy':8} {'B reqs':>6} {'B TTFT p50':>11} {'B TTFT p99':>11} "
        f"{'A tok/s':>9} {'total tok/s':>12} {'tok/busy s':>11} {'max service gap':>16} "
        f"{'preempt/displ':>14}"
    )
    for r in rows:
        print(
            f"{r['policy']:8} {r['b_requests']:>6} {_percentile_ok(r['b_ttft_p50_s']):>10.2f}s "
            f"{_percentile_ok(r['b_ttft_p99_s']):>10.2f}s {r['a_tokens_per_s']:>9.0f} "
            f"{r['total_tokens_per_s']:>12.0f} {r['total_tokens_per_busy_s']:>11.0f} "
            f"{r['max_service_gap']:>16.0f} "
            f"{r['preemptions']:>7}/{r['displacements']:<6}"
        )
    for r in rows:
        print(
            f"{r['policy']:8} steps {r['steps']}, {r['tokens_per_step']:.1f} tokens/step, "
            f"schedule {r['schedule_ms_per_step']:.2f} ms/step, "
            f"forward {r['forward_ms_per_step']:.2f} ms/step"
        )
    print(f"VTC bound on the service gap: 2 * max request cost = {bound:.0f} weighted tokens")
    by = {r["policy"]: r for r in rows}
    checks = {}
    if "fcfs" in by and "fair" in by:
        f, g = by["fcfs"], by["fair"]
        ttft_ratio = g["b_ttft_p99_s"] / f["b_ttft_p99_s"]
        thr_ratio = g["total_tokens_per_s"] / f["total_tokens_per_s"]
        checks = {
            "b_p99_ttft_fair_over_fcfs": ttft_ratio,
            "b_p99_ttft_target_met": ttft_ratio <= 0.25,
            "throughput_fair_over_fcfs": thr_ratio,
            "throughput_target_met": abs(thr_ratio - 1) <= 0.05,
            "fair_service_gap": g["max_service_gap"],
            "vtc_bound": bound,
            "service_gap_target_met": g["max_service_gap"] <= bound,
        }
        print(
            f"fair/fcfs: B p99 TTFT {ttft_ratio:.3f} (target <= 0.25: "
            f"{'met' if checks['b_p99_ttft_target_met'] else 'MISSED'}), total throughput "
            f"{thr_ratio:.3f} (target 0.95-1.05: "
            f"{'met' if checks['throughput_target_met'] else 'MISSED'}), fair service gap "
            f"{g['max_service_gap']:.0f} <= bound {bound:.0f}: "
            f"{'met' if checks['service_gap_target_met'] else 'MISSED'}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": cfg, "runs": rows, "checks": checks}, indent=1))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
