"""Triton int8 weight-only GEMM: ``y = x @ (qweight * scale[:, None]).T + bias``.

The GPU path of ``quantization="int8"`` (:mod:`prefixgate.engine.models.quantization`). Weights
are int8 with one fp32 scale per output channel; each ``[BLOCK_K, BLOCK_N]`` weight tile is
loaded as int8 (a quarter of fp32's bytes, half of bf16's: decode GEMMs are bandwidth-bound),
converted exactly to the activation dtype in registers (|q| <= 127 fits fp16/bf16), multiplied
with ``tl.dot`` into an fp32 accumulator, and the per-channel scale is applied once per output
tile at the end (it factors out of the K sum). Runs in Triton's interpreter on CPU for tests.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_checks import FLOATS
from prefixgate.kernels.triton_env import interpreting, next_pow2, tl, triton


@triton.jit
def _int8_linear_kernel(
    x_ptr,
    qweight_ptr,
    wscale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = qweight_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    scale = tl.load(wscale_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """Linear layer with int8 per-output-channel weights.

    Args:
        x: ``[..., K]`` fp32 / fp16 / bf16 (any leading dims; last dim contiguous after reshape).
        qweight: ``[N, K]`` int8, contiguous.
        scale: ``[N]`` fp32 per-output-channel scales.
        bias: ``[N]`` or None.
        block_n, block_k: tile sizes (powers of two >= 16).

    Returns:
        ``[..., N]`` in x's dtype; fp32 accumulation (fp32 inputs use TF32 dots on GPU, exact
        IEEE in the interpreter).

    Raises:
        TypeError: wrong dtypes. ValueError: shape mismatch or tensors on different devices.
    """
    if x.dtype not in FLOATS:
        raise TypeError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise TypeError(f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {qweight.dim()}-D")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, qweight expects {k}")
    if scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"scale (and bias) must have shape ({n},)")
    devices = {t.device for t in (x, qweight, scale) + ((bias,) if bias is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError("the Triton int8 GEMM needs CUDA tensors (or TRITON_INTERPRET=1)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    qweight = qweight.contiguous()
    block_m = min(next_pow2(m, 16), 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    precision = "tf32" if x.dtype == torch.float32 and not interpreting() else "ieee"
    _int8_linear_kernel[grid](
        x2,
        qweight,
        scale.float().contiguous(),
        bias if bias is not None else scale,  # dummy pointer when HAS_BIAS is False
        out,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=precision,
        num_warps=4,
        num_stages=3,
    )
    return out.reshape(*lead, n)
