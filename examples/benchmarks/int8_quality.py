"""int8 quality: the real tiny model (aidreams-260k) quantized against its fp32 self.

Every text of the shared workloads (system prompts and user tasks) is tokenized, cut into
windows of the model's context (128 tokens), and run through the fp32 and the
``quantization="int8"`` model in one prefill each. At every position it compares the next-token
distributions:

- top-1 agreement: the int8 argmax equals the fp32 argmax (target >= 95 %);
- mean |Δ logprob| of the chosen token: the fp32 argmax token's log-probability under int8
  minus under fp32, absolute, averaged over positions.

Usage::

    python -m examples.benchmarks.int8_quality [--model DIR] [--max-windows N] [--json OUT]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()


def workload_texts(workloads: Path) -> list[str]:
    """System prompts then user tasks (instruction + inputs), in file order."""
    texts = []
    with (workloads / "system_prompts.csv").open(newline="") as f:
        texts += [row["prompt"] for row in csv.DictReader(f)]
    for line in (workloads / "user_tasks.jsonl").read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            inputs = " ".join(i.get("input", "") for i in task.get("instances", []))
            texts.append((task["instruction"] + "\n" + inputs).strip())
    return texts


def load(model_dir: str, quantization: str | None):
    """The CausalLM on CPU in fp32, optionally int8-quantized."""
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.models import ModelConfig, load_model

    cfg = EngineConfig(model=model_dir, dtype="float32", device="cpu", quantization=quantization)
    return load_model(ModelConfig.from_engine_config(cfg), cfg)


def prompt_logprobs(model, ids: list[int], block_size: int = 16):
    """``[len(ids), V]`` fp32 log-softmax of the next-token logits at every position (one
    prefill over a fresh paged KV cache)."""
    import torch
    from prefixgate.engine.attention_metadata import AttentionMetadata

    cfg = model.config
    n = len(ids)
    blocks = -(-n // block_size)
    shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
        num_decode_seqs=0,
        max_query_len=n,
        max_context_len=n,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
        return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def compare(ref, quant, windows: list[list[int]]) -> dict:
    """Top-1 agreement and mean |Δ logprob| of the reference's argmax over all positions."""
    agree = positions = 0
    diff_sum = 0.0
    for ids in windows:
        lp_ref = prompt_logprobs(ref, ids)
        lp_q = prompt_logprobs(quant, ids)
        top = lp_ref.argmax(-1)
        agree += int((lp_q.argmax(-1) == top).sum())
        chosen = top.unsqueeze(1)
        diff_sum += float((lp_q.gather(1, chosen) - lp_ref.gather(1, chosen)).abs().sum())
        positions += len(ids)
    return {
        "positions": positions,
        "windows": len(windows),
        "top1_agreement": agree / positions,
        "mean_abs_logprob_diff": diff_sum / positions,
    }


def windows_of(tokenizer, texts: list[str], length: int, limit: int | None) -> list[list[int]]:
    """Token windows of at most ``length`` tokens, each text cut into consecutive windows."""
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        out += [ids[i : i + length] for i in range(0, len(ids), length) if len(ids[i:]) > 1]
    return out[:limit] if limit else out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(SHARED / "models" / "aidreams-260k"))
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    import torch
    from prefixgate.engine.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    ref, quant = load(args.model, None), load(args.model, "int8")
    tokenizer = Tokenizer.from_pretrained(args.model)
    windows = windows_of(
        tokenizer, workload_texts(SHARED / "workloads"), ref.config.max_model_len, args.max_windows
    )
    result = compare(ref, quant, windows)
    print(
        f"int8 vs fp32 on {Path(args.model).name}: {result['positions']} positions in "
        f"{result['windows']} windows; top-1 agreement {100 * result['top1_agreement']:.2f} % "
        f"(target >= 95 %), mean |Δ logprob| of the chosen token "
        f"{result['mean_abs_logprob_diff']:.4f} nats"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
