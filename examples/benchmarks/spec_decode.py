"""Speculative decoding (n-gram prompt lookup): single-stream tok/s with and without, and the
draft acceptance, on a workload whose answers repeat their input and one whose answers do not.

Workloads, from the shared user tasks (``../shared/workloads/user_tasks.jsonl``), one request
at a time (single stream), greedy, ``--max-tokens`` output tokens each (``ignore_eos``):

- ``repeat``: ``X + newline + X[:8]`` (token ids), ``X`` a 40-token text of the model's own
  whose greedy continuation there is ``X[8:]`` (``copy_prompts``: a fixed point found from each
  task's instruction), so the answer copies its input (what n-gram drafts predict);
- ``task-twice``: "Repeat this text exactly." + the task's text + the task's text again + its
  first half (a tiny model writes its own phrases instead of copying it);
- ``fresh``: the task's instruction alone: an answer that repeats nothing of its prompt.

For each model (the real tiny ``aidreams-260k`` and the SmolLM2-135M-shaped config with dummy
weights) both engines (speculation off / ``speculative_method="ngram"``) are loaded at once
and the prompts alternate between them, so a change of machine load hits both alike; the
reported ratio is spec tok/s / plain tok/s of the same run. Also: acceptance (accepted / draft
tokens), accepted tokens per verify step, and whether the greedy outputs were identical.

Targets: >= 1.5x on ``repeat``, >= 0.95x on ``fresh``.

Usage::

    python -m examples.benchmarks.spec_decode [--models aidreams smollm2] [--prompts 6]
        [--max-tokens 64] [--num-speculative-tokens 4] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()
MODELS = {
    "aidreams": ("aidreams-260k", "auto"),
    "smollm2": ("smollm2-135m-shape", "dummy"),
}


def task_texts(path: Path, n: int) -> list[tuple[str, str]]:
    """``n`` (instruction, instruction + inputs) pairs of the user tasks, in file order."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            inputs = " ".join(i.get("input", "") for i in task.get("instances", []))
            out.append((task["instruction"], (task["instruction"] + " " + inputs).strip()))
        if len(out) == n:
            break
    return out


def workloads(path: Path, n: int, fits) -> dict[str, list[str]]:
    """The ``task-twice`` and ``fresh`` prompts (see the module docstring); a task's text is cut
    (words from the end) until ``fits(prompt)`` holds (the model's context less the output)."""
    repeat, fresh = [], []
    for inst, text in task_texts(path, n):
        words = text.split()
        while True:
            t = " ".join(words)
            prompt = f"Repeat this text exactly.\n{t}\n{t}\n{t[: max(1, len(t) // 2)]}"
            if fits(prompt) or len(words) <= 4:
                break
            words = words[: max(4, len(words) * 3 // 4)]
        repeat.append(prompt)
        words = inst.split()
        while not fits(" ".join(words)) and len(words) > 4:
            words = words[: max(4, len(words) * 3 // 4)]
        fresh.append(" ".join(words))
    return {"task-twice": repeat, "fresh": fresh}


def copy_prompts(
    llm, instructions: list[str], text_tokens: int = 40, cut: int = 8, rounds: int = 8
) -> tuple[list[list[int]], list[list[int]]]:
    """The ``repeat`` prompts: ``X + "\\n" + X[:cut]`` (token ids) where ``X`` is a text of the
    model's own whose greedy continuation there is ``X[cut:]``, so the answer copies its input.

    A tiny model cannot copy a text it would not write itself (aidreams-260k, given a task's
    text twice and a third start, writes its own phrases instead), so ``X`` is found by a
    fixed-point iteration from each instruction's first 16 tokens: ``X`` = those + their
    greedy continuation (``text_tokens`` in all), then up to ``rounds`` times ``X <- X[:cut] +``
    the greedy continuation of ``X + "\\n" + X[:cut]``, until it is ``X[cut:]`` itself.

    Returns:
        ``(prompts, wanted)``: per instruction the prompt and ``X[cut:]`` (what copying gives).
    """
    from prefixgate.engine import SamplingParams

    tok = llm.tokenizer
    newline = tok.encode("\n")

    def greedy(ids: list[int], n: int) -> list[int]:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate([ids], p)[0].outputs[0].token_ids)

    prompts, wanted = [], []
    for inst in instructions:
        head = tok.encode(inst)[:16]
        x = head + greedy(head, text_tokens - len(head))
        for _ in range(rounds):
            cont = greedy(x + newline + x[:cut], len(x) - cut)
            if cont == x[cut:]:
                break
            x = x[:cut] + cont
        prompts.append(x + newline + x[:cut])
        wanted.append(x[cut:])
    return prompts, wanted


def make_engine(model: str, load_format: str, spec: bool, k: int):
    from prefixgate.engine import LLM, SamplingParams

    kw = {"speculative_method": "ngram", "num_speculative_tokens": k} if spec else {}
    llm = LLM(model, load_format=load_format, dtype="float32", device="cpu", **kw)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    return llm


def run_workload(engines: dict, prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """Each prompt through each engine in turn (alternating who goes first); per engine: tok/s,
    output token lists, spec counters over the workload."""
    from prefixgate.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res = {
        name: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "outputs": []} for name in engines
    }
    before = {name: dict(e.stats()) for name, e in engines.items()}
    steps_before = {name: e.engine.timing["steps"] for name, e in engines.items()}
    order = list(engines)
    for i, prompt in enumerate(prompts):
        for name in order if i % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = engines[name].generate([prompt], params)[0].outputs[0]
            res[name]["cpu_seconds"] += time.thread_time() - c0
            res[name]["seconds"] += time.perf_counter() - t0
            res[name]["tokens"] += len(out.token_ids)
            res[name]["outputs"].append(list(out.token_ids))
    for name, e in engines.items():
        r, s, b = res[name], e.stats(), before[name]
        r["tok_s"] = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        r["cpu_tok_s"] = r["tokens"] / r["cpu_seconds"] if r["cpu_seconds"] else 0.0
        r["steps"] = e.engine.timing["steps"] - steps_before[name]
        if "spec_decode_num_draft_tokens" in s:
            drafted = s["spec_decode_num_draft_tokens"] - b["spec_decode_num_draft_tokens"]
            accepted = s["spec_decode_num_accepted_tokens"] - b["spec_decode_num_accepted_tokens"]
            steps = s["spec_decode_num_drafts"] - b["spec_decode_num_drafts"]
            r["draft_tokens"], r["accepted_tokens"], r["verify_steps"] = drafted, accepted, steps
            r["acceptance"] = accepted / drafted if drafted else 0.0
            r["accepted_per_verify"] = accepted / steps if steps else 0.0
    return res


def measure(args) -> dict:
    results: dict[str, dict] = {}
    for model_key in args.models:
        folder, load_format = MODELS[model_key]
        path = str(SHARED / "models" / folder)
        engines = {
            "plain": make_engine(path, load_format, False, args.num_speculative_tokens),
            "ngram": make_engine(path, load_format, True, args.num_speculative_tokens),
        }
        llm = engines["plain"]
        room = llm.max_model_len - args.max_tokens - 1

        def fits(prompt: str, llm=llm, room=room) -> bool:
            return len(llm.tokenizer.encode(prompt)) <= room

        tasks = SHARED / "workloads" / "user_tasks.jsonl"
        copies, wanted = copy_prompts(llm, [inst for inst, _ in task_texts(tasks, args.prompts)])
        wl: dict[str, list] = {"repeat": copies, **workloads(tasks, args.prompts, fits)}
        results[model_key] = {}
        for wname, prompts in wl.items():
            r = run_workload(engines, prompts, args.max_tokens)
            plain, ngram = r["plain"], r["ngram"]
            copied = None
            if wname == "repeat":  # the share of the text's rest the answers copied (prefix)
                same = sum(
                    next(
                        (i for i, (a, b) in enumerate(zip(o, w, strict=False)) if a != b),
                        min(len(o), len(w)),
                    )
                    for o, w in zip(plain["outputs"], wanted, strict=True)
                )
                copied = same / sum(len(w) for w in wanted)
            results[model_key][wname] = {
                "copied": copied,
                "plain_tok_s": plain["tok_s"],
                "ngram_tok_s": ngram["tok_s"],
                "ratio": ngram["tok_s"] / plain["tok_s"] if plain["tok_s"] else 0.0,
                "plain_cpu_tok_s": plain["cpu_tok_s"],
                "ngram_cpu_tok_s": ngram["cpu_tok_s"],
                "cpu_ratio": (
                    ngram["cpu_tok_s"] / plain["cpu_tok_s"] if plain["cpu_tok_s"] else 0.0
                ),
                "plain_steps": plain["steps"],
                "ngram_steps": ngram["steps"],
                "verify_steps": ngram.get("verify_steps"),
                "acceptance": ngram.get("acceptance"),
                "accepted_per_verify": ngram.get("accepted_per_verify"),
                "draft_tokens": ngram.get("draft_tokens"),
                "identical": plain["outputs"] == ngram["outputs"],
            }
        del engines
    return results


def report(args, results: dict, load_before: str, load_after: str) -> None:
    print(
        f"\nspec_decode: single stream, greedy, {args.max_tokens} output tokens x "
        f"{args.prompts} prompts, k={args.num_speculative_tokens}, threads={args.threads}, "
        f"load {load_before} -> {load_after}"
    )
    print(
        f"{'model':10} {'workload':22} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} "
        f"{'cpu ratio':>9} {'accept':>7} {'acc/step':>8} {'steps p/n/verify':>17} identical"
    )
    for model, per in results.items():
        for wname, r in per.items():
            acc = r["acceptance"] if r["acceptance"] is not None else 0.0
            aps = r["accepted_per_verify"] or 0.0
            steps = f"{r['plain_steps']:.0f}/{r['ngram_steps']:.0f}/{r['verify_steps'] or 0}"
            if r.get("copied") is not None:
                wname = f"{wname} ({100 * r['copied']:.0f}% copied)"
            print(
                f"{model:10} {wname:22} {r['plain_tok_s']:12.1f} {r['ngram_tok_s']:12.1f} "
                f"{r['ratio']:6.2f} {r['cpu_ratio']:9.2f} {100 * acc:6.1f}% {aps:8.2f} "
                f"{steps:>17} {r['identical']}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None, help="write results here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load_before = f"{os.getloadavg()[0]:.2f}"
    results = measure(args)
    load_after = f"{os.getloadavg()[0]:.2f}"
    report(args, results, load_before, load_after)
    if args.json_out:
        meta = {"args": vars(args), "load": [load_before, load_after]}
        Path(args.json_out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
