"""Weight quantization: ``quantization="int8"`` (int8 weights, one fp32 scale per output channel).

Every linear layer of the model (merged q/k/v, o, merged gate/up, down and the LM head) is
replaced by :class:`Int8Linear` after the weights are loaded. Weights are quantized
symmetrically per output channel (absmax / 127, round to nearest, zero point 0), the scheme of
LLM.int8()'s weight side and of torchao's ``Int8WeightOnlyConfig``. The embedding stays in the
model dtype (a tied LM head gets its own int8 copy).

The matmul runs on:

- CPU: torch's quantized engine (FBGEMM / x86), ``torch.ops.quantized.linear_dynamic``: the
  activations are quantized to uint8 on the fly, per token in effect (each row scaled to
  absmax 1, see :meth:`Int8Linear._forward_cpu`), int8 x uint8 GEMM with int32 accumulation,
  output fp32. A row's result does not depend on the rest of the batch. Needs
  ``dtype="float32"``. Chosen because it was faster than fp32 at batch 1-128 where torchao's
  int8 configs and ``torch._int_mm`` were slower (docs/benchmarks/cpu-gemm.md).
  **One row** (batch-1 decode, models past ``cpu_linear.CALIBRATION_MIN_BYTES`` of int8
  weights only: :func:`calibrate_int8_one_row`): where prefixgate's AVX2 int8 GEMV
  (:func:`prefixgate.kernels.cpu_ext.gemv_int8`) measured faster, a one-row input takes it
  instead: int8 weights widened to fp32 in registers, fp32 activations (not quantized) and
  accumulation ("gemv"), or activations quantized per row to int16 with exact int32 products
  ("gemv16", error at most ``0.5 / 32767`` of the row's absmax per weight), or activations
  quantized per block of 32 columns to int8 with exact int32 block sums ("gemv8", as ggml's
  Q8_0 dot products; error at most ``0.5 / 127`` of the block's absmax per weight, finer than
  FBGEMM's one scale a row); either way a lone
  row's result is ``x @ (q * scale)^T`` to within that and differs from the same row's in a
  batch by the 8-bit activation quantization FBGEMM applies (the lone row is the more exact). Test models are below the size gate and keep FBGEMM at every row count.
- CUDA: the Triton weight-only GEMM :func:`prefixgate.kernels.triton_int8.int8_linear` (int8
  weights dequantized in registers, fp32 accumulation; fp32 / fp16 / bf16 activations).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import torch
from prefixgate.engine.models.cpu_linear import (
    CALIBRATION_BYTES,
    CALIBRATION_MIN_BYTES,
    OneDNNLinear,
    fastest_one_row,
)
from prefixgate.kernels import cpu_ext
from torch import nn

logger = logging.getLogger(__name__)

INT8_ONE_ROW_KINDS = ("fbgemm", "gemv", "gemv16", "gemv8")
"""The GEMMs a one-row input of an :class:`Int8Linear` on CPU may take: FBGEMM's
``linear_dynamic`` (as every other row count), or prefixgate's AVX2 int8 GEMV on a panel copy
of the int8 weight with the activations of :data:`GEMV_ACTIVATIONS`: fp32 ("gemv",
``cpu_ext.pack_panels_int8``), int16 per row with exact int32 pair products ("gemv16",
``cpu_ext.pack_pairs_int8``; half the instructions per weight), or int8 per block of 32
columns with exact int32 block sums ("gemv8", ``cpu_ext.pack_quads_int8``; AVX-VNNI where the
CPU has it, a quarter of fp32's instructions per weight)."""

GEMV_ACTIVATIONS = {"gemv": "fp32", "gemv16": "int16", "gemv8": "int8"}
"""One-row GEMV kind → the ``activations`` of ``cpu_ext.gemv_int8``."""

_GEMV_PACK = {
    "gemv": cpu_ext.pack_panels_int8,
    "gemv16": cpu_ext.pack_pairs_int8,
    "gemv8": cpu_ext.pack_quads_int8,
}

QUANTIZATION_METHODS = ("int8",)


def check_quantization(method: str | None, device: str, dtype: torch.dtype) -> None:
    """Refuse unsupported combinations before any weight is loaded.

    Raises:
        ValueError: an unknown method; int8 on CPU with a dtype other than float32 or without a
            quantized engine (FBGEMM / x86 / ONEDNN); int8 on CUDA without Triton; int8 on any
            other device.
    """
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unsupported quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    dev = torch.device(device)
    if dev.type == "cpu":
        if dtype != torch.float32:
            raise ValueError(
                f"quantization='int8' on CPU needs dtype float32 (torch's dynamic int8 linear "
                f"takes fp32 activations), got {str(dtype).removeprefix('torch.')}"
            )
        if cpu_quantized_engine() is None:
            raise ValueError(
                "quantization='int8' on CPU needs torch's FBGEMM / x86 quantized engine, "
                f"not available here (supported: {torch.backends.quantized.supported_engines})"
            )
    elif dev.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ValueError("quantization='int8' on CUDA needs triton installed") from exc
    else:
        raise ValueError(f"quantization='int8' is not supported on device {device!r}")


def cpu_quantized_engine() -> str | None:
    """The quantized engine int8 linears use on CPU (``"x86"`` or ``"fbgemm"``), or None."""
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm"):
        if name in engines:
            return name
    return None


@functools.cache
def cpu_has_vnni() -> bool:
    """True when the CPU has AVX-512 VNNI or AVX-VNNI (``/proc/cpuinfo`` flags; False where
    that file is absent): FBGEMM's int8 GEMM then cannot saturate, so activations may use the
    full 8 bits (``reduce_range=False``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization.

    Args:
        weight: ``[O, I]`` float.

    Returns:
        ``(qweight [O, I] int8 in [-127, 127], scale [O] fp32)`` with
        ``weight ≈ qweight * scale[:, None]``; an all-zero row gets scale 1.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``y = x @ (qweight * scale[:, None]).T + bias`` with int8 weights.

    Args:
        qweight: ``[O, I]`` int8; scale: ``[O]`` fp32; bias: ``[O]`` or None.
        out_dtype: dtype of the output (the model dtype).

    ``forward(x [T, I])`` → ``[T, O]`` in ``out_dtype``. On CPU ``x`` must be fp32.
    """

    qweight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = int(qweight.shape[1])
        self.out_features = int(qweight.shape[0])
        self.out_dtype = out_dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype))
        self._packed = None
        self._anchor: torch.Tensor | None = None
        if qweight.device.type == "cpu":
            engine = cpu_quantized_engine()
            if engine is not None and torch.backends.quantized.engine != engine:
                torch.backends.quantized.engine = engine
            zero = torch.zeros(self.out_features, dtype=torch.long)
            with warnings.catch_warnings():
                # torch 2.13 deprecates quantized tensor creation (pytorch#184982); the packed
                # FBGEMM weight is still how linear_dynamic takes per-channel int8 weights.
                warnings.simplefilter("ignore", UserWarning)
                wq = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(wq, None)
            anchor = torch.zeros(self.in_features)
            anchor[0], anchor[-1] = 1.0, -1.0
            self._anchor = anchor
        self._reduce_range = not cpu_has_vnni()
        self.one_row = "fbgemm"
        # the one-row GEMV's int8 panels and padded scales (None for "fbgemm"): plain attributes
        self._one_row_panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_one_row(self, kind: str) -> None:
        """Choose the GEMM a one-row CPU input takes (one of :data:`INT8_ONE_ROW_KINDS`);
        "gemv" and "gemv16" keep a panel copy of the int8 weight (``in_features * out_features``
        bytes, padded to whole panels).

        Raises:
            ValueError: another ``kind``, or "gemv" on a CUDA layer.
            RuntimeError: "gemv" where prefixgate's CPU ops are not available.
        """
        if kind not in INT8_ONE_ROW_KINDS:
            raise ValueError(f"unknown int8 one-row GEMM {kind!r}; expected {INT8_ONE_ROW_KINDS}")
        self._one_row_panels = None
        if kind != "fbgemm":
            if self._packed is None:
                raise ValueError("the int8 one-row GEMV runs on CPU layers only")
            if not cpu_ext.available():
                raise RuntimeError("int8 one-row GEMV needs prefixgate's CPU ops (not built here)")
            self._one_row_panels = _GEMV_PACK[kind](self.qweight, self.scale)
        self.one_row = kind
        cpu_ext.one_row_changed()

    def one_row_spec(self) -> cpu_ext.LinearSpec | None:
        """This layer's one-row GEMV as ``cpu_ext.decode_layer`` takes it (None for
        "fbgemm")."""
        p = self._one_row_panels
        if p is None:
            return None
        kind = cpu_ext.LINEAR_KINDS["int8_" + self.one_row]
        return kind, p[0], p[1], self.bias, self.out_features

    @property
    def one_row_bytes(self) -> int:
        """Bytes held by the one-row panel copy (0 for "fbgemm")."""
        p = self._one_row_panels
        return 0 if p is None else p[0].numel() + p[1].numel() * 4

    @classmethod
    def from_linear(cls, linear: nn.Linear | OneDNNLinear) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight copied, never shared)."""
        q, scale = quantize_weight(linear.weight)
        dev = linear.weight.device
        return cls(q.to(dev), scale.to(dev), linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            from prefixgate.kernels.triton_int8 import int8_linear

            return int8_linear(x, self.qweight, self.scale, self.bias)
        return self._forward_cpu(x)

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """FBGEMM dynamic int8 linear with per-token activation scales, batch-invariant.

        ``linear_dynamic`` quantizes its input per *tensor* (uint8 over the batch's min..max),
        which would make a row's result depend on the other rows of the batch. Each row is
        scaled to absmax 1 first and an anchor row ``[1, 0, .., 0, -1]`` is appended, so the
        tensor's range is always exactly [-1, 1]: every row is quantized with the same fixed
        grid (per-token quantization in effect), the int32 GEMM is exact, and the row's scale
        is multiplied back afterwards. Activations use the full 8 bits on VNNI CPUs and 7 bits
        (``reduce_range``) elsewhere, where FBGEMM's ``vpmaddubsw`` path may saturate int16
        pair sums (torch.ao's reduce_range notes).
        """
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        n = x2.shape[0]
        panels = self._one_row_panels
        if n == 1 and panels is not None:
            act = GEMV_ACTIVATIONS[self.one_row]
            y1 = cpu_ext.gemv_int8(x2, panels[0], panels[1], self.bias, self.out_features, act)
            return y1.reshape(*lead, self.out_features)
        # abs().amax() is bitwise the inf-norm, and faster than linalg.vector_norm(ord=inf)
        # (docs/benchmarks/cpu-gemm.md).
        amax = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        rows = torch.empty((n + 1, self.in_features), dtype=x2.dtype)
        torch.div(x2, amax, out=rows[:n])
        assert self._anchor is not None, "the CPU path is set up with its anchor row"
        rows[n] = self._anchor
        y = torch.ops.quantized.linear_dynamic(rows, self._packed, self._reduce_range)[:n]
        y.mul_(amax)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        one = "" if self.one_row == "fbgemm" else f", one_row={self.one_row}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{one}"


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (or its oneDNN-packed ``OneDNNLinear``, what a
    float32 CPU model loaded without quantization holds) by its ``Int8Linear``, in place.

    Raises:
        ValueError: an unknown method.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unsupported quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, (nn.Linear, OneDNNLinear))
    ]
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear.from_linear(child))
    cpu_ext.one_row_changed()
    return model


def _int8_one(m: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return m._forward_cpu(x)


def _int8_gemv_one(
    panels: tuple[torch.Tensor, torch.Tensor], m: Int8Linear, x: torch.Tensor
) -> torch.Tensor:
    return cpu_ext.gemv_int8(x, panels[0], panels[1], m.bias, m.out_features)


def _int8_gemv16_one(
    panels: tuple[torch.Tensor, torch.Tensor], m: Int8Linear, x: torch.Tensor
) -> torch.Tensor:
    return cpu_ext.gemv_int8(x, panels[0], panels[1], m.bias, m.out_features, "int16")


def _int8_gemv8_one(
    panels: tuple[torch.Tensor, torch.Tensor], m: Int8Linear, x: torch.Tensor
) -> torch.Tensor:
    return cpu_ext.gemv_int8(x, panels[0], panels[1], m.bias, m.out_features, "int8")


@torch.inference_mode()
def calibrate_int8_one_row(
    model: nn.Module,
    *,
    min_bytes: int = CALIBRATION_MIN_BYTES,
    rounds: int = 3,
    reps: int = 2,
    seed: int = 0,
) -> dict[tuple[int, int], str]:
    """``cpu_linear.calibrate_one_row`` for the CPU :class:`Int8Linear` layers of ``model``:
    per ``(out_features, in_features)`` shape, FBGEMM's one-row ``linear_dynamic`` against
    the AVX2 int8 GEMVs (fp32, int16 or int8 activations), alternating, each streaming up to ``cpu_linear.CALIBRATION_BYTES`` of
    int8 weights a pass (CPU time, fastest of ``reps`` passes in each of ``rounds``); the faster
    GEMV is kept only where it beat FBGEMM by ``ONE_ROW_MARGIN`` (5 %). Nothing is timed (FBGEMM everywhere)
    for models under ``min_bytes`` of int8 weights, or where prefixgate's CPU ops are not
    available. Its copies are the int8 weights once more (135 MB for SmolLM2-135M's shape).

    Returns:
        ``(out_features, in_features)`` → the kind chosen (also logged).
    """
    groups: dict[tuple[int, int], list[Int8Linear]] = {}
    for m in model.modules():
        if isinstance(m, Int8Linear) and m._packed is not None:
            groups.setdefault((m.out_features, m.in_features), []).append(m)
    total = sum(o * i * len(ms) for (o, i), ms in groups.items())
    if total < min_bytes or not cpu_ext.available():
        return dict.fromkeys(groups, "fbgemm")
    gen = torch.Generator().manual_seed(seed)
    chosen: dict[tuple[int, int], str] = {}
    for (out, inp), layers in groups.items():
        timed = layers[: max(1, min(len(layers), CALIBRATION_BYTES // (out * inp)))]
        fns: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "fbgemm": [functools.partial(_int8_one, m) for m in timed],
            "gemv": [
                functools.partial(_int8_gemv_one, cpu_ext.pack_panels_int8(m.qweight, m.scale), m)
                for m in timed
            ],
            "gemv16": [
                functools.partial(_int8_gemv16_one, cpu_ext.pack_pairs_int8(m.qweight, m.scale), m)
                for m in timed
            ],
            "gemv8": [
                functools.partial(_int8_gemv8_one, cpu_ext.pack_quads_int8(m.qweight, m.scale), m)
                for m in timed
            ],
        }
        kind, best = fastest_one_row(fns, torch.randn((1, inp), generator=gen), rounds, reps)
        del fns
        chosen[(out, inp)] = kind
        for layer in layers:
            layer.set_one_row(kind)
        times = ", ".join(f"{k} {v * 1e6 / len(timed):.0f} us" for k, v in best.items())
        logger.debug("int8 one-row GEMM of %d x %d: %s (%s)", out, inp, kind, times)
    logger.info("int8 one-row GEMMs: %s", ", ".join(f"{o}x{i} {k}" for (o, i), k in chosen.items()))
    return chosen
