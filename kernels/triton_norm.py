"""Triton fused residual add + RMSNorm (``rms_norm``, as ``torch_ref.rms_norm``).

One program normalizes one row in fp32, rounding where the reference rounds (after the
residual add, after the normalization), so fp32 results match :mod:`.torch_ref` to the last
bits and fp16/bf16 results to one rounding. Rows may be strided; their last dim is contiguous.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_checks import FLOATS, check_device, check_float
from prefixgate.kernels.triton_env import next_pow2, tl, triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm over ``x [T, H]``; see ``torch_ref.rms_norm``.

    Returns ``out [T, H]`` (dtype promoted from weight and x, as torch does), or
    ``(out, x + residual)`` when ``residual [T, H]`` is given. Inputs are not modified.
    """
    rows, hidden = x.shape
    out = torch.empty(
        (rows, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device
    )
    res_out = (
        torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
        if residual is not None
        else None
    )
    if rows > 0:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out if res_out is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if res_out is None else (out, res_out)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm (Zhang & Sennrich 2019) in fp32, cast as HF's LlamaRMSNorm.

    Args:
        x: ``[T, H]`` (any leading dims); weight: ``[H]``; eps: added to the mean square;
        residual: like x, or None (then ``x + residual`` is normalized and returned too).

    Returns:
        ``out [T, H]`` or ``(out, new_residual)``; inputs are not modified.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or devices.
    """
    tensors = [x, weight] + ([residual] if residual is not None else [])
    check_device(*tensors)
    if x.dtype not in FLOATS or x.dim() < 1:
        raise TypeError(
            f"x must be a float32/float16/bfloat16 tensor [..., H], got {x.dtype} {tuple(x.shape)}"
        )
    check_float("weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} != x {tuple(x.shape)} {x.dtype}"
        )
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    res2 = _rows(residual, hidden) if residual is not None else None
    result = _rms_norm_rows(x2, weight.contiguous(), eps, res2)
    if isinstance(result, tuple):  # with a residual: (normed, new residual)
        return result[0].view(x.shape), result[1].view(x.shape)
    return result.view(x.shape)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """``t [..., H]`` as ``[rows, H]`` with a contiguous last dim (a view when possible)."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
