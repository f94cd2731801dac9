"""Prefix caching: TTFT and KV blocks with a shared system prompt.

Requests are a 1,024-token system prompt (real system prompts from the workload CSV, joined and
cut to exactly 1,024 tokens = 64 blocks of 16) followed by a 64-token user turn (real user tasks).
On the SmolLM2-135M-shaped config with dummy weights it measures:

- TTFT cold (nothing cached: a fresh cache salt per request) vs warm (system prompt cached by an
  earlier request with another user turn) vs a cold request of the 64-token user turn alone;
  medians (``--cold-trials``, ``--trials``);
- KV blocks held at peak by 32 concurrent such requests with prefix caching on (shared) and off.
  Block counts do not depend on model depth, so this part runs the same config cut to one layer
  (``hf_overrides={"num_hidden_layers": 1}``) to keep the no-sharing run (32 x 1,088 prompt
  tokens) short.

Targets: warm TTFT >= 90 % lower than cold and within 1.25x of the suffix-only TTFT; the shared
prefix stored once.

Usage::

    python -m examples.benchmarks.prefix_cache [--model DIR] [--trials 7] [--threads N]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

from examples.benchmarks.options import add_common_options, parse_with_threads, write_results

SHARED = shared_dir()
BLOCK = 16


def system_prompt_ids(tokenizer, csv_path: Path, n_tokens: int) -> list[int]:
    """Real system prompts joined until ``n_tokens`` tokens (BOS first), cut to exactly that."""
    with csv_path.open(newline="") as f:
        texts = [row["prompt"] for row in csv.DictReader(f)]
    ids = tokenizer.encode(texts[0])
    i = 1
    while len(ids) < n_tokens:
        ids += tokenizer.encode("\n" + texts[i % len(texts)], add_special_tokens=False)
        i += 1
    return ids[:n_tokens]


def user_turns(tokenizer, jsonl_path: Path, n: int, n_tokens: int) -> list[list[int]]:
    """``n`` user turns of exactly ``n_tokens`` tokens (no BOS), from real user tasks, with
    pairwise different first blocks."""
    turns = []
    first_blocks: set[tuple[int, ...]] = set()
    for line in jsonl_path.read_text().splitlines():
        task = json.loads(line)
        text = (
            task["instruction"]
            + " "
            + " ".join(i.get("input", "") for i in task.get("instances", []))
        )
        ids = tokenizer.encode("\nUser: " + text, add_special_tokens=False)
        head = tuple(ids[:BLOCK])  # distinct first blocks: a warm turn never hits another turn
        if len(ids) >= n_tokens and head not in first_blocks:
            first_blocks.add(head)
            turns.append(ids[:n_tokens])
        if len(turns) == n:
            return turns
    raise ValueError(f"not enough user tasks of >= {n_tokens} tokens in {jsonl_path}")


def ttft(llm, prompt: list[int], rid: str, cache_salt: str | None = None) -> tuple[float, int]:
    """Seconds from add_request to the first output token; also the cached prompt tokens."""
    from prefixgate.engine import SamplingParams

    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(
        rid,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        cache_salt=cache_salt,
    )
    while True:
        for out in eng.step():
            if out.request_id == rid and out.delta_token_ids:
                return time.perf_counter() - t0, out.num_cached_tokens


def measure_ttft(
    llm, sys_ids: list[int], turns: list[list[int]], cold_trials: int, trials: int
) -> dict:
    """Cold requests get a fresh cache salt each (nothing can hit); warm requests share the
    system prompt cached by a first request; suffix-only requests (BOS + 63 user tokens) get a
    fresh salt each. Warm and suffix-only trials alternate so both see the same machine load."""
    bos = sys_ids[:1]
    cold, warm, suffix = [], [], []
    for t in range(cold_trials):
        s, cached = ttft(llm, sys_ids + turns[t], f"cold-{t}", cache_salt=f"cold-{t}")
        assert cached == 0
        cold.append(s)
    ttft(llm, sys_ids + turns[0], "prime")  # caches the system prompt (unsalted)
    for t in range(trials):
        s, cached = ttft(llm, sys_ids + turns[1 + t], f"warm-{t}")  # another user turn
        assert cached == len(sys_ids), cached
        warm.append(s)
        s, cached = ttft(llm, bos + turns[1 + t][1:], f"suffix-{t}", cache_salt=f"suffix-{t}")
        assert cached == 0
        suffix.append(s)
    c, w, x = (statistics.median(v) for v in (cold, warm, suffix))
    return {
        "cold_ttft_s": c,
        "warm_ttft_s": w,
        "suffix_only_ttft_s": x,
        "warm_reduction": 1 - w / c,
        "warm_over_suffix_only": w / x,
        "samples": {"cold": cold, "warm": warm, "suffix_only": suffix},
    }


def peak_blocks(
    model: str, load_format: str, caching: bool, prompts: list[list[int]], out_len: int
) -> dict:
    """Peak ``kv_blocks_used`` while the prompts run concurrently (one-layer config)."""
    from prefixgate.engine import LLM, SamplingParams

    llm = LLM(
        model,
        load_format=load_format,
        hf_overrides={"num_hidden_layers": 1},
        block_size=BLOCK,
        num_kv_blocks=4096,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=65536,
        enable_prefix_caching=caching,
    )
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"c{i}", p, params)
    peak = peak_running = 0
    while eng.has_unfinished_requests():
        eng.step()
        s = eng.stats()
        peak = max(peak, s["kv_blocks_used"])
        peak_running = max(peak_running, s["num_running"])
    llm.check_invariants()
    s = eng.stats()
    return {
        "peak_blocks_used": peak,
        "peak_running": peak_running,
        "prompt_tokens_prefilled": s["prompt_tokens_prefilled"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "smollm2-135m-shape"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--workloads", default=str(SHARED / "workloads"))
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8, help="output tokens in the KV-block run")
    ap.add_argument("--cold-trials", type=int, default=3, help="cold TTFT samples (median)")
    ap.add_argument("--trials", type=int, default=7, help="warm and suffix-only samples (median)")
    add_common_options(ap)
    args = parse_with_threads(ap)

    import torch
    from prefixgate.engine import LLM

    wl = Path(args.workloads)
    llm = LLM(
        args.model,
        load_format=args.load_format,
        block_size=BLOCK,
        kv_cache_memory=512 << 20,
        max_num_batched_tokens=4096,
    )
    sys_ids = system_prompt_ids(llm.tokenizer, wl / "system_prompts.csv", args.system_tokens)
    turns = user_turns(
        llm.tokenizer,
        wl / "user_tasks.jsonl",
        max(args.cold_trials, args.trials + 1, args.concurrent),
        args.user_tokens,
    )
    ttft(llm, sys_ids[:64], "warm-up", cache_salt="warm-up")
    t = measure_ttft(llm, sys_ids, turns, args.cold_trials, args.trials)
    llm.check_invariants()

    prompts = [sys_ids + turns[i] for i in range(args.concurrent)]
    shared = peak_blocks(args.model, args.load_format, True, prompts, args.output_len)
    unshared = peak_blocks(args.model, args.load_format, False, prompts, args.output_len)
    kv_tokens = (
        args.system_tokens + args.user_tokens + args.output_len - 1
    )  # last token not fed back
    sys_blocks = args.system_tokens // BLOCK
    own_blocks = -(-kv_tokens // BLOCK) - sys_blocks
    expected_once = sys_blocks + args.concurrent * own_blocks
    expected_each = args.concurrent * -(-kv_tokens // BLOCK)

    print(
        f"\nbench_prefix_cache: {Path(args.model).name} (load_format={args.load_format}), "
        f"{torch.get_num_threads()} threads; system {args.system_tokens} + user {args.user_tokens} tokens, "
        f"block {BLOCK}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'TTFT (median; cold ' + str(args.cold_trials) + ', others ' + str(args.trials) + ')':<32} {'seconds':>9}"
    )
    print("-" * 42)
    print(f"{'cold (system + user)':<32} {t['cold_ttft_s']:>9.3f}")
    print(f"{'warm (system cached)':<32} {t['warm_ttft_s']:>9.3f}")
    print(
        f"{f'cold, {args.user_tokens}-token user turn alone':<32} {t['suffix_only_ttft_s']:>9.3f}"
    )
    print(
        f"warm vs cold: {100 * t['warm_reduction']:.1f}% lower (target >= 90%: "
        f"{'met' if t['warm_reduction'] >= 0.9 else 'NOT met'})"
    )
    print(
        f"warm vs suffix-only: {t['warm_over_suffix_only']:.2f}x (target <= 1.25x: "
        f"{'met' if t['warm_over_suffix_only'] <= 1.25 else 'NOT met'})"
    )
    print(
        f"\nKV blocks held by {args.concurrent} concurrent requests (peak, output {args.output_len} tokens):"
    )
    print(
        f"  shared prefix : {shared['peak_blocks_used']:>5}  (prefix once would be {expected_once}; "
        f"prompt tokens prefilled {shared['prompt_tokens_prefilled']})"
    )
    print(
        f"  no sharing    : {unshared['peak_blocks_used']:>5}  (prefix per request would be {expected_each}; "
        f"prompt tokens prefilled {unshared['prompt_tokens_prefilled']})"
    )
    stored_once = shared["peak_blocks_used"] <= expected_once
    print(
        f"  ratio {unshared['peak_blocks_used'] / max(1, shared['peak_blocks_used']):.1f}x; prefix stored once: "
        f"{'yes' if stored_once else 'NO'}"
    )
    write_results(
        args.json_out,
        {
            "meta": {
                "model": args.model,
                "threads": torch.get_num_threads(),
                "system_tokens": args.system_tokens,
                "user_tokens": args.user_tokens,
            },
            "ttft": t,
            "blocks_shared": shared,
            "blocks_unshared": unshared,
            "expected_blocks_prefix_once": expected_once,
            "expected_blocks_prefix_each": expected_each,
            "prefix_stored_once": stored_once,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
