"""Structured-output overhead benchmark: decode tokens/s of N constrained requests
against N unconstrained ones, in the same process, on the same engine, alternating rounds.

Model: the SmolLM2-135M-shaped config with dummy weights (``load_format="dummy"``). Constrained
requests carry a JSON schema (an array of ``minItems`` objects with an enum, a bounded integer,
a boolean and a string), so the grammar cannot end before ``--output-len`` tokens and both
groups decode the same number of tokens. Grammars are compiled (and cached) before timing; the
compile time of the first, cold compilation is reported separately.

Decode tokens/s = output tokens of decode-only steps / their wall-clock seconds (prefill steps
excluded, as the mask is applied to sampled rows only); per CPU second too (process CPU time,
steadier than wall clock on a shared machine). Target: constrained within 10 % of
unconstrained. Rounds alternate (unconstrained, constrained, ...) and the median is compared.

Usage::

    python -m examples.benchmarks.structured_outputs [--num-requests 32] [--output-len 32]
        [--rounds 2] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

from examples.benchmarks.options import add_common_options, parse_with_threads, write_results

SHARED = shared_dir()

SCHEMA = {
    "type": "array",
    "minItems": 16,
    "maxItems": 16,
    "items": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
            "name": {"type": "string", "maxLength": 12},
        },
        "required": ["kind", "n", "ok", "name"],
        "additionalProperties": False,
    },
}


def decode_rate(llm, prompts: list[list[int]], params: list) -> dict:
    """Run the prompts together, stepping by hand; tokens/s over decode-only steps."""
    eng = llm.engine
    tag = time.perf_counter_ns()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"bench-{tag}-{i}", p, sp)
    decode_s = decode_cpu_s = 0.0
    decode_tokens = 0
    total_tokens = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        prefilled = eng.stats()["prompt_tokens_prefilled"]
        ts, cs = time.perf_counter(), time.process_time()
        outs = eng.step()
        dt, dc = time.perf_counter() - ts, time.process_time() - cs
        n = sum(len(o.delta_token_ids) for o in outs)
        total_tokens += n
        if eng.stats()["prompt_tokens_prefilled"] == prefilled:
            decode_s += dt
            decode_cpu_s += dc
            decode_tokens += n
    return {
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tok_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "decode_tok_per_cpu_s": decode_tokens / decode_cpu_s if decode_cpu_s else 0.0,
        "output_tokens": total_tokens,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-shape"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per group")
    add_common_options(ap)
    args = parse_with_threads(ap)

    import torch
    from prefixgate.engine import LLM, SamplingParams
    from prefixgate.engine.sampling_params import StructuredOutputsParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        kv_cache_memory=1 << 29,
        max_num_seqs=args.num_requests,
        enable_prefix_caching=False,
    )
    spec = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, structured_outputs=spec))  # compile
    compile_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        [(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
        for i in range(args.num_requests)
    ]
    common = dict(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    free = [SamplingParams(seed=i, **common) for i in range(args.num_requests)]
    constrained = [
        SamplingParams(seed=i, structured_outputs=spec, **common) for i in range(args.num_requests)
    ]
    rates: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for _ in range(args.rounds):
        rates["unconstrained"].append(decode_rate(llm, prompts, free))
        rates["constrained"].append(decode_rate(llm, prompts, constrained))
    llm.check_invariants()

    med = {k: statistics.median(r["decode_tok_per_s"] for r in v) for k, v in rates.items()}
    med_cpu = {k: statistics.median(r["decode_tok_per_cpu_s"] for r in v) for k, v in rates.items()}
    ratio = med["constrained"] / med["unconstrained"]
    ratio_cpu = med_cpu["constrained"] / med_cpu["unconstrained"]
    print(
        f"\nbench_structured: {Path(args.model).name} (load_format={args.load_format}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.num_requests} "
        f"requests, prompt {args.prompt_len} tok, output {args.output_len} tok"
    )
    print(
        f"cold grammar compile (first request, schema of {len(json.dumps(SCHEMA))} chars): "
        f"{compile_s:.2f} s"
    )
    for k, v in rates.items():
        runs = ", ".join(f"{r['decode_tok_per_s']:.1f}" for r in v)
        cpu = ", ".join(f"{r['decode_tok_per_cpu_s']:.1f}" for r in v)
        print(
            f"{k:>14}: decode tok/s per round [{runs}] median {med[k]:.1f}; "
            f"per CPU s [{cpu}] median {med_cpu[k]:.1f}"
        )
    ok = ratio >= 0.9
    print(
        f"constrained / unconstrained = {ratio:.3f} wall, {ratio_cpu:.3f} CPU -> "
        f"target within 10 % (wall): {'met' if ok else 'NOT met'}"
    )
    write_results(
        args.json_out,
        {"compile_s": compile_s, "rates": rates, "ratio": ratio, "ratio_cpu": ratio_cpu},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
