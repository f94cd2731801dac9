"""GPU check of the Triton kernels: one prepared run (< 5 min on an H100/H200), results to JSON.

Measures, in one process:

1. correctness at GPU shapes: decode / prefill in fp16 and bf16 against the torch references
   (bf16 cannot be checked in the CPU interpreter, triton#11584);
2. device-to-device copy bandwidth (``dst.copy_(src)``, bytes read + written per second);
3. paged decode attention at batch 64 x 4,096-token contexts: KV bytes read per second, as a
   fraction of the copy bandwidth (target >= 0.70), for the default launch config and the best
   of a small sweep (tile, splits, warps); also the SmolLM2-135M head shape;
4. prefill attention TFLOP/s (causal FLOPs = 4 * B * Hq * D * (L_q * L_prefix + L_q^2 / 2))
   against ``torch.nn.functional.scaled_dot_product_attention`` on the same shape;
5. engine output tokens/s: ``LLM`` on the SmolLM2-135M shape with dummy weights, bf16, Triton
   kernels (and the torch kernels on the same GPU for comparison).

Usage::

    python -m examples.benchmarks.gpu_check --out gpu_check.json
    python -m examples.benchmarks.gpu_check --dry-run --out /tmp/gpu_check.json   # CPU, tiny

``--dry-run`` runs every section at tiny sizes (in the Triton interpreter without CUDA) to
check the script itself; its timings mean nothing. Each section records its own error and the
run goes on, so one failure never loses the other figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from prefixgate.kernels import torch_ref, triton_decode, triton_ops, triton_prefill  # noqa: E402
from prefixgate.kernels.paged import PagedKV  # noqa: E402
from prefixgate.sdk.bench.shared import shared_dir  # noqa: E402

SHARED = shared_dir()
TARGET_FRACTION = 0.70
DecodeDefaults = triton_decode.DecodeConfig()
# SmolLM2-135M's shape (../shared/models/smollm2-135m-shape/config.json), for the preset fallback.
SMOLLM2_OVERRIDES = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
}


@dataclass(slots=True)
class Sizes:
    """Problem sizes of one run (the full run's or the dry run's)."""

    dtype: torch.dtype
    decode_batch: int
    decode_ctx: int
    prefill_batch: int
    prefill_len: int
    prefix_len: int
    heads: tuple[int, int, int]  # (Hq, Hkv, D): a Llama-3-8B-like layer
    block_size: int
    engine_prompts: int
    engine_max_tokens: int
    sweep: bool


FULL = Sizes(torch.bfloat16, 64, 4096, 4, 2048, 3072, (32, 8, 128), 16, 64, 128, True)
DRY = Sizes(torch.float32, 2, 80, 2, 48, 32, (4, 2, 64), 16, 2, 4, False)
DEADLINE = [float("inf")]  # perf_counter() after which sweeps stop (set from --budget-s)


def over_budget() -> bool:
    """True once the run's time budget is spent: the remaining sweep configs are skipped."""
    return time.perf_counter() > DEADLINE[0]


def bench_ms(fn, device: torch.device, rep_ms: int = 200) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on CUDA, wall clock elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def env_info(device: torch.device) -> dict[str, Any]:
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    return info


def copy_bandwidth(nbytes: int, device: torch.device) -> dict[str, Any]:
    """Device-to-device copy of ``nbytes``: (read + written bytes) / time, GB/s (1e9 B/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return {
        "bytes": nbytes,
        "ms": ms,
        "gbps": 2 * nbytes / (ms * 1e-3) / 1e9,
        "method": "dst.copy_(src); gbps = (bytes read + bytes written) / time",
    }


def make_paged(
    batch: int,
    ctx: int,
    q_len: int,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    """Random paged K/V (blocks shuffled, as after real allocation) and ``q [batch * q_len, Hq, D]``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    return {
        "q": torch.randn(batch * q_len, hq, d, generator=gen, device=device, dtype=dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": perm.view(batch, blocks_per_seq).contiguous(),
        "context_lens": torch.full((batch,), ctx, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(
            0, batch * q_len + 1, q_len, dtype=torch.int32, device=device
        ),
    }


def paged_kv(p: dict[str, Any], num_seqs: int | None = None) -> PagedKV:
    """The :class:`PagedKV` of :func:`make_paged`'s tensors (its first ``num_seqs`` sequences;
    all when None)."""
    return PagedKV(
        p["k_cache"], p["v_cache"], p["block_tables"][:num_seqs], p["context_lens"][:num_seqs]
    )


def prefill_args(p: dict[str, Any], d: int) -> tuple[Any, ...]:
    """``paged_attention_prefill``'s arguments from :func:`make_paged`'s tensors (scale
    ``d ** -0.5``)."""
    return (p["q"], paged_kv(p), p["query_start_loc"], d**-0.5)


def timed_generate(
    llm: Any, prompts: list[Any], params: Any, device: torch.device
) -> tuple[list[Any], float]:
    """``llm.generate(prompts, params)`` and its wall time in seconds (CUDA synchronized on
    both sides, so queued kernels count)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return outs, time.perf_counter() - start


def check_correctness(device: torch.device, dry: bool) -> list[dict[str, Any]]:
    """Max abs error of the Triton attention vs the torch reference at mixed lengths, per dtype."""
    dtypes = [torch.float32] if dry else [torch.float16, torch.bfloat16, torch.float32]
    rows = []
    for dtype in dtypes:
        for hq, hkv, d in [(8, 2, 64)] if dry else [(8, 2, 64), (32, 8, 128)]:
            lens, q_len = ([60, 31, 25], 20) if dry else ([300, 131, 117], 100)
            p = make_paged(3, lens[0], q_len, hq, hkv, d, 16, dtype, device, seed=1)
            p["context_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
            pre_args = prefill_args(p, d)
            dec_args = (p["q"][:3], paged_kv(p), d**-0.5)
            for kind, ours, ref in (
                (
                    "prefill",
                    triton_ops.paged_attention_prefill(*pre_args),
                    torch_ref.paged_attention_prefill(*pre_args),
                ),
                (
                    "decode",
                    triton_ops.paged_attention_decode(*dec_args),
                    torch_ref.paged_attention_decode(*dec_args),
                ),
            ):
                err = (ours.float() - ref.float()).abs().max().item()
                rows.append(
                    {"kernel": kind, "dtype": str(dtype), "heads": [hq, hkv, d], "max_abs_err": err}
                )
    return rows


def decode_bench(
    s: Sizes, hq: int, hkv: int, d: int, copy_gbps: float, device: torch.device
) -> dict[str, Any]:
    """Decode attention bandwidth (K + V bytes read / time) at ``s.decode_batch x s.decode_ctx``."""
    p = make_paged(s.decode_batch, s.decode_ctx, 1, hq, hkv, d, s.block_size, s.dtype, device)
    args = (p["q"], paged_kv(p), d**-0.5)
    kv_bytes = 2 * s.decode_batch * s.decode_ctx * hkv * d * p["k_cache"].element_size()

    def measure(cfg: triton_decode.DecodeConfig | None) -> dict[str, Any]:
        ms = bench_ms(lambda: triton_decode.paged_attention_decode(*args, config=cfg), device)
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        return {
            "config": asdict(cfg) if cfg else "default",
            "ms": ms,
            "gbps": gbps,
            "fraction_of_copy": gbps / copy_gbps,
        }

    default = measure(None)
    n = min(4, s.decode_batch)  # correctness at this shape on a few sequences
    sub = (p["q"][:n], paged_kv(p, n), d**-0.5)
    err = (
        (
            triton_ops.paged_attention_decode(*sub).float()
            - torch_ref.paged_attention_decode(*sub).float()
        )
        .abs()
        .max()
        .item()
    )
    sweep = []
    if s.sweep:
        for tile_n in (64, 128):
            for splits in (1, 2, 4):
                for warps in (4, 8):
                    cfg = triton_decode.DecodeConfig(
                        tile_n=tile_n, num_splits=splits, num_warps=warps
                    )
                    if over_budget():
                        sweep.append({"config": asdict(cfg), "error": "skipped: time budget spent"})
                        continue
                    try:
                        sweep.append(measure(cfg))
                    except Exception as exc:  # e.g. out of shared memory for one config
                        sweep.append({"config": asdict(cfg), "error": repr(exc)[:300]})
    ok = [r for r in sweep if "gbps" in r]
    best = max(ok + [default], key=lambda r: r["gbps"])
    return {
        "shape": {
            "batch": s.decode_batch,
            "context": s.decode_ctx,
            "hq": hq,
            "hkv": hkv,
            "head_dim": d,
            "block_size": s.block_size,
            "dtype": str(s.dtype),
        },
        "kv_bytes": kv_bytes,
        "max_abs_err_vs_torch_ref": err,
        "method": "gbps = K + V cache bytes of all contexts read / time (q, out, tables ignored)",
        "default_num_splits": triton_decode.choose_num_splits(
            s.decode_batch,
            hkv,
            p["block_tables"].shape[1] * s.block_size,
            device,
            DecodeDefaults.tile_n,
        ),
        "default": default,
        "best": best,
        "sweep": sweep,
    }


def prefill_bench(s: Sizes, prefix: int, device: torch.device) -> dict[str, Any]:
    """Prefill TFLOP/s of the Triton kernel (and of SDPA when there is no cached prefix)."""
    hq, hkv, d = s.heads
    q_len, ctx = s.prefill_len, prefix + s.prefill_len
    p = make_paged(s.prefill_batch, ctx, q_len, hq, hkv, d, s.block_size, s.dtype, device)
    args = prefill_args(p, d)
    flops = 4 * s.prefill_batch * hq * d * (q_len * prefix + q_len * q_len / 2)

    def measure(cfg: triton_prefill.PrefillConfig | None) -> dict[str, Any]:
        ms = bench_ms(lambda: triton_prefill.paged_attention_prefill(*args, config=cfg), device)
        return {
            "config": asdict(cfg) if cfg else "default",
            "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12,
        }

    out: dict[str, Any] = {
        "shape": {
            "batch": s.prefill_batch,
            "q_len": q_len,
            "prefix": prefix,
            "hq": hq,
            "hkv": hkv,
            "head_dim": d,
            "dtype": str(s.dtype),
        },
        "flops": flops,
        "default": measure(None),
    }
    sweep = []
    if s.sweep:
        for bm, bn, warps, stages in (
            (64, 64, 4, 2),
            (128, 64, 4, 2),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (64, 32, 4, 3),
            (128, 128, 8, 2),
        ):
            cfg = triton_prefill.PrefillConfig(bm, bn, warps, stages)
            if over_budget():
                sweep.append({"config": asdict(cfg), "error": "skipped: time budget spent"})
                continue
            try:
                sweep.append(measure(cfg))
            except Exception as exc:
                sweep.append({"config": asdict(cfg), "error": repr(exc)[:300]})
    out["sweep"] = sweep
    out["best"] = max(
        [r for r in sweep if "tflops" in r] + [out["default"]], key=lambda r: r["tflops"]
    )
    if prefix == 0:
        b = s.prefill_batch
        q = p["q"].view(b, q_len, hq, d).transpose(1, 2)
        k = torch.randn(b, hq, q_len, d, device=device, dtype=s.dtype)  # K/V already at Hq heads
        v = torch.randn_like(k)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms = bench_ms(lambda: sdpa(q, k, v, is_causal=True), device)
        out["sdpa"] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        out["best_vs_sdpa"] = out["best"]["tflops"] / out["sdpa"]["tflops"]
    return out


def _prompts(n: int) -> list[str]:
    """User tasks from ../shared/workloads when present, else synthetic ~300-character prompts."""
    path = SHARED / "workloads" / "user_tasks.jsonl"
    texts: list[str] = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                texts.append(json.loads(line)["instruction"])
    if not texts:
        texts = [
            f"Task {i}: " + "describe the trade-offs of paged attention in detail. " * 5
            for i in range(n)
        ]
    return [texts[i % len(texts)] for i in range(n)]


def engine_bench(s: Sizes, device: torch.device, dry: bool) -> dict[str, Any]:
    """Output tokens/s of ``LLM.generate`` (ignore_eos, greedy) per kernel backend."""
    from prefixgate.engine.llm import LLM
    from prefixgate.engine.sampling_params import SamplingParams

    model_dir = SHARED / "models" / "smollm2-135m-shape"
    if dry:
        kwargs: dict[str, Any] = {"model": None, "dtype": "float32"}
    elif (model_dir / "config.json").exists():
        kwargs = {"model": str(model_dir), "load_format": "dummy", "dtype": "bfloat16"}
    else:  # the built-in preset reshaped to SmolLM2-135M (vocab 354 instead of 49,152)
        kwargs = {"model": None, "dtype": "bfloat16", "hf_overrides": SMOLLM2_OVERRIDES}
    if not dry:
        kwargs["kv_cache_memory"] = 4 << 30  # room for every request: no preemption in the timing
    prompts = _prompts(s.engine_prompts)
    params = SamplingParams(max_tokens=s.engine_max_tokens, temperature=0.0, ignore_eos=True)
    result: dict[str, Any] = {
        "model": kwargs.get("model")
        or "tiny-random" + ("+smollm2-shape" if "hf_overrides" in kwargs else ""),
        "dtype": kwargs["dtype"],
        "prompts": len(prompts),
        "max_tokens": s.engine_max_tokens,
    }
    tokens: dict[str, list[list[int]]] = {}
    for backend in ("triton", "torch"):
        llm = LLM(
            device=device.type,
            attention_backend=backend,
            max_num_seqs=max(64, len(prompts)),
            **kwargs,
        )
        llm.generate(
            prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )  # warm-up / JIT
        outs, wall = timed_generate(llm, prompts, params, device)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        result[backend] = {
            "wall_s": wall,
            "output_tokens": n_out,
            "output_tokens_per_s": n_out / wall,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        }
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"], strict=True))
    result["greedy_equal_sequences"] = (
        f"{same}/{len(prompts)} (bf16 with random weights may diverge on near-ties)"
    )
    return result


def engine_variants_bench(s: Sizes, device: torch.device, dry: bool) -> dict[str, Any]:
    """Decode-path options side by side on the Triton backend: eager, ``cuda_graphs=True``,
    ``quantization="int8"`` and both; output tokens/s and greedy agreement with eager.

    CUDA graphs need a GPU: in a dry run (CPU) only eager and int8 run."""
    from prefixgate.engine.llm import LLM
    from prefixgate.engine.sampling_params import SamplingParams

    model_dir = SHARED / "models" / "smollm2-135m-shape"
    if dry:
        kwargs: dict[str, Any] = {"model": None, "dtype": "float32", "attention_backend": "torch"}
    elif (model_dir / "config.json").exists():
        kwargs = {"model": str(model_dir), "load_format": "dummy", "dtype": "bfloat16"}
    else:
        kwargs = {"model": None, "dtype": "bfloat16", "hf_overrides": SMOLLM2_OVERRIDES}
    if not dry:
        kwargs["kv_cache_memory"] = 4 << 30
        kwargs["attention_backend"] = "triton"
    variants = {"eager": {}, "int8": {"quantization": "int8"}}
    if device.type == "cuda":
        variants["cuda_graphs"] = {"cuda_graphs": True}
        variants["int8_cuda_graphs"] = {"quantization": "int8", "cuda_graphs": True}
    result: dict[str, Any] = {"dtype": kwargs["dtype"]}
    tokens: dict[str, list[list[int]]] = {}
    for batch in (1, 8, 32) if not dry else (1, 3):
        prompts = _prompts(batch)
        params = SamplingParams(max_tokens=s.engine_max_tokens, temperature=0.0, ignore_eos=True)
        for name, extra in variants.items():
            llm = LLM(device=device.type, max_num_seqs=64, **kwargs, **extra)
            llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            outs, wall = timed_generate(llm, prompts, params, device)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            tokens[name] = toks
            n_out = sum(map(len, toks))
            row = {"output_tokens_per_s": n_out / wall, "wall_s": wall}
            if name != "eager":
                base = tokens["int8"] if name == "int8_cuda_graphs" else tokens["eager"]
                same = sum(a == b for a, b in zip(toks, base, strict=True))
                row["greedy_equal_sequences"] = f"{same}/{len(toks)}"
                row["first_token_equal"] = sum(
                    a[:1] == b[:1] for a, b in zip(toks, base, strict=True)
                )
            result[f"batch{batch}_{name}"] = row
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["note"] = (
        "cuda_graphs compares with eager, int8_cuda_graphs with int8: a replay pads the batch "
        "to a captured size, so GEMMs may pick other algorithms (bf16 near-ties may diverge); "
        "int8 compares with bf16 eager"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check.json", help="JSON results file")
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny sizes; runs on CPU in the interpreter"
    )
    ap.add_argument("--skip-engine", action="store_true", help="kernels only")
    ap.add_argument(
        "--sweep", action="store_true", help="run the launch-config sweeps in a dry run too"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=180.0,
        help="seconds after which launch-config sweeps are skipped (the engine still runs)",
    )
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        print("no CUDA device: use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    s = DRY if args.dry_run else FULL
    if args.sweep:
        s = replace(s, sweep=True)
    t0 = time.perf_counter()
    DEADLINE[0] = t0 + args.budget_s
    results: dict[str, Any] = {
        "dry_run": args.dry_run,
        "target_fraction_of_copy": TARGET_FRACTION,
        "errors": {},
    }

    def section(name: str, fn) -> Any:
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results["errors"][name] = traceback.format_exc()[-2000:]
            print(f"[{name}] FAILED:\n{results['errors'][name]}", file=sys.stderr)
        print(f"[{name}] {time.perf_counter() - start:.1f} s", file=sys.stderr)
        Path(args.out).write_text(
            json.dumps(results, indent=2, default=str)
        )  # keep partial results
        return results.get(name)

    hq, hkv, d = s.heads
    kv_bytes = (
        2 * s.decode_batch * s.decode_ctx * hkv * d * torch.tensor([], dtype=s.dtype).element_size()
    )
    section("env", lambda: env_info(device))
    section("correctness", lambda: check_correctness(device, args.dry_run))
    copy = section("copy", lambda: copy_bandwidth(kv_bytes, device))
    copy_gbps = copy["gbps"] if copy else float("nan")
    section("decode", lambda: decode_bench(s, hq, hkv, d, copy_gbps, device))
    section("decode_smollm2_heads", lambda: decode_bench(s, 9, 3, 64, copy_gbps, device))
    section("prefill", lambda: prefill_bench(s, 0, device))
    section("prefill_with_prefix", lambda: prefill_bench(s, s.prefix_len, device))
    if not args.skip_engine:
        section("engine", lambda: engine_bench(s, device, args.dry_run))
        section("engine_variants", lambda: engine_variants_bench(s, device, args.dry_run))
    dec = results.get("decode")
    if dec:
        frac = dec["best"]["fraction_of_copy"]
        results["summary"] = {
            "decode_fraction_of_copy_default": dec["default"]["fraction_of_copy"],
            "decode_fraction_of_copy_best": frac,
            "decode_target_met": bool(frac >= TARGET_FRACTION),
            "prefill_best_vs_sdpa": results.get("prefill", {}).get("best_vs_sdpa"),
        }
    results["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps(results.get("summary", {}), indent=2))
    print(f"results written to {args.out} ({results['wall_s']:.0f} s)", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
