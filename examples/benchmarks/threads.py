"""The thread policy on a busy host: single-stream decode tok/s at 1 and 2 torch threads, on a
quiet host and with one competing CPU-bound process (``python -c "while 1: pass"``), under
OpenMP wait policies (``--policies``): ``default`` (GNU libgomp's, spinning ~300,000 rounds for
the next parallel region), ``passive`` (``OMP_WAIT_POLICY=PASSIVE``, ``KMP_BLOCKTIME=0``: sleep at
once), ``spinN`` (``GOMP_SPINCOUNT=N`` with the wait policy unset: spin N rounds, then sleep)
and ``api`` (no variable set: what ``LLM`` gets by itself: bounded spinning and the thread
governor, engine/threads.py, engine/thread_governor.py).
OpenMP reads these when torch loads, so each measurement is its own process. torch's CPU
wheel links GNU libgomp (``torch/lib/libgomp.so.1``), which reads ``GOMP_SPINCOUNT``.

Each measurement: a fresh process loads the SmolLM2-135M-shaped config with dummy weights
(fp32, ``threads=N``), warms up, then decodes ``--max-tokens`` tokens for one ``--prompt-len``
-token prompt (greedy, ``ignore_eos``) ``--trials`` times; its tok/s is the median. The
configurations run in interleaved rounds (``--rounds``), so a change of the host's load hits
them alike; the report is each configuration's median over rounds and the busy / quiet ratio.

Target: with one competing process, 2-thread single-stream decode >= 0.5x its quiet figure.

Usage::

    python -m examples.benchmarks.threads [--rounds 3] [--max-tokens 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
WAIT_KEYS = ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


def policy_env(name: str) -> dict[str, str]:
    """The environment of a wait policy: ``default``, ``passive`` or ``spinN`` (N >= 0).

    Raises:
        ValueError: another name.
    """
    if name == "default":
        # libgomp's own default (300,000 rounds where OMP_WAIT_POLICY is unset), named: the
        # engine's import would set its bounded spinning otherwise (engine/threads.py)
        return {"GOMP_SPINCOUNT": "300000"}
    if name == "passive":
        return dict(PASSIVE_ENV)
    if name == "api":  # nothing set: what the entry point itself gives (engine/threads.py)
        return {}
    if name.startswith("spin") and name[4:].isdigit():
        return {"GOMP_SPINCOUNT": name[4:]}
    raise ValueError(f"unknown wait policy {name!r}; expected default, passive, api or spinN")


def child(args) -> int:
    """One measurement (in its own process): prints ``{"tok_s": ...}``. The engine is imported
    before torch, as a user's program does (``api``: the engine's import then sets passive
    waiting; torch first would measure OpenMP's default instead, engine/threads.py)."""
    from prefixgate.engine import LLM, SamplingParams
    from torch import get_num_threads

    llm = LLM(args.model, load_format="dummy", dtype="float32", device="cpu", threads=args.threads)
    assert get_num_threads() == args.threads
    prompt = list(range(10, 10 + args.prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    rates = []
    for _ in range(args.trials):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0].outputs[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - t0))
    print(json.dumps({"tok_s": statistics.median(rates)}))
    return 0


def run_one(args, threads: int, busy: bool, policy: str) -> float:
    env = dict(os.environ)
    for k in WAIT_KEYS:
        env.pop(k, None)
    env.update(policy_env(policy))
    hog = None
    if busy:
        hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        cmd = [
            sys.executable,
            "-m",
            "examples.benchmarks.threads",
            "--child",
            "--threads",
            str(threads),
            "--model",
            args.model,
            "--max-tokens",
            str(args.max_tokens),
            "--prompt-len",
            str(args.prompt_len),
            "--trials",
            str(args.trials),
        ]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            # a collapse: under 1 token per ``--timeout`` seconds; recorded, the run goes on
            print(f"  {policy} threads={threads} busy={busy}: over {args.timeout:.0f} s, 0 tok/s")
            return 0.0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed: {out.stderr[-2000:]}")
    rate = float(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
    print(f"  {policy} threads={threads} busy={busy}: {rate:.2f} tok/s", flush=True)
    return rate


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-shape"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads-list", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--policies", nargs="+", default=["default", "passive", "spin1000", "spin10000"]
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument(
        "--settings",
        action="store_true",
        help="print the OpenMP waiting and torch threads this process got, as JSON, and exit",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.settings:
        from prefixgate.engine.threads import openmp_settings

        print(json.dumps(openmp_settings()))
        return 0
    if args.child:
        return child(args)
    for name in args.policies:
        policy_env(name)  # an unknown name fails before any measurement
    configs = [
        (t, busy, policy)
        for policy in args.policies
        for t in args.threads_list
        for busy in (False, True)
    ]
    rates: dict[tuple, list[float]] = {c: [] for c in configs}
    load = [f"{os.getloadavg()[0]:.2f}"]
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            rates[c].append(run_one(args, *c))
    load.append(f"{os.getloadavg()[0]:.2f}")
    print(
        f"\nthreads: single-stream decode, {Path(args.model).name} dummy fp32, "
        f"{args.max_tokens} tokens, median of {args.rounds} rounds, "
        f"affinity CPUs {len(os.sched_getaffinity(0))}, load {load[0]} -> {load[1]}"
    )
    print(
        f"{'omp wait':9} {'threads':>7} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>10}"
    )
    table = []
    for name in args.policies:
        for t in args.threads_list:
            q = statistics.median(rates[(t, False, name)])
            b = statistics.median(rates[(t, True, name)])
            ratio = f"{b / q:10.2f}" if q else f"{'-':>10}"
            print(f"{name:9} {t:7d} {q:12.1f} {b:11.1f} {ratio}")
            table.append(
                {
                    "omp_wait": name,
                    "threads": t,
                    "quiet_tok_s": q,
                    "busy_tok_s": b,
                    "quiet_runs": rates[(t, False, name)],
                    "busy_runs": rates[(t, True, name)],
                }
            )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"meta": {"args": vars(args), "load": load}, "results": table}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
