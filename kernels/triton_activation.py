"""Triton SwiGLU activation (``silu_and_mul``, as ``torch_ref.silu_and_mul``).

``silu(gate)`` is computed in fp32 and rounded to the input dtype before the product, as the
reference does, so fp32 results match :mod:`.torch_ref` to the last bits and fp16/bf16
results to one rounding.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_checks import FLOATS, check_device
from prefixgate.kernels.triton_env import next_pow2, tl, triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]`` → ``[..., I]``.

    Raises:
        TypeError / ValueError: non-float input or odd last dim.
    """
    check_device(x)
    if x.dtype not in FLOATS:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (gate | up), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            num_warps=min(8, max(1, block // 128)),
        )
    return out.reshape(*lead, inter)
