"""Import Triton with the right mode: compiled on CUDA, Triton's interpreter elsewhere.

``TRITON_INTERPRET=1`` must be in the environment before ``@triton.jit`` decorates a kernel
(Triton reads ``triton.knobs.runtime.interpret`` at decoration time). Every kernel module of
this package imports ``triton`` / ``tl`` from here, so the flag is set first. An explicit
``TRITON_INTERPRET`` in the environment is respected.

Triton may already be imported in compiled mode (``torch._dynamo`` imports it): then its own
``@jit`` standard library (``tl.sum``, ``tl.max``, ``tl.zeros``, ...) holds compiled-mode
functions that the interpreter refuses to call, and :func:`_interpret_stdlib` wraps them as
the interpreter would have at import.
"""

from __future__ import annotations

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["triton", "tl", "interpreting", "next_pow2"]


def _interpret_stdlib() -> None:
    """Swap compiled-mode ``JITFunction`` objects in ``triton.language.*`` for interpreted ones."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn, noinline=value.noinline)
                setattr(module, attr, wrapped[id(value)])


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpret_stdlib()


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= ``max(n, minimum)`` (Triton tiles must be powers of two)."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)
