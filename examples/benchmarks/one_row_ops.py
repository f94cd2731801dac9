"""Batch-1 decode with and without prefixgate's CPU ops (``kernels/cpu_ext.py``), side by side in
one process, and the share of the memory-bandwidth bound each reaches.

One ``LLM`` (CPU, dummy weights of ``--model``, fp32 or ``--int8``) decodes ``--max-tokens``
tokens (greedy, ``ignore_eos``) after one ``--prompt-len``-token prompt, ``--rounds`` times under
each setting, the settings alternating within each round (a change of the host's load hits all
alike):

- ``old``: the one-row GEMMs without prefixgate's GEMV (fp32: ``calibrate_one_row`` rerun over
  ``onednn`` / ``linear`` / ``mm_t``; int8: FBGEMM) and torch's small ops;
- ``gemv``: the GEMMs the loader chose (prefixgate's GEMV where it won) and torch's small ops;
- ``fused``: those GEMMs and the fused one-row ops (``layers.set_one_row_ops``), one op call
  each;
- ``layer``: those ops as one ``cpu_ext.decode_layer`` call a layer
  (``layers.set_one_row_layers``), what the loader sets up for a model of this size.

Also printed: the copy bandwidth at ``--threads`` (``dst.copy_(src)`` of 256 MiB, read + write
bytes counted; best of 5), the linear weights a step streams, and for each setting tok/s and
``weights * tok/s / copy bandwidth`` (the share of the bound: a step must read every weight
once). ``--gemv`` prints one-row GEMM microseconds per SmolLM2 shape instead (each kind over 30
copies of the weight, as a step reads them; fp32 kinds and the int8 GEMV).

Usage::

    python -m examples.benchmarks.one_row_ops [--threads 1] [--int8] [--rounds 3]
        [--max-tokens 48] [--gemv] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from prefixgate.sdk.bench.shared import shared_dir

SHARED = shared_dir()
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
"""SmolLM2-135M's linear shapes ``(out, in)``: qkv, o, gate_up, down, the LM head."""


def copy_bandwidth(reps: int = 5) -> float:
    """Best ``dst.copy_(src)`` bandwidth over 256 MiB fp32, GB/s of read + write bytes."""
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def gemv_table(reps: int = 3) -> None:
    """One-row microseconds per shape: fp32 ``linear`` / ``mm_t`` / ``onednn`` / ``gemv`` and
    the int8 ``fbgemm`` / ``gemv``, fastest of ``reps`` passes over 30 copies (1 for the head)."""
    import torch.nn.functional as F
    from prefixgate.engine.models.cpu_linear import OneDNNLinear
    from prefixgate.engine.models.quantization import Int8Linear
    from prefixgate.kernels import cpu_ext

    have = cpu_ext.available()
    for out, inp in SHAPES:
        n = 2 if out == 49152 else 30
        ws = [torch.randn(out, inp) * 0.05 for _ in range(n)]
        x = torch.randn(1, inp)
        fns: dict[str, list[Any]] = {
            "linear": [lambda x, w=w: F.linear(x, w) for w in ws],
            "mm_t": [lambda x, w=w.t().contiguous(): torch.mm(x, w) for w in ws],
        }
        dnn = [OneDNNLinear(w, None) for w in ws]
        fns["onednn"] = [
            lambda x, m=m: torch.ops.mkldnn._linear_pointwise(x, m._packed, None, "none", [], "")
            for m in dnn
        ]
        q8 = [Int8Linear.from_linear(torch.nn.Linear(inp, out, bias=False)) for _ in range(n)]
        fns["int8_fbgemm"] = [m._forward_cpu for m in q8]
        if have:
            fns["gemv"] = [
                lambda x, p=cpu_ext.pack_panels(w), o=out: cpu_ext.gemv(x, p, None, o) for w in ws
            ]
            fns["int8_gemv"] = [
                lambda x, p=cpu_ext.pack_panels_int8(m.qweight, m.scale), o=out: cpu_ext.gemv_int8(
                    x, p[0], p[1], None, o
                )
                for m in q8
            ]
        best = dict.fromkeys(fns, float("inf"))
        with torch.inference_mode():
            for _ in range(reps):
                for kind, fs in fns.items():
                    t0 = time.perf_counter()
                    for f in fs:
                        f(x)
                    best[kind] = min(best[kind], (time.perf_counter() - t0) / n)
        print(f"{out}x{inp}: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in best.items()))


def run(args: argparse.Namespace) -> None:
    from prefixgate.engine import LLM, SamplingParams
    from prefixgate.engine.models import cpu_linear
    from prefixgate.engine.models.cpu_linear import OneDNNLinear
    from prefixgate.engine.models.layers import set_one_row_layers, set_one_row_ops
    from prefixgate.engine.models.quantization import Int8Linear

    bw = copy_bandwidth()
    llm = LLM(
        str(args.model),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        threads=args.threads,
        quantization="int8" if args.int8 else None,
    )
    model = llm.engine.runner.model
    kind_of = Int8Linear if args.int8 else OneDNNLinear
    layers: list[Any] = [m for m in model.modules() if isinstance(m, kind_of)]
    new = [m.one_row for m in layers]
    if args.int8:
        old = ["fbgemm"] * len(layers)
    else:
        saved = cpu_linear.one_row_kinds
        cpu_linear.one_row_kinds = lambda: ("onednn", "linear", "mm_t")  # type: ignore[assignment]
        try:
            cpu_linear.calibrate_one_row(model, copies=True)
        finally:
            cpu_linear.one_row_kinds = saved  # type: ignore[assignment]
        old = [m.one_row for m in layers]
    fused_on = any(getattr(m, "one_row_ops", False) for m in model.modules())
    layer_on = any(getattr(m, "one_row_layer", False) for m in model.modules())
    settings = {
        "old": (old, False, False),
        "gemv": (new, False, False),
        "fused": (new, fused_on, False),
        "layer": (new, fused_on, layer_on),
    }
    wbytes = sum(m.out_features * m.in_features * (1 if args.int8 else 4) for m in layers)
    print(
        f"threads {args.threads}, {'int8' if args.int8 else 'fp32'}, load average "
        f"{os.getloadavg()[0]:.2f}; copy bandwidth {bw:.1f} GB/s; linear weights {wbytes / 1e6:.0f} MB"
    )
    for name, (kinds, fused, per_layer) in settings.items():
        shapes = sorted(
            {f"{m.out_features}x{m.in_features} {k}" for m, k in zip(layers, kinds, strict=True)}
        )
        how = "; one call a layer" if per_layer else "; fused ops" if fused else ""
        print(f"  {name}: {', '.join(shapes)}{how}")

    def use(name: str) -> None:
        kinds, fused, per_layer = settings[name]
        for m, k in zip(layers, kinds, strict=True):
            if m.one_row != k:
                m.set_one_row(k)
        if fused_on:
            set_one_row_ops(model, fused)
        if layer_on:
            set_one_row_layers(model, per_layer)

    prompt = list(range(100, 100 + args.prompt_len))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tok_s: dict[str, list[float]] = {k: [] for k in settings}
    tokens: dict[str, list[int]] = {}
    for name in settings:  # warm-up
        use(name)
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(args.rounds):
        for name in settings:
            use(name)
            t0 = time.perf_counter()
            out = llm.generate([prompt], sp)
            tok_s[name].append(args.max_tokens / (time.perf_counter() - t0))
            tokens.setdefault(name, list(out[0].outputs[0].token_ids))
    base = statistics.median(tok_s["old"])
    for name, v in tok_s.items():
        med = statistics.median(v)
        print(
            f"{name:6s} {med:6.1f} tok/s ({min(v):.1f}-{max(v):.1f}), step {1e3 / med:6.1f} ms, "
            f"{wbytes * med / 1e9 / bw * 100:4.0f} % of the copy-bandwidth bound, x{med / base:.2f}"
        )
    same = all(t == tokens["old"] for t in tokens.values())
    print(f"same tokens in every setting: {same}; load average {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gemv", action="store_true", help="one-row GEMM us per shape instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gemv:
        print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
        gemv_table()
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
