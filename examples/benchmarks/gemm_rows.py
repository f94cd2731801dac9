"""A decode step's linears at a few rows: oneDNN against ``cpu_ext.gemm_panels`` (in-process).

Each linear shape of SmolLM2-135M (q/k/v 960 x 576, o 576 x 576, gate/up 3,072 x 576, down
576 x 1,536, LM head 49,152 x 576), fp32, as ``OneDNNLinear`` holds it (oneDNN's packed
weight; ``gemm_panels`` reads its 64-wide panels in place). ``--copies`` copies of each layer
weight are called in turn, one call each, so the weights stream from memory as in a forward
pass (not one weight again and again from the caches). Both ways interleaved round by round;
printed per shape and ``--rows``: microseconds a call (best of ``--rounds``, wall time at
``--threads``) and the sum a step takes (30 layers and the head).

    python -m examples.benchmarks.gemm_rows [--rows 4 8 16 32 64] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from prefixgate.engine.models.cpu_linear import OneDNNLinear
from prefixgate.kernels import cpu_ext

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
LAYERS = 30


def _best(fn, layers: list[OneDNNLinear], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for layer in layers:
            fn(layer)
        best = min(best, (time.perf_counter() - t0) / len(layers))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=30, help="copies of each layer weight")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    args = ap.parse_args(argv)
    if not (cpu_ext.available() and cpu_ext.gemm_rows_available()):
        print("gemm_panels is not available here (prefixgate CPU ops with AVX-512)")
        return 1
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        print(f"load {os.getloadavg()[0]:.2f}, threads {args.threads}, rounds {args.rounds}")
        print(f"{'shape':>12} {'rows':>4} {'onednn us':>10} {'gemm_panels us':>15} {'ratio':>6}")
        step = {m: [0.0, 0.0] for m in args.rows}
        for out_f, in_f in SHAPES[: args.shapes]:
            head = out_f > 10_000
            g = torch.Generator().manual_seed(out_f + in_f)
            n = 2 if head else args.copies
            layers = [
                OneDNNLinear(torch.randn(out_f, in_f, generator=g) * 0.02, None) for _ in range(n)
            ]
            if not layers[0]._gemm_rows():
                print(f"{out_f}x{in_f}: oneDNN packs it in another layout here; skipped")
                continue
            for m in args.rows:
                x = torch.randn(m, in_f, generator=g)

                def onednn(layer: OneDNNLinear, x: torch.Tensor = x) -> None:
                    torch.ops.mkldnn._linear_pointwise(x, layer._packed, None, "none", [], "")

                def ours(layer: OneDNNLinear, x: torch.Tensor = x, n: int = out_f) -> None:
                    cpu_ext.gemm_panels(x, layer._panels, None, n)

                a = b = float("inf")
                for _ in range(2):  # interleaved
                    a = min(a, _best(onednn, layers, args.rounds))
                    b = min(b, _best(ours, layers, args.rounds))
                times = 1 if head else LAYERS
                step[m][0] += a * times
                step[m][1] += b * times
                print(f"{out_f:>6}x{in_f:<5} {m:>4} {a * 1e6:10.0f} {b * 1e6:15.0f} {a / b:6.2f}")
        for m, (a, b) in step.items():
            print(
                f"a step's linears at {m} rows: oneDNN {a * 1e3:.1f} ms, gemm_panels {b * 1e3:.1f} ms"
            )
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
