"""Fit a step cost profile (``cost_model.CostProfile``) to this machine's real engine.

    python -m prefixgate.engine.sim_fit --model ../shared/models/aidreams-260k --out prof.json

Runs the real ``LLMEngine`` on a few workloads that compose steps differently (prefill chunks
of several sizes alone and batched, fresh and over a cached prefix, decode batches of several
widths and context lengths),
times every step's runner call (``ModelRunner.execute``: batch building, forward, sampling;
the scheduler's own host time is not in it, because the simulated engine runs the real
scheduler and only replaces the runner), and fits ``step_s = a + b * prefill_tokens +
c * decode_rows + d * context_tokens + e * continued_rows`` (``cost_model``) by least absolute
deviations (iteratively reweighted
numpy ``lstsq``: a shared machine's timing spikes do not pull the line; a coefficient that
comes out negative is fixed at 0 and the rest refitted). With ``--wall`` it also times first
steps after idle spells of several lengths and fits the profile's wake-up term to them
(``collect_wake``, ``fit_wake``). Prints the profile and the fit's error
and writes it as JSON for ``--sim-profile FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np

COLUMNS = (
    "a_s",
    "b_s_per_prefill_token",
    "c_s_per_decode_row",
    "d_s_per_context_token",
    "e_s_per_continued_row",
)


def workloads(max_len: int) -> list[tuple[int, int, int, int]]:
    """``(requests, prompt_tokens, max_tokens, shared_tokens)`` per workload, within ``max_len``
    tokens; ``shared_tokens`` > 0: the prompts share that many leading tokens, which one request
    run before them has cached (their prefill rows continue a context)."""
    out = []
    for prompt in (8, 24, 48, 80):
        for batch in (1, 3, 6):
            out.append((batch, prompt, 4, 0))
    for shared, tail in ((32, 8), (48, 24), (64, 16)):
        for batch in (1, 3, 6):
            out.append((batch, shared + tail, 4, shared))
    for batch in (1, 4, 8, 16):
        out.append((batch, 8, max(8, min(96, max_len - 16)), 0))
    return [(b, p, m, s) for b, p, m, s in out if p + m < max_len]


def collect(
    engine: Any, repeats: int = 2, clock: Any = time.thread_time, whole_step: bool = False
) -> list[tuple[int, int, int, int, float]]:
    """Run the workloads on ``engine`` (an ``LLMEngine``) and return one ``(prefill_tokens,
    decode_rows, context_tokens, continued_rows, seconds)`` per timed step. ``clock``: the thread's CPU time
    by default (with one torch thread, the step's work without the waits a shared machine
    adds), or ``time.perf_counter`` (wall time). ``whole_step``: time all of
    ``LLMEngine.step`` (the scheduler's host work too: the profile for a virtual clock, on
    which the simulated engine's host work is free) rather than the runner call alone (the
    profile for ``serve --runner sim``, whose scheduler runs for real)."""
    from prefixgate.engine.sampling_params import SamplingParams
    from prefixgate.engine.sim_runner import SimRunner

    rows: list[tuple[int, int, int, int, float]] = []
    runner = engine.runner
    execute = runner.execute
    shapes: list[Any] = []

    def timed(sched_out: Any) -> Any:
        shapes.append(SimRunner.shape(sched_out.scheduled))
        t0 = clock()
        out = execute(sched_out)
        if not whole_step:
            s = shapes.pop()
            rows.append(_row(s, clock() - t0))
        return out

    def step() -> None:
        t0 = clock()
        engine.step()
        if whole_step and shapes:
            s = shapes.pop()
            rows.append(_row(s, clock() - t0))
        shapes.clear()

    runner.execute = timed
    vocab = engine.model_config.vocab_size
    n = 0
    try:
        for rep in range(repeats + 1):  # the first pass warms up, its rows are dropped
            if rep == 1:
                rows.clear()
            for w, (batch, prompt, max_tokens, shared) in enumerate(
                workloads(engine.max_model_len)
            ):
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                head = [
                    3 + (rep * 7907 + w * 6151 + i * 104723) % (vocab - 3) for i in range(shared)
                ]
                if shared:  # its blocks cached first, in steps of their own (not timed)
                    engine.add_request(f"fit-prefix-{rep}-{w}", head + [3], params)
                    while engine.has_unfinished_requests():
                        engine.step()
                for _ in range(batch):
                    n += 1
                    tail = [
                        3 + (n * 7919 + i * 104729) % (vocab - 3) for i in range(prompt - shared)
                    ]
                    engine.add_request(f"fit-{n}", head + tail, params)
                while engine.has_unfinished_requests():
                    step()
    finally:
        runner.execute = execute
    return rows


WAKE_GAPS_S = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3)
"""Idle spells (seconds) ``collect_wake`` times a first step after; 0: back to back."""

WAKE_TAUS_S = (0.003, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5)
"""The time constants ``fit_wake`` tries (seconds)."""


def collect_wake(
    engine: Any,
    repeats: int = 12,
    clock: Any = time.perf_counter,
    whole_step: bool = False,
    sleep: Any = time.sleep,
) -> list[tuple[float, float]]:
    """``(idle_s, seconds)`` per timed step: the first step (a 16-token prompt after a 64-token
    cached prefix) of a request added after the engine idled ``idle_s`` (each of
    ``WAKE_GAPS_S``, ``repeats`` times, interleaved), timed as ``collect`` times a step. Wall
    time only means something here: an idle CPU's cost (a halted virtual CPU, cold caches) is
    time, not work."""
    from prefixgate.engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    head = [3 + (i * 104723) % (vocab - 3) for i in range(64)]
    runner = engine.runner
    execute = runner.execute
    took: list[float] = []

    def timed(sched_out: Any) -> Any:
        t0 = clock()
        out = execute(sched_out)
        took.append(clock() - t0)
        return out

    engine.add_request("wake-prefix", head + [3], params)
    while engine.has_unfinished_requests():
        engine.step()
    rows: list[tuple[float, float]] = []
    runner.execute = timed
    n = 0
    try:
        for rep in range(repeats + 1):  # the first pass warms up, its rows are dropped
            if rep == 1:
                rows.clear()
            for gap in WAKE_GAPS_S:
                n += 1
                tail = [3 + (n * 7919 + i * 104729) % (vocab - 3) for i in range(16)]
                sleep(gap)  # the last request's decode steps ended just now: idle from here
                engine.add_request(f"wake-{n}", head + tail, params)
                took.clear()
                t0 = clock()
                engine.step()
                seconds = clock() - t0 if whole_step else took[0]
                rows.append((gap, seconds))
                while engine.has_unfinished_requests():
                    engine.step()
    finally:
        runner.execute = execute
    return rows


def fit_wake(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """``(wake_s, wake_tau_s)`` of ``CostProfile.wake_up_s`` from ``collect_wake``'s rows:
    the median step after each idle spell over the median back to back (idle 0), fitted to
    ``wake_s * (1 - exp(-idle / tau))`` by least squares for each tau of ``WAKE_TAUS_S``
    (``wake_s`` >= 0), keeping the tau of the smallest sum of absolute residuals (medians: a
    shared machine's descheduled steps do not pull it). ``(0.0, 0.1)`` without rows back to
    back or after an idle spell."""
    by_gap: dict[float, list[float]] = {}
    for gap, seconds in rows:
        by_gap.setdefault(gap, []).append(seconds)
    base = by_gap.pop(0.0, None)
    if not base or not by_gap:
        return 0.0, 0.1
    floor = float(np.median(base))
    gaps = np.array(sorted(by_gap))
    extra = np.array([float(np.median(by_gap[g])) - floor for g in gaps])
    best = (math.inf, 0.0, 0.1)
    for tau in WAKE_TAUS_S:
        g = -np.expm1(-gaps / tau)
        wake = max(0.0, float(g @ extra / (g @ g)))
        err = float(np.abs(wake * g - extra).sum())
        if err < best[0]:
            best = (err, wake, tau)
    return best[1], best[2]


def _row(shape: Any, seconds: float) -> tuple[int, int, int, int, float]:
    return (
        shape.prefill_tokens,
        shape.decode_rows,
        shape.context_tokens,
        shape.continued_rows,
        seconds,
    )


IRLS_ROUNDS = 30
"""Rounds of iteratively reweighted least squares (weights ``1/sqrt|residual|``: the least
absolute deviations fit), so the scheduling spikes of a shared machine do not pull the line."""


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``lstsq`` with each coefficient >= 0: a negative one is fixed at 0, the rest refitted."""
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return coef


def fit(rows: list[tuple[int, int, int, int, float]]) -> tuple[np.ndarray, dict[str, float]]:
    """Least-squares coefficients (``COLUMNS`` order, each >= 0) and the fit's errors
    (``median_rel_error``, ``p90_rel_error`` over the steps, ``r2``).

    Raises:
        ValueError: fewer than 8 steps.
    """
    if len(rows) < 8:
        raise ValueError(f"need at least 8 timed steps, got {len(rows)}")
    data = np.asarray(rows, dtype=np.float64)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2], data[:, 3]])
    y = data[:, 4]
    weights = np.ones(len(y))
    coef = np.zeros(len(COLUMNS))
    for _ in range(IRLS_ROUNDS):
        coef = _nonneg_lstsq(x * weights[:, None], y * weights)
        residual = np.abs(x @ coef - y)
        weights = 1.0 / np.sqrt(np.maximum(residual, 1e-3 * float(np.median(y))))
    pred = x @ coef
    rel = np.abs(pred - y) / y
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    return coef, {
        "median_rel_error": float(np.median(rel)),
        "p90_rel_error": float(np.quantile(rel, 0.9)),
        "r2": 1.0 - ss_res / ss_tot,
        "steps": len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefixgate.engine.sim_fit", description=__doc__
    )
    parser.add_argument(
        "--model", default=None, help="model folder or preset (default: tiny-random)"
    )
    parser.add_argument(
        "--name",
        default=None,
        help="the profile's name (default: fit-<model>, apart from the built-in cpu-<model>)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes (default: 2)")
    parser.add_argument("--out", default=None, help="write the profile JSON here")
    parser.add_argument(
        "--wall", action="store_true", help="time wall clock, not the thread's CPU time"
    )
    parser.add_argument(
        "--whole-step",
        action="store_true",
        help="time all of LLMEngine.step (scheduler included): for prefixgate sim's virtual "
        "clock; default: the runner call alone, for serve --runner sim",
    )
    args = parser.parse_args(argv)
    from prefixgate.sdk.bench.output_file import check_output_file

    try:
        check_output_file("--out", args.out)  # written after the fit: refused before it
    except ValueError as exc:
        parser.error(str(exc))

    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.cost_model import CostProfile
    from prefixgate.engine.llm_engine import LLMEngine

    config = EngineConfig(model=args.model, threads=args.threads, device="cpu")
    engine = LLMEngine(config)
    clock = time.perf_counter if args.wall else time.thread_time
    rows = collect(engine, args.repeats, clock, args.whole_step)
    coef, quality = fit(rows)
    wake_s, wake_tau_s = 0.0, 0.1
    if args.wall:  # an idle spell's cost is wall time, not the thread's CPU time
        wake_s, wake_tau_s = fit_wake(collect_wake(engine, clock=clock, whole_step=args.whole_step))
    quality["wake_s"], quality["wake_tau_s"] = wake_s, wake_tau_s
    model = (args.model or "tiny-random").rstrip("/").split("/")[-1]
    profile = CostProfile(
        name=args.name or f"fit-{model}",
        a_s=float(coef[0]),
        b_s_per_prefill_token=float(coef[1]),
        c_s_per_decode_row=float(coef[2]),
        d_s_per_context_token=float(coef[3]),
        e_s_per_continued_row=float(coef[4]),
        wake_s=wake_s,
        wake_tau_s=wake_tau_s,
        num_kv_blocks=engine.num_kv_blocks,
        block_size=config.block_size,
        source=f"fitted by prefixgate.engine.sim_fit on {model}, {args.threads} thread(s), "
        f"{'wall' if args.wall else 'CPU'} time, {'whole step' if args.whole_step else 'runner'}"
        f", {quality['steps']} steps, median relative error {quality['median_rel_error']:.3f}",
    )
    doc = profile.to_json()
    print(json.dumps({"profile": doc, "fit": quality}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
