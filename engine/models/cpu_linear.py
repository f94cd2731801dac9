"""fp32 linear layers on CPU through oneDNN with prepacked weights.

``nn.Linear`` on CPU calls MKL's ``sgemm``. On the AMD EPYC (Zen 5, AVX-512) dev machine that
path measured 2-2.5x slower than oneDNN (torch's bundled MKL-DNN) with the weight reordered
once into oneDNN's blocked layout: single thread, SmolLM2-135M shapes (K 576-1536, N 576-49152),
57-110 GFLOP/s for MKL against 150-250 for oneDNN at 8-2,048 rows; about equal at one row.
This is the op PyTorch's own inductor emits for frozen CPU linears
(``torch.ops.mkldnn._linear_pointwise`` on a weight from
``torch.ops.mkldnn._reorder_linear_weight``), so the engine gets the same GEMM without
``torch.compile``.

Results differ from MKL's in the last bits (another summation order; fp32 accumulation both;
measured max abs error against float64 about 2x MKL's, ~1e-4 on unit-normal inputs). As with
MKL, a row's result may differ in the last bit with the batch's row count (seen at one row).
"""

from __future__ import annotations

import torch
from torch import nn

# Rows the weight is reordered for: a decode batch size. The packed weight serves every row
# count; 32 gave the best layout from 8 to 2,048 rows (a hint of 1 halved the speed at 8-32).
_PACK_ROWS_HINT = 32

EXACT_ROWS = 16
"""Row counts up to this run as they are; above it, 8 steps per octave (at most 12.5% more
rows). Was 64 (every decode batch size exact): in the local server the steps of a burst mix
decode rows with prefill chunks, so every row count up to 64 showed up in turn, each a new
~2.2 MB of primitives on tiny-random (the memory bench's curve rose in 1-7 MiB steps after
10,000 requests); at 16 there are 32 shapes up to 64 rows instead of 64, for 1-3 zero rows
more in a step of 17-64 rows off the grid (measured 0-5% more time for such a GEMM, about the
rows added; README, "Memory over many requests")."""


def padded_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at: ``rows`` up to ``EXACT_ROWS``, above it
    rounded up to one of 8 steps per octave (a multiple of 2^(k-3) for rows in (2^k, 2^(k+1)]).

    Why: oneDNN (its primitive cache, 1,024 entries) and torch's ideep (its LRU cache,
    ``LRU_CACHE_CAPACITY``, 1,024) keep one compiled primitive per input shape; every new row
    count kept ~2.2 MB for the tiny-random model's linears, so a server seeing prefills of ever
    new lengths grew for thousands of requests. With this bound a linear sees at most
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


def onednn_linear_available() -> bool:
    """True when torch has oneDNN (MKL-DNN) and its prepacked linear ops on this build."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


def use_onednn_linear(
    device: str | torch.device, dtype: torch.dtype, quantization: str | None
) -> bool:
    """Whether :func:`pack_linears` applies: CPU, float32, no quantization, oneDNN present."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and quantization is None
        and onednn_linear_available()
    )


class OneDNNLinear(nn.Module):
    """``y = x @ weight.T + bias`` with the weight prepacked for oneDNN (fp32, CPU).

    Args:
        weight: ``[O, I]`` float32 on CPU (copied into oneDNN's layout, never shared).
        bias: ``[O]`` float32 or None.

    ``forward(x [T, I] float32)`` → ``[T, O]`` float32 (any leading dims; T may be 0).
    """

    bias: torch.Tensor | None  # a buffer (register_buffer), declared for the type checker

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"OneDNNLinear needs a float32 CPU weight, got {weight.dtype} on {weight.device}"
            )
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        w = weight.detach().contiguous()
        # An opaque oneDNN tensor (layout torch._mkldnn): not a buffer, so state_dict and
        # .to() never see it; the module lives on CPU only.
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> OneDNNLinear:
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """``[O, I]`` float32: a plain copy of the packed weight (reading it, as
        :func:`~prefixgate.engine.models.quantization.quantize_model` does; writing to it
        changes nothing)."""
        return self._packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty((*lead, self.out_features))
        rows = x2.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x2 = torch.cat([x2, x2.new_zeros((padded - rows, self.in_features))])
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, self.bias, "none", [], "")
        return y[:rows].reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by its :class:`OneDNNLinear`, in place.

    A tied LM head gets its own packed copy (the embedding keeps the plain tensor): on
    SmolLM2-135M that is 113 MB more memory.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, OneDNNLinear.from_linear(child))
    return model
