"""Kernels: Triton on CUDA, pure torch on CPU, behind one set of signatures.

``get_backend("torch" | "triton")`` returns a namespace with ``reshape_and_cache``,
``paged_attention_decode``, ``paged_attention_prefill``, ``paged_attention_verify``,
``rms_norm``, ``rotary_embedding`` and ``silu_and_mul``; see :mod:`prefixgate.kernels.torch_ref`
for shapes and semantics.

The torch backend adds ``STEP_PLAN_NAMES``: the same ops with what every layer reads from the
step's metadata (cache slots, decode lengths and mask, rotary tables) computed once per forward
(``plan_*`` / ``rotary_tables``) and passed to each layer's op (``write_kv``,
``attend_decode``, ``rotate_qk``). A model uses them when the namespace has them.
"""

from __future__ import annotations

from types import SimpleNamespace

from prefixgate.kernels import torch_ref

KERNEL_NAMES = (
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_verify",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
)

STEP_PLAN_NAMES = (
    "plan_cache_write",
    "write_kv",
    "plan_decode",
    "attend_decode",
    "rotary_tables",
    "rotate_qk",
)


def get_backend(name: str) -> SimpleNamespace:
    """Return the kernel namespace for ``name``.

    Raises:
        ValueError: unknown backend name.
        ImportError: ``"triton"`` without triton installed.
    """
    if name == "torch":
        names = KERNEL_NAMES + STEP_PLAN_NAMES
        return SimpleNamespace(**{k: getattr(torch_ref, k) for k in names})
    if name == "triton":
        from prefixgate.kernels import triton_ops  # imported lazily: triton is optional

        return SimpleNamespace(**{k: getattr(triton_ops, k) for k in KERNEL_NAMES})
    raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")


def default_backend(device: str) -> str:
    """``"triton"`` on CUDA devices, ``"torch"`` elsewhere."""
    return "triton" if str(device).startswith("cuda") else "torch"
