"""Batch-1 decode with the one-row GEMMs calibrated at load against oneDNN everywhere, in one
process (``engine/models/cpu_linear.py``: ``calibrate_one_row``).

One ``LLM`` (fp32, CPU, dummy weights of ``--model``) decodes ``--max-tokens`` tokens (greedy,
``ignore_eos``) for one ``--prompt-len``-token prompt, ``--rounds`` times under each setting, the
settings alternating within each round (a change of the host's load hits both alike): ``onednn``
(every linear's one-row GEMM set back to oneDNN's packed weight) and ``calibrated`` (the kinds
the loader chose). Each measurement gives tok/s in wall time and per second of process CPU
time (``time.process_time``: steadier than wall time on a host other processes share). The
report: medians, the ratio calibrated / onednn, and whether both settings gave the same tokens.

Usage::

    python -m examples.benchmarks.one_row [--threads 1] [--rounds 4] [--max-tokens 48]
        [--model DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The measurements (see the module docstring) as a JSON-ready dict."""
    from prefixgate.engine import LLM, SamplingParams
    from prefixgate.engine.models.cpu_linear import OneDNNLinear, one_row_extra_bytes

    load_start = os.getloadavg()[0]
    llm = LLM(
        str(args.model), load_format="dummy", dtype="float32", device="cpu", threads=args.threads
    )
    model = llm.engine.runner.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, OneDNNLinear)}
    chosen = {n: m.one_row for n, m in layers.items()}
    kinds = sorted({f"{m.out_features}x{m.in_features} {m.one_row}" for m in layers.values()})
    extra = one_row_extra_bytes(model)
    prompt = list(range(100, 100 + args.prompt_len))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    wall: dict[str, list[float]] = {"onednn": [], "calibrated": []}
    cpu: dict[str, list[float]] = {"onednn": [], "calibrated": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for setting in ("onednn", "calibrated"):
            for name, m in layers.items():
                m.set_one_row(chosen[name] if setting == "calibrated" else "onednn")
            t0, c0 = time.perf_counter(), time.process_time()
            out = llm.generate([prompt], sp)
            wall[setting].append(args.max_tokens / (time.perf_counter() - t0))
            cpu[setting].append(args.max_tokens / max(time.process_time() - c0, 1e-9))
            tokens.setdefault(setting, list(out[0].outputs[0].token_ids))
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "threads": args.threads,
        "load": [load_start, os.getloadavg()[0]],
        "one_row_kinds": kinds,
        "extra_bytes": extra,
        "wall_tok_s": wall,
        "cpu_tok_s": cpu,
        "ratio_wall": med["calibrated"] / med["onednn"],
        "ratio_cpu": med_cpu["calibrated"] / med_cpu["onednn"],
        "same_tokens": tokens["onednn"] == tokens["calibrated"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    res = run(args)
    print(f"threads {res['threads']}, load average {res['load'][0]:.1f} -> {res['load'][1]:.1f}")
    print(
        f"one-row GEMMs: {', '.join(res['one_row_kinds'])}; extra {res['extra_bytes'] / 1e6:.0f} MB"
    )
    for setting in ("onednn", "calibrated"):
        w, c = res["wall_tok_s"][setting], res["cpu_tok_s"][setting]
        print(
            f"{setting:10s} wall tok/s {statistics.median(w):6.1f} ({min(w):.1f}-{max(w):.1f})"
            f"  per CPU s {statistics.median(c):6.1f} ({min(c):.1f}-{max(c):.1f})"
        )
    print(
        f"calibrated / onednn: wall {res['ratio_wall']:.2f}x, CPU {res['ratio_cpu']:.2f}x; "
        f"same tokens: {res['same_tokens']}"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
