"""Argument checks of the Triton entry points (dtypes, shapes, devices, contiguity).

Every public Triton function checks its arguments with these before any launch, so a bad call
raises ``TypeError`` / ``ValueError`` instead of reading out of bounds.
"""

from __future__ import annotations

import torch
from prefixgate.kernels.triton_env import interpreting

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def check_device(*tensors: torch.Tensor) -> None:
    """Tensors all on one device, CUDA unless the interpreter runs (TypeError: not a tensor)."""
    device = tensors[0].device
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} and {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 before "
            "importing triton to run them on CPU"
        )


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    """``t`` float32/float16/bfloat16 with ``ndim`` dims and a contiguous last dim."""
    if t.dtype not in FLOATS:
        raise TypeError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_int(name: str, t: torch.Tensor, ndim: int) -> None:
    """``t`` an int32/int64 tensor with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INTS:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V caches ``[N, S, Hkv, D]`` alike in shape and dtype."""
    check_float("k_cache", k_cache, 4)
    check_float("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} differ"
        )
