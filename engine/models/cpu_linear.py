"""fp32 and bf16 linear layers on CPU through oneDNN with prepacked weights.

``nn.Linear`` on CPU calls MKL's ``sgemm``, which measured slower than oneDNN (torch's bundled
MKL-DNN) with the weight reordered once into oneDNN's blocked layout from 8 rows on, and about
equal at one row (figures: docs/benchmarks/cpu-gemm.md). This is the op PyTorch's own inductor emits for frozen CPU linears
(``torch.ops.mkldnn._linear_pointwise`` on a weight from
``torch.ops.mkldnn._reorder_linear_weight``), so the engine gets the same GEMM without
``torch.compile``. bf16 takes the same op (oneDNN's AVX512_BF16 / AMX kernels, fp32
accumulation) where :func:`onednn_bf16_available`; the one-row kinds and calibration below are
fp32's (a bf16 layer keeps oneDNN at every row count).

Results differ from MKL's in the last bits (another summation order; fp32 accumulation both;
max abs error against float64 about 2x MKL's, ~1e-4 on unit-normal inputs). As with
MKL, a row's result may differ in the last bit with the batch's row count (seen at one row).

**One row (batch-1 decode).** At one row the GEMM is a matrix-vector product that only streams
the weight, and the blocked layout packed for 32 rows is not always the fastest way to stream it:
``torch.mm(x, W^T)`` on the weight stored transposed (``[I, O]`` contiguous, "mm_t") or MKL's
``F.linear`` on the plain weight ("linear") beat it on some shapes, while from two rows on
oneDNN's packed layout won every shape (docs/benchmarks/cpu-gemm.md). Which one wins depends on the
CPU, the shape and the thread count, so :func:`calibrate_one_row` times the three at load
(:data:`ONE_ROW_KINDS`) and a layer takes another kind only where it beat oneDNN by
:data:`ONE_ROW_MARGIN`.

**Weights once.** oneDNN's packed fp32 weight is, on AVX-512 CPUs, 64-row panels (input columns
padded to 16; :func:`onednn_panels` checks it against the weight, value for value), which is the
layout the GEMV reads. So "gemv" reads the packed buffer itself, and a tied embedding reads its
rows from the LM head's panels (:class:`PanelEmbedding`): a loaded model holds each matrix
once (:func:`weight_storage_bytes`). By default :func:`calibrate_one_row` lets only such kinds
compete; "linear" and "mm_t" keep a second copy (:func:`one_row_extra_bytes`) and compete only
with ``copies=True``.

The fourth kind, "gemv", is prefixgate's own AVX2/FMA GEMV (:mod:`prefixgate.kernels.cpu_ext`,
built on first use; absent where it cannot be built) on the weight packed in 8-row panels, read
as one forward stream, at about a core's read bandwidth (docs/benchmarks/cpu-gemm.md); the
calibration picks it per shape where it wins by the same margin.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from prefixgate.kernels import cpu_ext
from torch import nn

logger = logging.getLogger(__name__)

ONE_ROW_KINDS = ("onednn", "linear", "mm_t", "gemv")
"""The GEMMs a one-row input may take: oneDNN's packed weight; MKL's ``F.linear`` on the plain
``[O, I]`` weight; ``torch.mm`` on the weight stored transposed, ``[I, O]`` contiguous;
prefixgate's AVX2 GEMV (:func:`prefixgate.kernels.cpu_ext.gemv`) on the weight packed in
8-row panels (``[ceil(O / 8), I, 8]``), only where :func:`prefixgate.kernels.cpu_ext.available`
(built on first use; never timed or chosen where it is not)."""

ONE_ROW_MARGIN = 0.05
"""An alternative to oneDNN is kept only when it measured at least this much faster (5 %)."""

ONE_ROW_MEMORY_SHARE = 0.25
"""The one-row weight copies may take at most this share of the memory available when
:func:`calibrate_one_row` starts (shapes past it keep oneDNN): a model that fits leaves room."""


def available_memory_bytes() -> int | None:
    """Physical memory available now (``os.sysconf``'s ``SC_AVPHYS_PAGES``), or None where
    that is not known."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# Rows the weight is reordered for: a decode batch size. The packed weight serves every row
# count; 32 gave the best layout from 8 to 2,048 rows (a hint of 1 halved the speed at 8-32).
_PACK_ROWS_HINT = 32

EXACT_ROWS = 16
"""Row counts up to this run as they are; above it, 8 steps per octave (at most 12.5% more
rows). Was 64 (every decode batch size exact): in the local server the steps of a burst mix
decode rows with prefill chunks, so every row count up to 64 showed up in turn, each new
primitives of megabytes; at 16 there are 32 shapes up to 64 rows instead of 64, for 1-3 zero
rows more in a step of 17-64 rows off the grid, costing about the rows added
(docs/benchmarks/cpu-gemm.md, docs/benchmarks/memory-curve.md)."""


def padded_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at: ``rows`` up to ``EXACT_ROWS``, above it
    rounded up to one of 8 steps per octave (a multiple of 2^(k-3) for rows in (2^k, 2^(k+1)]).

    Why: oneDNN (its primitive cache, 1,024 entries) and torch's ideep (its LRU cache,
    ``LRU_CACHE_CAPACITY``, 1,024) keep one compiled primitive per input shape; every new row
    count kept megabytes for the model's linears (docs/benchmarks/cpu-gemm.md), so a server
    seeing prefills of ever new lengths grew for thousands of requests. With this bound a
    linear sees at most
    ``EXACT_ROWS`` shapes, then 8 per octave (``distinct_row_counts``: 72 up to 2,048 rows, the
    default ``max_num_batched_tokens``), and pads at most 12.5% rows (zeros, their outputs
    dropped).

    Raises:
        ValueError: ``rows`` < 0.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def distinct_row_counts(max_rows: int) -> int:
    """How many shapes ``padded_rows`` maps ``1..max_rows`` to (the caches' bound per linear)."""
    return len({padded_rows(m) for m in range(1, max_rows + 1)})


def warm_up_row_counts(layers: Sequence[nn.Module], max_rows: int) -> int:
    """Run each distinct ``(out_features, in_features, bias)`` shape of the
    :class:`OneDNNLinear` layers in ``layers`` once at every row count ``padded_rows`` gives
    for ``1..max_rows`` (zeros in, outputs dropped), so oneDNN's and ideep's primitive caches
    hold every GEMM a forward pass of up to ``max_rows`` rows can run; returns how many GEMMs
    ran. Other modules are skipped.

    Why: each new row count compiles one primitive per shape (~0.6 MB each, held until the
    process ends), so without this a server's memory steps up whenever a step reaches a count
    it had not seen (docs/benchmarks/memory-curve.md); as vLLM captures its CUDA graphs per
    batch size at start, this spends the memory and the compile time once, at load. Layers of
    one shape share primitives (the caches key them by shape, not by weight), so one layer a
    shape is run. Cost: :func:`distinct_row_counts` ``(max_rows)`` primitives a shape (72 at
    2,048 rows) and the GEMMs' own work.

    Raises:
        ValueError: ``max_rows`` < 1.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    shapes: dict[tuple[int, int, bool], OneDNNLinear] = {}
    for layer in layers:
        if isinstance(layer, OneDNNLinear):
            shapes.setdefault((layer.out_features, layer.in_features, layer.bias is None), layer)
    counts = sorted({padded_rows(m) for m in range(1, max_rows + 1)})
    with torch.inference_mode():
        for layer in shapes.values():
            x = torch.zeros((counts[-1], layer.in_features), dtype=layer.dtype)
            for rows in counts:
                layer(x[:rows])
    return len(shapes) * len(counts)


def onednn_linear_available() -> bool:
    """True when torch has oneDNN (MKL-DNN) and its prepacked linear ops on this build."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


def onednn_bf16_available() -> bool:
    """True where oneDNN runs bf16 GEMMs natively on this CPU (AVX512_BF16 or AMX:
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported``); elsewhere bf16 keeps torch's linear."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return onednn_linear_available() and check is not None and bool(check())


def use_onednn_linear(
    device: str | torch.device, dtype: torch.dtype, quantization: str | None
) -> bool:
    """Whether :func:`pack_linears` applies: CPU, no quantization, oneDNN present, and float32,
    or bfloat16 where :func:`onednn_bf16_available`."""
    return (
        torch.device(device).type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16_available()))
        and quantization is None
        and onednn_linear_available()
    )


PANEL_WIDTHS = (64, 48, 32, 16, 8, 56, 40, 24)
"""The panel widths :func:`onednn_panels` tries (multiples of 8 up to 64, what
``cpu_ext.gemv`` takes; oneDNN packs fp32 linear weights 64 wide on AVX-512 CPUs)."""


def onednn_storage_bytes(packed: torch.Tensor) -> int:
    """Bytes of the buffer behind an opaque oneDNN tensor (``torch.ops.mkldnn._nbytes``)."""
    return int(torch.ops.mkldnn._nbytes(packed))


def onednn_panels(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """A ``[P, I, W]`` fp32 view (no copy) of the buffer of ``packed``, oneDNN's reordered copy
    of ``weight [O, I]``, as ``cpu_ext.gemv`` reads panels: output row ``p * W + j`` in
    ``view[p, :, j]``, panel stride ``Ip * W`` (``Ip >= I``, oneDNN's padded input columns);
    or None where oneDNN chose another layout.

    oneDNN's layout is opaque and the CPU's (AVX-512: ``AB16b64a``, 64-wide panels of input
    columns padded to 16); so each width of :data:`PANEL_WIDTHS` whose padded size matches the
    buffer's is checked against ``weight`` itself, value for value: a view is returned only
    when it reads exactly ``weight``. The view keeps ``packed`` alive (its buffer object holds
    a reference), so it may outlive the module.
    """
    out_f, in_f = weight.shape
    nbytes = onednn_storage_bytes(packed)
    if nbytes % 4:
        return None
    numel = nbytes // 4
    for panels, in_pad, width in _panel_shapes(out_f, in_f, numel):
        flat = _packed_flat(packed, ctypes.c_float, torch.float32, numel)
        view = flat.as_strided((panels, in_f, width), (in_pad * width, width, 1))
        if _panels_hold(view, weight):
            return view
    return None


def _panel_shapes(out_f: int, in_f: int, numel: int) -> list[tuple[int, int, int]]:
    """``(panels, padded input columns, width)`` for each width of :data:`PANEL_WIDTHS` whose
    padded panels of ``out_f`` rows fill a buffer of ``numel`` elements (``in_pad >= in_f``)."""
    shapes = []
    for width in PANEL_WIDTHS:
        panels = -(-out_f // width)
        if numel % (panels * width) == 0 and numel // (panels * width) >= in_f:
            shapes.append((panels, numel // (panels * width), width))
    return shapes


def _packed_flat(packed: torch.Tensor, ctype: Any, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The buffer of oneDNN's ``packed`` tensor as a flat ``[numel]`` ``dtype`` tensor (no
    copy; ``ctype`` the element's ctypes type); the view keeps ``packed`` alive."""
    # a subclass, so the buffer object can hold a reference to its owner
    buffer_type = cast("type[ctypes.Array[Any]]", type("OneDNNBuffer", (ctype * numel,), {}))
    buffer = buffer_type.from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    buffer.owner = packed  # type: ignore[attr-defined]  # lives as long as the view
    return torch.frombuffer(buffer, dtype=dtype)


def onednn_pair_panels(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """A ``[P, Ip / 2, W, 2]`` bf16 view (no copy) of the buffer of ``packed``, oneDNN's
    reordered copy of bf16 ``weight [O, I]``: output row ``p * W + j``, input column
    ``2 * c + t`` in ``view[p, c, j, t]`` (``Ip >= I`` even: oneDNN's padded input columns);
    or None where oneDNN chose another layout.

    On AVX512_BF16 CPUs oneDNN packs bf16 weights in 64-wide panels of column pairs (the pairs
    ``vdpbf16ps`` multiplies; ``AB16b64a2b``); as :func:`onednn_panels`, each width of
    :data:`PANEL_WIDTHS` whose padded size matches the buffer's is checked against ``weight``
    value for value. The view keeps ``packed`` alive.
    """
    out_f, in_f = weight.shape
    nbytes = onednn_storage_bytes(packed)
    if weight.dtype != torch.bfloat16 or nbytes % 2:
        return None
    numel = nbytes // 2
    for panels, in_pad, width in _panel_shapes(out_f, in_f, numel):
        if in_pad % 2:
            continue
        flat = _packed_flat(packed, ctypes.c_uint16, torch.bfloat16, numel)
        view = flat.as_strided((panels, in_pad // 2, width, 2), (in_pad * width, 2 * width, 2, 1))
        if _panels_hold(view, weight):
            return view
    return None


def panel_rows(view: torch.Tensor, in_features: int) -> torch.Tensor:
    """The rows ``[P * W, I]`` (a copy) of a panel view: :func:`onednn_panels`' ``[P, I, W]``
    or :func:`onednn_pair_panels`' ``[P, Ip / 2, W, 2]``."""
    if view.dim() == 3:
        return view.permute(0, 2, 1).reshape(-1, view.shape[1])
    return view.permute(0, 2, 1, 3).reshape(-1, view.shape[1] * 2)[:, :in_features]


def _panels_hold(view: torch.Tensor, weight: torch.Tensor, chunk_rows: int = 4096) -> bool:
    """Whether panel view ``view`` (:func:`panel_rows`' two layouts) reads exactly ``weight
    [O, I]`` (compared a chunk of rows at a time: no whole second copy, even for an LM head)."""
    out_f, in_f = weight.shape
    width = view.shape[2]
    per = max(1, chunk_rows // width)
    for p0 in range(0, view.shape[0], per):
        rows = panel_rows(view[p0 : p0 + per], in_f)
        r0 = p0 * width
        r1 = min(out_f, r0 + rows.shape[0])
        if not torch.equal(rows[: r1 - r0], weight[r0:r1]):
            return False
    return True


class OneDNNLinear(nn.Module):
    """``y = x @ weight.T + bias`` with the weight prepacked for oneDNN (fp32 or bf16, CPU).

    Args:
        weight: ``[O, I]`` float32 or bfloat16 on CPU (copied into oneDNN's layout, never
            shared).
        bias: ``[O]`` or None (kept in the weight's dtype).

    ``forward(x [T, I])`` in the weight's dtype → ``[T, O]`` in it (any leading dims; T may be
    0). A bf16 layer keeps oneDNN at one row too (``set_one_row`` takes "onednn" only). An fp32
    layer whose packed weight is 64-wide panels takes ``cpu_ext.gemm_panels`` for 2 to
    ``cpu_ext.GEMM_ROWS`` rows on a CPU with AVX-512 (the packed weight itself, no padding rows;
    docs/cpu-performance.md).
    """

    bias: torch.Tensor | None  # a buffer (register_buffer), declared for the type checker

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError(
                "OneDNNLinear needs a float32 or bfloat16 CPU weight, "
                f"got {weight.dtype} on {weight.device}"
            )
        self.dtype = weight.dtype
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        w = weight.detach().contiguous()
        # An opaque oneDNN tensor (layout torch._mkldnn): not a buffer, so state_dict and
        # .to() never see it; the module lives on CPU only.
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        # the packed buffer read as cpu_ext.gemv's panels (None where oneDNN's layout is not
        # one): the "gemv" one-row kind then needs no copy of the weight
        fp32 = w.dtype == torch.float32
        self._panels = onednn_panels(self._packed, w) if fp32 else None
        # the packed buffer read as rows (PanelEmbedding's table): the fp32 panels, or bf16's
        # column-pair panels
        self._table = self._panels if fp32 else onednn_pair_panels(self._packed, w)
        self.register_buffer("bias", None if bias is None else bias.detach().to(w.dtype).clone())
        self.one_row = "onednn"
        # the one-row GEMM's own copy of the weight ([I, O] for "mm_t", [O, I] for "linear"):
        # a plain attribute, as _packed
        self._one_row_weight: torch.Tensor | None = None
        # a few rows through cpu_ext.gemm_panels (None: not decided yet, see _gemm_rows)
        self._gemm: bool | None = None

    def set_one_row(self, kind: str) -> None:
        """Choose the GEMM a one-row input takes (one of :data:`ONE_ROW_KINDS`). "gemv" reads
        oneDNN's packed weight itself where its layout is panels (:attr:`shares_gemv`: no
        copy), else a :func:`~prefixgate.kernels.cpu_ext.pack_panels` copy (``out_features``
        padded to a multiple of 8, times ``in_features`` fp32); "linear" and "mm_t" keep a
        second copy of the weight (``in_features * out_features`` fp32); "onednn" drops any
        copy.

        Raises:
            ValueError: another ``kind``.
            RuntimeError: "gemv" where prefixgate's CPU ops are not available.
        """
        if kind not in ONE_ROW_KINDS:
            raise ValueError(f"unknown one-row GEMM {kind!r}; expected one of {ONE_ROW_KINDS}")
        if kind != "onednn" and self.dtype != torch.float32:
            raise ValueError(
                f"one-row GEMM {kind!r} is float32's; a {self.dtype} layer keeps oneDNN"
            )
        if kind == "gemv" and not cpu_ext.available():
            raise RuntimeError("one-row GEMM 'gemv' needs prefixgate's CPU ops (not built here)")
        self._one_row_weight = None
        if kind == "linear":
            self._one_row_weight = self.weight
        elif kind == "mm_t":
            self._one_row_weight = self.weight.t().contiguous()
        elif kind == "gemv":
            shared = self._panels
            self._one_row_weight = cpu_ext.pack_panels(self.weight) if shared is None else shared
        self.one_row = kind
        cpu_ext.one_row_changed()

    @property
    def shares_gemv(self) -> bool:
        """True where "gemv" reads the packed weight itself (:func:`onednn_panels`)."""
        return self._panels is not None

    @property
    def shares_table(self) -> bool:
        """True where a tied embedding can read its rows from the packed weight itself
        (:func:`onednn_panels` for fp32, :func:`onednn_pair_panels` for bf16)."""
        return self._table is not None

    def one_row_spec(self) -> cpu_ext.LinearSpec | None:
        """This layer's one-row GEMM as ``cpu_ext.decode_layer`` takes it: its one-row copy of
        the weight, or for "onednn" the packed weight (a one-row input is not padded there: the
        op takes any row count)."""
        w = self._packed if self._one_row_weight is None else self._one_row_weight
        return cpu_ext.LINEAR_KINDS[self.one_row], w, None, self.bias, self.out_features

    @property
    def one_row_bytes(self) -> int:
        """Bytes held by the one-row copy of the weight (0 for "onednn" and for "gemv" on the
        packed weight itself)."""
        w = self._one_row_weight
        if w is None or w is self._panels:
            return 0
        return w.numel() * w.element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight this layer holds: oneDNN's packed buffer plus any one-row copy."""
        return onednn_storage_bytes(self._packed) + self.one_row_bytes

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> OneDNNLinear:
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """``[O, I]`` in the layer's dtype: a plain copy of the packed weight (reading it, as
        :func:`~prefixgate.engine.models.quantization.quantize_model` does; writing to it
        changes nothing)."""
        return self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty((*lead, self.out_features))
        rows = x2.shape[0]
        w1 = self._one_row_weight
        if rows == 1 and w1 is not None:
            if self.one_row == "gemv":
                y = cpu_ext.gemv(x2, w1, self.bias, self.out_features)
            elif self.one_row == "mm_t":
                y = torch.mm(x2, w1) if self.bias is None else torch.addmm(self.bias, x2, w1)
            else:
                y = F.linear(x2, w1, self.bias)
            return y.reshape(*lead, self.out_features)
        panels = self._panels
        if rows <= cpu_ext.GEMM_ROWS and panels is not None and self._gemm_rows():
            # the op itself (cpu_ext.gemm_panels documents it): no Python call between
            y = torch.ops.prefixgate_cpu.gemm_panels(x2, panels, self.bias, self.out_features)
            return y.reshape(*lead, self.out_features)
        padded = padded_rows(rows)
        if padded != rows:
            x2 = torch.cat([x2, x2.new_zeros((padded - rows, self.in_features))])
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, self.bias, "none", [], "")
        return y[:rows].reshape(*lead, self.out_features)

    def _gemm_rows(self) -> bool:
        """Whether a few rows (up to ``cpu_ext.GEMM_ROWS``) take ``cpu_ext.gemm_panels`` on the
        packed weight itself: fp32 panels 64 wide and the op available here (decided at the
        first such call)."""
        if self._gemm is None:
            panels = self._panels
            self._gemm = (
                panels is not None
                and panels.shape[2] == 64
                and cpu_ext.available()
                and cpu_ext.gemm_rows_available()
            )
        return self._gemm

    def extra_repr(self) -> str:
        one = "" if self.one_row == "onednn" else f", one_row={self.one_row}"
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{one}"


class PanelEmbedding(nn.Module):
    """The embedding of a tied LM head, read from the head's oneDNN-packed weight: the table
    is held once (the head's panels, :func:`onednn_panels`) instead of a plain copy beside it.

    ``forward(ids [...] int64)`` → ``[..., H]``: the rows of the head's weight, bit for bit
    (a gather, no arithmetic), in its dtype. ``.weight`` is a dense copy (read only), as
    :attr:`OneDNNLinear.weight`.

    Raises:
        ValueError: a head whose packed weight is not a panel layout (``shares_table`` False).
    """

    def __init__(self, head: OneDNNLinear) -> None:
        super().__init__()
        panels = head._table
        if panels is None:
            raise ValueError("PanelEmbedding needs a head whose packed weight is panels")
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features
        self._panels = panels  # a plain attribute: the view keeps the head's buffer alive
        self._width = int(panels.shape[2])

    @property
    def weight(self) -> torch.Tensor:
        """``[V, H]`` in the head's dtype: a dense copy of the table."""
        return panel_rows(self._panels, self.embedding_dim)[: self.num_embeddings]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        p = self._panels
        rows = p[flat // self._width, :, flat % self._width]  # [n, I] or [n, Ip / 2, 2]
        if p.dim() == 4:
            rows = rows.reshape(flat.shape[0], -1)[:, : self.embedding_dim]
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, panels of the tied LM head"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by its :class:`OneDNNLinear`, in place.

    A tied LM head (its weight an ``nn.Embedding``'s) gets a packed copy, and the embedding is
    replaced by a :class:`PanelEmbedding` over it where the packed layout is panels, so the
    table stays held once (else the embedding keeps its plain tensor: on SmolLM2-135M that is
    113 MB more).
    """
    embeddings = {
        child.weight.data_ptr(): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Embedding)
    }
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    # popped one at a time, so each plain weight is freed as soon as its packed copy exists
    # (a list holding them all kept every plain weight alive beside its packed copy)
    targets.reverse()
    while targets:
        parent, name, child = targets.pop()
        key = child.weight.data_ptr()
        packed = OneDNNLinear.from_linear(child)
        setattr(parent, name, packed)
        del child
        tied = embeddings.get(key)
        if tied is not None and packed.shares_table:
            setattr(tied[0], tied[1], PanelEmbedding(packed))
    return model


def decide_gemm_rows(model: nn.Module) -> int:
    """Decide now, for each :class:`OneDNNLinear` of ``model``, whether a few rows take
    ``cpu_ext.gemm_panels`` (the decision its first such forward would make): a layer whose
    packed weight is 64-wide panels asks :func:`prefixgate.kernels.cpu_ext.available`, which
    builds the C++ ops once per process or loads them from torch's extensions cache. The
    loader calls it, so that build is paid while the model loads (before the server is
    ready), not by the first request.

    Returns:
        how many layers take ``cpu_ext.gemm_panels`` for a few rows.
    """
    return sum([m._gemm_rows() for m in model.modules() if isinstance(m, OneDNNLinear)])


def weight_storage_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage ``model`` holds weights in: its parameters' and buffers'
    storages, each :class:`OneDNNLinear`'s packed buffer and one-row copy, each tied
    :class:`PanelEmbedding`'s panels; a storage reached twice (a tied weight, a view of a
    packed buffer) counts once, by its data pointer."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None:
            return
        if t.layout == torch._mkldnn:  # type: ignore[attr-defined]
            seen[int(torch.ops.mkldnn.data_ptr(t))] = onednn_storage_bytes(t)
        else:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for param in model.parameters():
        add(param)
    for buf in model.buffers():
        add(buf)
    for m in model.modules():
        if isinstance(m, OneDNNLinear):
            add(m._packed)
            add(m._one_row_weight)
        elif isinstance(m, PanelEmbedding):
            add(m._panels)
    return sum(seen.values())


CALIBRATION_MIN_BYTES = 32 << 20
"""Linear weights below which :func:`calibrate_one_row` keeps oneDNN without timing (32 MiB:
beyond a desktop CPU's last-level cache)."""

CALIBRATION_BYTES = 64 << 20
"""Weights one timing pass of :func:`calibrate_one_row` streams per shape (64 MiB: beyond the
CPU's caches, as a decode step's whole model is; fewer layers when the shape holds less)."""


def _time_one_row(
    fns: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, reps: int
) -> float:
    """Fastest of ``reps`` passes of ``x`` through every function in turn, in seconds of the
    process's CPU time (``time.process_time``: all its threads; on a host whose cores other
    processes share, wall time mostly measured who else ran, CPU time the GEMM)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for fn in fns:
            fn(x)
        best = min(best, time.process_time() - t0)
    return best


def fastest_one_row(
    fns: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]],
    x: torch.Tensor,
    rounds: int,
    reps: int,
) -> tuple[str, dict[str, float]]:
    """Time the one-row GEMMs of ``fns`` (kind → its functions over the timed layers; the first
    kind is the default) in turn, ``rounds`` rounds of ``reps`` passes each
    (:func:`_time_one_row`), and return the kind to keep — the fastest other kind where it
    beat the default by :data:`ONE_ROW_MARGIN`, else the default — and each kind's fastest
    pass (seconds of CPU time)."""
    kinds = list(fns)
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(rounds):
        for kind in kinds:
            best[kind] = min(best[kind], _time_one_row(fns[kind], x, reps))
    alt = min(kinds[1:], key=best.__getitem__)
    return (alt if best[alt] < (1 - ONE_ROW_MARGIN) * best[kinds[0]] else kinds[0]), best


def _onednn_one(m: OneDNNLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, m._packed, m.bias, "none", [], "")


def _linear_one(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w, b)


def _mm_t_one(w: torch.Tensor, b: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


def _gemv_one(w: torch.Tensor, b: torch.Tensor | None, n: int, x: torch.Tensor) -> torch.Tensor:
    return cpu_ext.gemv(x, w, b, n)


def one_row_kinds() -> tuple[str, ...]:
    """The :data:`ONE_ROW_KINDS` usable here: all but "gemv" where prefixgate's CPU ops are
    not available (:func:`prefixgate.kernels.cpu_ext.available`, which builds them once)."""
    return tuple(k for k in ONE_ROW_KINDS if k != "gemv" or cpu_ext.available())


@torch.inference_mode()
def calibrate_one_row(
    model: nn.Module,
    rounds: int = 3,
    reps: int = 2,
    seed: int = 0,
    memory_budget: int | None = None,
    min_bytes: int = CALIBRATION_MIN_BYTES,
    copies: bool = False,
) -> dict[tuple[int, int], str]:
    """Time the :func:`one_row_kinds` GEMMs at one row for each shape of ``model``'s
    :class:`OneDNNLinear` layers and set each layer's ``one_row`` to its shape's fastest.

    Without ``copies`` (the loader's way) only the kinds that read the packed weight itself
    compete: "onednn" and, where every layer of the shape :attr:`~OneDNNLinear.shares_gemv`,
    "gemv"; the weights are then held once. With ``copies`` every kind competes, and the
    winners' copies count against ``memory_budget``.

    Per ``(out_features, in_features)`` shape, a pass sends one ``[1, I]`` fp32 input through
    its first layers in turn, up to :data:`CALIBRATION_BYTES` of weights (a decode step reads
    each weight once, so the pass streams them from memory as the step does); the kinds
    alternate within each of ``rounds`` rounds and each kind's time is its fastest pass
    (``reps`` a round). An alternative replaces oneDNN only when it is :data:`ONE_ROW_MARGIN`
    faster, and while the copies it keeps fit ``memory_budget`` bytes (default
    :data:`ONE_ROW_MEMORY_SHARE` of :func:`available_memory_bytes`; unbounded where unknown);
    a shape whose copies would pass it keeps oneDNN. A model with under ``min_bytes`` of
    linear weights (default :data:`CALIBRATION_MIN_BYTES`) keeps oneDNN everywhere without
    timing: its weights stay in the CPU's caches, so the kinds' times say nothing about
    streaming, and a choice by noise would make its outputs differ in the last bits from one
    load to the next (the test models are all that small). Runs at the current
    ``torch.get_num_threads()``; seconds for the SmolLM2-135M shape (docs/benchmarks/cpu-gemm.md).

    Returns:
        ``(out_features, in_features)`` → the kind chosen (also logged, with the extra bytes).
    """
    groups: dict[tuple[int, int], list[OneDNNLinear]] = {}
    for m in model.modules():
        if isinstance(m, OneDNNLinear) and m.dtype == torch.float32:  # bf16: oneDNN
            groups.setdefault((m.out_features, m.in_features), []).append(m)
    total = sum(o * i * 4 * len(ms) for (o, i), ms in groups.items())
    if total < min_bytes:  # cache-resident: nothing to stream, every kind times alike
        logger.debug("one-row GEMMs: oneDNN (%.1f MB of linear weights)", total / 1e6)
        return dict.fromkeys(groups, "onednn")
    if memory_budget is None:
        avail = available_memory_bytes()
        memory_budget = None if avail is None else int(avail * ONE_ROW_MEMORY_SHARE)
    kept = 0
    kinds = one_row_kinds()  # "onednn" first
    gen = torch.Generator().manual_seed(seed)
    chosen: dict[tuple[int, int], str] = {}
    for (out, inp), layers in groups.items():
        per_layer = out * inp * 4
        timed = layers[: max(1, min(len(layers), CALIBRATION_BYTES // per_layer))]
        shared = "gemv" in kinds and all(m.shares_gemv for m in layers)
        fns: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
            "onednn": [functools.partial(_onednn_one, m) for m in timed],
        }
        plain = [m.weight for m in timed] if copies else []
        if copies:
            fns["linear"] = [
                functools.partial(_linear_one, w, m.bias) for w, m in zip(plain, timed, strict=True)
            ]
            fns["mm_t"] = [
                functools.partial(_mm_t_one, w.t().contiguous(), m.bias)
                for w, m in zip(plain, timed, strict=True)
            ]
        if shared:
            fns["gemv"] = [
                functools.partial(_gemv_one, p, m.bias, out)
                for m in timed
                if (p := m._panels) is not None  # all of them: shared
            ]
        elif copies and "gemv" in kinds:
            fns["gemv"] = [
                functools.partial(_gemv_one, cpu_ext.pack_panels(w), m.bias, out)
                for w, m in zip(plain, timed, strict=True)
            ]
        if len(fns) == 1:  # oneDNN alone: nothing to time
            for layer in layers:
                layer.set_one_row("onednn")
            chosen[(out, inp)] = "onednn"
            continue
        kind, best = fastest_one_row(fns, torch.randn((1, inp), generator=gen), rounds, reps)
        del fns, plain
        copied = kind != "onednn" and not (kind == "gemv" and shared)
        if copied and memory_budget is not None:
            if kept + per_layer * len(layers) > memory_budget:
                logger.info(
                    "one-row GEMM of %d x %d keeps oneDNN: its copies (%.1f MB) pass the "
                    "memory budget (%.1f MB)",
                    out,
                    inp,
                    per_layer * len(layers) / 1e6,
                    memory_budget / 1e6,
                )
                kind = "onednn"
            else:
                kept += per_layer * len(layers)
        for layer in layers:
            layer.set_one_row(kind)
        chosen[(out, inp)] = kind
        logger.debug(
            "one-row GEMM of %d x %d (%d of %d layers timed): %s (%s)",
            out,
            inp,
            len(timed),
            len(layers),
            kind,
            ", ".join(f"{k} {v * 1e6 / len(timed):.0f} us" for k, v in best.items()),
        )
    logger.info(
        "one-row GEMMs: %s; extra memory %.1f MB",
        ", ".join(f"{o}x{i} {k}" for (o, i), k in chosen.items()),
        one_row_extra_bytes(model) / 1e6,
    )
    return chosen


def one_row_extra_bytes(model: nn.Module) -> int:
    """Bytes of the one-row weight copies :func:`calibrate_one_row` kept in ``model``."""
    return sum(m.one_row_bytes for m in model.modules() if isinstance(m, OneDNNLinear))
