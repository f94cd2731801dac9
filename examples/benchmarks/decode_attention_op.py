"""The batched decode-attention op alone, as a batched decode round calls it (in-process).

``cpu_ext.decode_attention`` (rotary + KV write + paged attention of B decode rows) on
SmolLM2-135M's attention shape (9 query / 3 KV heads, D 64, blocks of 16), ``--rows`` rows
whose contexts are drawn from ``--context`` (a 32 x (128 in, 64 out) round sees 129-192),
their blocks scattered over the pool as a running engine's are. Two settings:

- ``cold``: ``--layers`` layers' own caches called in turn, as a forward pass does (each call
  reads its K/V after the other layers' have pushed it out of the caches);
- ``warm``: one layer's cache called again and again.

Each kernel the op can take on this CPU (``avx512``: the AVX-512 kernel; ``avx2``: the AVX2
kernel, forced with ``PREFIXGATE_CPU_EXT_AVX512=0``) in fp32 and bf16, interleaved round by
round so the host's load weighs on each alike. Printed: milliseconds a call (median and
min over the rounds; wall time at ``--threads``) and the load average.

    python -m examples.benchmarks.decode_attention_op [--rows 32] [--threads 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from prefixgate.kernels import cpu_ext

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
KERNEL_ENV = "PREFIXGATE_CPU_EXT_AVX512"


def _case(rows: int, lo: int, hi: int, layers: int, dtype: torch.dtype, seed: int = 0):
    """One round's arguments: ``layers`` caches and the rows' qkv, positions, tables."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (rows,), generator=g, dtype=torch.int32)
    per_row = (hi + BLOCK - 1) // BLOCK
    blocks = rows * per_row + 8
    tables = torch.randperm(blocks, generator=g)[: rows * per_row].view(rows, per_row)
    tables = tables.to(torch.int32).contiguous()
    positions = (lengths - 1).to(torch.int64)
    slot = torch.stack(
        [
            tables[r, int(positions[r]) // BLOCK] * BLOCK + int(positions[r]) % BLOCK
            for r in range(rows)
        ]
    ).to(torch.int64)
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(layers)
    ]
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(hi + 1).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
    return qkv, positions, cos_sin, caches, tables, lengths, slot


def _call(args, cache) -> None:
    qkv, positions, cos_sin, _, tables, lengths, slot = args
    cpu_ext.decode_attention(
        qkv, positions, cos_sin, cache[0], cache[1], tables, lengths, slot,
        HEADS, KV_HEADS, HEAD_DIM**-0.5,
    )  # fmt: skip


def _run(args: argparse.Namespace) -> dict[tuple[str, str, str], list[float]]:
    """Every round: each kernel, each dtype, cold then warm; seconds a call by key
    ``(kernel, dtype, setting)``."""
    lo, hi = (int(x) for x in args.context.split("-"))
    kernels = ["avx512", "avx2"] if cpu_ext.attention_kernel() == "avx512" else ["avx2"]
    cases = {
        dt: _case(args.rows, lo, hi, args.layers, dt) for dt in (torch.float32, torch.bfloat16)
    }
    times: dict[tuple[str, str, str], list[float]] = {}
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    for _ in range(args.rounds):
        for kernel in kernels:
            os.environ[KERNEL_ENV] = "1" if kernel == "avx512" else "0"
            for dt, case in cases.items():
                name = str(dt).removeprefix("torch.")
                caches = case[3]
                t0 = time.perf_counter()
                for cache in caches:
                    _call(case, cache)
                cold = (time.perf_counter() - t0) / len(caches)
                _call(case, caches[0])
                t0 = time.perf_counter()
                for _ in caches:
                    _call(case, caches[0])
                warm = (time.perf_counter() - t0) / len(caches)
                times.setdefault((kernel, name, "cold"), []).append(cold)
                times.setdefault((kernel, name, "warm"), []).append(warm)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", default="129-192", help="lo-hi context lengths (tokens)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    if not cpu_ext.available():
        raise SystemExit("the CPU ops are not available here (see the log)")
    threads, choice = torch.get_num_threads(), os.environ.get(KERNEL_ENV)
    torch.set_num_threads(args.threads)
    try:
        times = _run(args)
    finally:  # as found: an in-process caller's threads and kernel choice
        torch.set_num_threads(threads)
        if choice is None:
            os.environ.pop(KERNEL_ENV, None)
        else:
            os.environ[KERNEL_ENV] = choice
    lo, hi = (int(x) for x in args.context.split("-"))
    print(
        f"{args.rows} rows, context {lo}-{hi}, {HEADS}/{KV_HEADS} heads, D {HEAD_DIM}, "
        f"{args.threads} threads, {args.rounds} rounds"
    )
    print("kernel  dtype     setting  median ms  min ms")
    for (kernel, name, setting), xs in times.items():
        print(
            f"{kernel:7} {name:9} {setting:8} {statistics.median(xs) * 1e3:9.3f} "
            f"{min(xs) * 1e3:7.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
