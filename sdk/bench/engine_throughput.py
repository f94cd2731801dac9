"""Engine throughput and host overhead.

Runs N requests (default 32 and 128) through ``LLM`` on the SmolLM2-135M-shaped config with
dummy weights, real user tasks as prompts (cut to ``--prompt-len`` tokens) and a fixed output
length (``ignore_eos``), and reports:

- output tokens/s over the whole run (wall clock, prefill included);
- the share of engine step time spent outside the model forward (scheduling, block
  management, batch building, sampling, detokenizing), over all steps and over decode-only
  steps, with the per-phase split.

Usage::

    python -m prefixgate.sdk.bench.engine_throughput [--model DIR] [--num-requests 32 128]
        [--prompt-len 64] [--output-len 32] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()


def load_prompts(tokenizer, path: Path, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of at most ``prompt_len`` tokens from the user-task JSONL (cycled)."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            inputs = " ".join(i.get("input", "") for i in task.get("instances", []))
            texts.append((task["instruction"] + "\n" + inputs).strip())
    return [tokenizer.encode(texts[i % len(texts)])[:prompt_len] for i in range(n)]


def run_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """Run all prompts at once, stepping the engine by hand to time each step."""
    from prefixgate.engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"bench-{len(prompts)}-{i}", p, params)
    keys = ("step_s", "schedule_s", "prepare_s", "forward_s", "sample_s", "output_s")
    total = dict.fromkeys(keys, 0.0)
    decode = dict.fromkeys(keys, 0.0)
    steps = decode_steps = 0
    out_tokens = 0
    while eng.has_unfinished_requests():
        before = dict(eng.timing)
        prefilled = eng.stats()["prompt_tokens_prefilled"]
        outs = eng.step()
        out_tokens += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        delta = {k: eng.timing[k] - before[k] for k in keys}
        steps += 1
        for k in keys:
            total[k] += delta[k]
        if eng.stats()["prompt_tokens_prefilled"] == prefilled:
            decode_steps += 1
            for k in keys:
                decode[k] += delta[k]
    wall = time.perf_counter() - t0

    def share(d: dict) -> float:
        return (d["step_s"] - d["forward_s"]) / d["step_s"] if d["step_s"] else 0.0

    return {
        "num_requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "steps": steps,
        "decode_steps": decode_steps,
        "overhead_share_all_steps": share(total),
        "overhead_share_decode_steps": share(decode),
        "decode_step_ms": 1000 * decode["step_s"] / decode_steps if decode_steps else 0.0,
        "phase_s_all_steps": total,
        "phase_s_decode_steps": decode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-shape"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--workload", default=str(SHARED / "workloads" / "user_tasks.jsonl"))
    ap.add_argument("--num-requests", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (cut)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes")
    ap.add_argument("--json", dest="json_out", default=None, help="write results here")
    args = ap.parse_args()

    import torch
    from prefixgate.engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=max(args.num_requests),
        enable_prefix_caching=False,  # distinct prompts; measure the plain engine
    )
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    results = []
    for n in args.num_requests:
        prompts = load_prompts(llm.tokenizer, Path(args.workload), n, args.prompt_len)
        results.append(run_once(llm, prompts, args.output_len))
        llm.check_invariants()

    print(
        f"\nbench_engine: {Path(args.model).name} (load_format={args.load_format}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"prompt <= {args.prompt_len} tok, output {args.output_len} tok"
    )
    header = (
        f"{'requests':>8} {'out tok/s':>10} {'wall s':>8} {'steps':>6} "
        f"{'decode ms':>10} {'outside fwd (all)':>18} {'outside fwd (decode)':>21}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['num_requests']:>8} {r['output_tokens_per_s']:>10.1f} {r['wall_s']:>8.1f} "
            f"{r['steps']:>6} {r['decode_step_ms']:>10.1f} "
            f"{100 * r['overhead_share_all_steps']:>17.2f}% "
            f"{100 * r['overhead_share_decode_steps']:>20.2f}%"
        )
    print(
        "\nper-phase seconds over decode-only steps (schedule / prepare / forward / sample / output):"
    )
    for r in results:
        d = r["phase_s_decode_steps"]
        print(
            f"  {r['num_requests']:>4} requests: {d['schedule_s']:.3f} / {d['prepare_s']:.3f} / "
            f"{d['forward_s']:.3f} / {d['sample_s']:.3f} / {d['output_s']:.3f}"
        )
    target = next((r for r in results if r["num_requests"] == 32), None)
    if target is not None:
        ok = target["overhead_share_all_steps"] < 0.10
        print(
            f"\ntarget: share outside the forward < 10 % at 32 requests -> "
            f"{100 * target['overhead_share_all_steps']:.2f}% ({'met' if ok else 'NOT met'})"
        )
    if args.json_out:
        meta = {
            "model": args.model,
            "threads": torch.get_num_threads(),
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "torch": torch.__version__,
        }
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
