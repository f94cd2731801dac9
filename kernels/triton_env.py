"""Import Triton with the right mode: compiled on CUDA, Triton's interpreter elsewhere.

``TRITON_INTERPRET=1`` must be in the environment before ``@triton.jit`` decorates a kernel
(Triton reads ``triton.knobs.runtime.interpret`` at decoration time). Every kernel module of
this package imports ``triton`` / ``tl`` from here, so the flag is set first. An explicit
``TRITON_INTERPRET`` in the environment is respected.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl", "interpreting", "next_pow2"]


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= ``max(n, minimum)`` (Triton tiles must be powers of two)."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)
