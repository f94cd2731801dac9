"""Engine throughput, prefill time, decode speed and host overhead, side by side with
Hugging Face transformers (``generate``) and with ``quantization="int8"``, in one run.

On the SmolLM2-135M-shaped config with dummy weights, prompts from real user tasks (joined and
cut to exactly ``--prompt-len`` tokens: equal lengths) and a fixed output length
(``ignore_eos`` / ``min_new_tokens``), the same torch thread count for everyone:

- throughput: ``--num-requests`` x (prompt, output) all at once: output tokens/s over the whole
  run (wall clock, prefill included) for transformers ``generate`` (one static batch, fp32),
  the engine fp32 and the engine int8; ratios against transformers;
- prefill: one ``--prefill-len``-token prompt, time to its first token (engine with a cold
  cache; transformers ``generate(max_new_tokens=1)``); median of ``--trials``;
- decode: tokens/s of decode-only engine steps at batch ``--decode-batches`` (fp32 and int8);
- host overhead: the share of engine step time outside the model forward (scheduling, block
  management, batch building, sampling, detokenizing) at ``--num-requests`` requests.

All three systems are loaded at once; the prefill trials and decode runs alternate between
them, so a change of machine load during the run (shared machines) hits all of them alike.

Targets: engine fp32 >= 1.3x transformers tok/s; prefill <= 1.0x transformers' time;
int8 decode >= 1.8x fp32 at batch 1 and 8; int8 throughput >= 2x transformers fp32; outside
the forward < 10 %.

Usage::

    python -m examples.benchmarks.engine_throughput [--model DIR] [--num-requests 32]
        [--prompt-len 128] [--output-len 64] [--prefill-len 1088] [--decode-batches 1 8]
        [--no-transformers] [--no-int8] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

from examples.benchmarks.options import add_common_options, parse_with_threads, write_results

SHARED = shared_dir()


def load_prompts(tokenizer, path: Path, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_len`` tokens: user tasks (instruction + inputs) from
    the JSONL, prompt i starting at task i and joining the following tasks until long enough."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            inputs = " ".join(i.get("input", "") for i in task.get("instances", []))
            texts.append((task["instruction"] + "\n" + inputs).strip())
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(texts[i % len(texts)])
        j = i + 1
        while len(ids) < prompt_len:
            ids += tokenizer.encode("\n" + texts[j % len(texts)], add_special_tokens=False)
            j += 1
        prompts.append(ids[:prompt_len])
    return prompts


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
        out_tokens += sum(len(o.delta_token_ids) for o in outs)
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


def engine_prefill_s(llm, prompt: list[int]) -> float:
    """Seconds from add_request to the first output token of one prompt (prefix caching is
    off in these engines, so every trial is a cold prefill)."""
    from prefixgate.engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(f"prefill-{time.monotonic_ns()}", prompt, params)
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def make_engine(args, quantization: str | None, max_num_seqs: int):
    """An fp32 CPU ``LLM`` on the benchmark model, prefix caching off, warmed up."""
    from prefixgate.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype="float32",
        device="cpu",
        quantization=quantization,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,  # distinct prompts, cold prefills: the plain engine
    )
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    return llm


class HFBaseline:
    """transformers ``generate`` (greedy, fp32, SDPA attention, its own KV cache) on the same
    config: static batches, no continuous batching, no paging."""

    def __init__(self, args) -> None:
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(args.model)
        torch.manual_seed(0)
        if args.load_format == "dummy":
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="sdpa"
            )
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                args.model, dtype=torch.float32, attn_implementation="sdpa"
            )
        self.model = model.eval()
        self.pad = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
        self.generate([[1, 2, 3, 4]], 2)  # warm-up

    def generate(self, batch: list[list[int]], n: int) -> int:
        """Greedy-generate exactly ``n`` tokens for each prompt (equal lengths, no padding);
        returns the number of output tokens."""
        import torch

        ids = torch.tensor(batch)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
            )
        return (out.shape[1] - ids.shape[1]) * out.shape[0]


def hf_throughput(hf: HFBaseline, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts as one static batch."""
    t0 = time.perf_counter()
    tokens = hf.generate(prompts, output_len)
    wall = time.perf_counter() - t0
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}


def hf_prefill_s(hf: HFBaseline, prompt: list[int]) -> float:
    """``generate(max_new_tokens=1)`` of one prompt: its prefill and first token."""
    t0 = time.perf_counter()
    hf.generate([prompt], 1)
    return time.perf_counter() - t0


def measure(args, prompts, prefill_prompt, decode_prompts) -> dict[str, dict]:
    """Every measurement, interleaved across the systems so that a change of machine load
    during the run hits all of them alike: all systems are loaded first; throughput runs one
    after the other; prefill trials and decode runs alternate between systems."""
    systems: dict[str, object] = {}
    if not args.no_transformers:
        systems["transformers"] = HFBaseline(args)
    max_seqs = max([len(prompts), *args.decode_batches])
    systems["engine"] = make_engine(args, None, max_seqs)
    if not args.no_int8:
        systems["engine_int8"] = make_engine(args, "int8", max_seqs)
    results: dict[str, dict] = {name: {} for name in systems}
    for name, sys_ in systems.items():
        if name == "transformers":
            results[name]["throughput"] = hf_throughput(sys_, prompts, args.output_len)
        else:
            results[name]["throughput"] = run_once(sys_, prompts, args.output_len)
            sys_.check_invariants()
    prefill: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.trials):
        for name, sys_ in systems.items():
            fn = hf_prefill_s if name == "transformers" else engine_prefill_s
            prefill[name].append(fn(sys_, prefill_prompt))
    for name in systems:
        results[name]["prefill_s"] = statistics.median(prefill[name])
    engines = [n for n in systems if n != "transformers"]
    for name in engines:
        results[name]["decode"] = {}
    for b in args.decode_batches:
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.decode_repeats):
            for name in engines:
                r = run_once(systems[name], decode_prompts[:b], args.decode_len)
                ms = r["decode_step_ms"]
                rates[name].append(1000.0 * b / ms if ms else 0.0)
        for name in engines:
            results[name]["decode"][b] = statistics.median(rates[name])
    for name in engines:
        systems[name].check_invariants()
    return results


def _load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-shape"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--workload", default=str(SHARED / "workloads" / "user_tasks.jsonl"))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (exact)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    ap.add_argument("--prefill-len", type=int, default=1088, help="single-prompt prefill tokens")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--decode-len", type=int, default=32, help="output tokens in decode runs")
    ap.add_argument("--trials", type=int, default=3, help="prefill trials (median)")
    ap.add_argument("--decode-repeats", type=int, default=2, help="decode runs (median)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the HF baseline")
    ap.add_argument("--no-int8", action="store_true", help="skip quantization='int8'")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 29, help="bytes")
    add_common_options(ap, json_help="write results here")
    args = parse_with_threads(ap)

    import torch
    from prefixgate.engine.tokenizer import Tokenizer

    load_before = _load_average()
    tok = Tokenizer.from_pretrained(args.model)
    workload = Path(args.workload)
    prompts = load_prompts(tok, workload, args.num_requests, args.prompt_len)
    prefill_prompt = load_prompts(tok, workload, 1, args.prefill_len)[0]
    decode_prompts = load_prompts(tok, workload, max(args.decode_batches), args.prompt_len)

    results = measure(args, prompts, prefill_prompt, decode_prompts)
    load_after = _load_average()
    report(args, results, torch, load_before, load_after)
    if args.json_out:
        meta = {
            "model": args.model,
            "threads": torch.get_num_threads(),
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "prefill_len": args.prefill_len,
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": load_after,
        }
        write_results(args.json_out, {"meta": meta, "results": results})
    return 0


def report(args, results: dict, torch, load_before: str, load_after: str) -> None:
    """Print the side-by-side tables, ratios and targets."""
    hf = results.get("transformers")
    print(
        f"\nengine_throughput: {Path(args.model).name} (load_format={args.load_format}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 activations; "
        f"load average {load_before} (before) / {load_after} (after)"
    )
    n, p, o = args.num_requests, args.prompt_len, args.output_len
    print(
        f"\n{n} x ({p} prompt, {o} output) tokens, all at once; one {args.prefill_len}-token prefill"
    )
    header = f"{'':<22} {'out tok/s':>10} {'vs HF':>7} {'wall s':>8} {'prefill s':>10} {'vs HF':>7}"
    print(header)
    print("-" * len(header))
    for name, label in (
        ("transformers", "transformers generate"),
        ("engine", "engine fp32"),
        ("engine_int8", "engine int8"),
    ):
        r = results.get(name)
        if r is None:
            continue
        tp = r["throughput"]
        ratio = tp["output_tokens_per_s"] / hf["throughput"]["output_tokens_per_s"] if hf else 0
        pre = r["prefill_s"] / hf["prefill_s"] if hf else 0
        print(
            f"{label:<22} {tp['output_tokens_per_s']:>10.1f} {ratio:>6.2f}x {tp['wall_s']:>8.1f} "
            f"{r['prefill_s']:>10.2f} {pre:>6.2f}x"
        )
    eng, q = results["engine"], results.get("engine_int8")
    print("\ndecode-only steps, tokens/s")
    for b in args.decode_batches:
        line = f"  batch {b:>3}: fp32 {eng['decode'][b]:8.1f}"
        if q:
            line += f"   int8 {q['decode'][b]:8.1f}   int8/fp32 {q['decode'][b] / eng['decode'][b]:.2f}x"
        print(line)
    t = eng["throughput"]
    d = t["phase_s_decode_steps"]
    print(
        f"\nengine fp32 at {n} requests: {t['steps']} steps, decode step {t['decode_step_ms']:.1f} ms, "
        f"outside the forward {100 * t['overhead_share_all_steps']:.2f} % (all steps), "
        f"{100 * t['overhead_share_decode_steps']:.2f} % (decode steps); decode-step seconds "
        f"schedule / prepare / forward / sample / output: {d['schedule_s']:.3f} / "
        f"{d['prepare_s']:.3f} / {d['forward_s']:.3f} / {d['sample_s']:.3f} / {d['output_s']:.3f}"
    )
    checks = [("outside the forward < 10 %", t["overhead_share_all_steps"] < 0.10)]
    if hf:
        hf_tps = hf["throughput"]["output_tokens_per_s"]
        checks.append(
            ("engine fp32 >= 1.3x transformers", t["output_tokens_per_s"] >= 1.3 * hf_tps)
        )
        checks.append(("prefill <= 1.0x transformers", eng["prefill_s"] <= hf["prefill_s"]))
        if q:
            checks.append(
                (
                    "int8 >= 2x transformers fp32",
                    q["throughput"]["output_tokens_per_s"] >= 2 * hf_tps,
                )
            )
    if q:
        for b in args.decode_batches:
            checks.append(
                (f"int8 decode >= 1.8x fp32 at batch {b}", q["decode"][b] >= 1.8 * eng["decode"][b])
            )
    print("\ntargets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))


if __name__ == "__main__":
    raise SystemExit(main())
