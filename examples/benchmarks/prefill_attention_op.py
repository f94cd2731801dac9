"""The prefill-attention op alone: ``cpu_ext.prefill_attention`` (AVX-512, read through the
block tables) against ``torch_ref.paged_attention_prefill`` (K/V gathered, then SDPA), in-process.

SmolLM2-135M's attention shape (9 query / 3 KV heads, D 64, blocks of 16, blocks scattered over
the pool as a running engine's are), three batches:

- ``fresh``: one fresh 1,088-token prompt (SDPA's ``is_causal`` path);
- ``batch``: 32 fresh prompts of 128 tokens (``is_causal`` too);
- ``chunk``: a 512-token chunk after a 576-token cached prefix (SDPA with a boolean mask).

Each ``--layers`` layers' own caches in turn (a forward pass's order: each call reads K/V the
others pushed out of the caches), both paths interleaved round by round so the host's load
weighs on each alike, in fp32 and bf16. Printed: milliseconds a call (median, min, max over the
rounds; wall time at ``--threads``), GFLOP/s of the median (4 * D * Hq * causal query-key pairs:
Q.K^T and P.V, the pairs a causal mask keeps), the speed-up, and the load average.

``--engine``: instead, a whole 1,088-token prefill (one engine step, ``forward_s`` of
``LLMEngine.timing``) of SmolLM2-135M's shape with dummy weights (``--model``, all 30 layers;
the loader turns the batched CPU ops on for it), with the kernel and with the torch path
(``cpu_ext.prefill_attention_supported`` answering False), interleaved; a new prompt each
time (no prefix-cache hit).

    python -m examples.benchmarks.prefill_attention_op [--threads 2] [--rounds 15] [--layers 4]
    python -m examples.benchmarks.prefill_attention_op --engine [--threads 2] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prefixgate.kernels import cpu_ext, torch_ref
from prefixgate.kernels.paged import PagedKV

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16

BATCHES = {  # name: (query lengths, context lengths)
    "fresh": ([1088], [1088]),
    "batch": ([128] * 32, [128] * 32),
    "chunk": ([512], [1088]),
}


def _case(
    q_lens: list[int], ctx: list[int], layers: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, list[PagedKV], torch.Tensor]:
    """``(q [T, Hq, D], one PagedKV a layer, query_start_loc)`` over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    per_seq = (max(ctx) + BLOCK - 1) // BLOCK
    blocks = batch * per_seq + 8
    tables = torch.randperm(blocks, generator=g)[: batch * per_seq].view(batch, per_seq)
    tables = tables.to(torch.int32).contiguous()
    lens = torch.tensor(ctx, dtype=torch.int32)
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kvs = [
        PagedKV(
            torch.randn(shape, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype),
            tables,
            lens,
        )
        for _ in range(layers)
    ]
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kvs, qsl


def _flops(q_lens: list[int], ctx: list[int]) -> float:
    """Q.K^T and P.V over the causal pairs: 4 * D * Hq a (query, visible key) pair."""
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, ctx, strict=True))
    return 4.0 * HEAD_DIM * HEADS * pairs


def _engine(args: argparse.Namespace) -> int:
    """Whole 1,088-token prefills with the kernel and with the torch path, interleaved."""
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine
    from prefixgate.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", threads=args.threads))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    supported = cpu_ext.prefill_attention_supported
    times: dict[str, list[float]] = {"torch_ref": [], "cpu_ext": []}
    gen = torch.Generator().manual_seed(0)
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    try:
        for n in range(args.rounds + 1):
            for path in times:
                cpu_ext.prefill_attention_supported = (  # type: ignore[method-assign]
                    supported if path == "cpu_ext" else lambda head_dim, group: False
                )
                prompt = torch.randint(100, 40000, (1088,), generator=gen).tolist()
                engine.add_request(f"{path}{n}", prompt, params)
                before = engine.timing["forward_s"]
                engine.step()
                while engine.has_unfinished_requests():
                    engine.step()
                if n:  # the first round warms up
                    times[path].append(engine.timing["forward_s"] - before)
    finally:
        cpu_ext.prefill_attention_supported = supported  # type: ignore[method-assign]
        engine.shutdown()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"1,088-token prefill, {args.threads} threads, {args.rounds} rounds (forward_s)")
    print("path       median ms  min ms  max ms")
    for path, xs in times.items():
        print(
            f"{path:10} {statistics.median(xs) * 1e3:9.1f} {min(xs) * 1e3:7.1f} "
            f"{max(xs) * 1e3:7.1f}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default=",".join(BATCHES))
    p.add_argument("--engine", action="store_true", help="whole prefills instead of the op")
    p.add_argument(
        "--model",
        default=str(Path(__file__).parents[2].parent / "shared/models/smollm2-135m-shape"),
    )
    args = p.parse_args(argv)
    if not cpu_ext.available() or not cpu_ext.prefill_attention_supported(HEAD_DIM, 3):
        raise SystemExit("the AVX-512 prefill attention is not available here (see the log)")
    if args.engine:
        return _engine(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    scale = HEAD_DIM**-0.5
    paths: dict[str, Callable[..., torch.Tensor]] = {
        "torch_ref": torch_ref.paged_attention_prefill,
        "cpu_ext": cpu_ext.prefill_attention,
    }
    times: dict[tuple[str, str, str], list[float]] = {}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    try:
        for name in args.batches.split(","):
            q_lens, ctx = BATCHES[name]
            for dt in (torch.float32, torch.bfloat16):
                q, kvs, qsl = _case(q_lens, ctx, args.layers, dt)
                for fn in paths.values():  # warm-up (and the first call's allocations)
                    fn(q, kvs[0], qsl, scale)
                for _ in range(args.rounds):
                    for path, fn in paths.items():
                        t0 = time.perf_counter()
                        for kv in kvs:
                            fn(q, kv, qsl, scale)
                        dt_s = (time.perf_counter() - t0) / len(kvs)
                        key = (name, str(dt).removeprefix("torch."), path)
                        times.setdefault(key, []).append(dt_s)
    finally:
        torch.set_num_threads(threads)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(
        f"{HEADS}/{KV_HEADS} heads, D {HEAD_DIM}, blocks of {BLOCK}, {args.threads} threads, "
        f"{args.rounds} rounds x {args.layers} layers"
    )
    print("batch  dtype     path       median ms  min ms  max ms  GFLOP/s  speed-up")
    for (name, dtype, path), xs in times.items():
        med = statistics.median(xs)
        base = statistics.median(times[(name, dtype, "torch_ref")])
        gflops = _flops(*BATCHES[name]) / med / 1e9
        print(
            f"{name:6} {dtype:9} {path:10} {med * 1e3:9.3f} {min(xs) * 1e3:7.3f} "
            f"{max(xs) * 1e3:7.3f} {gflops:8.1f} {base / med:8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
