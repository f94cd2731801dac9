"""Kernels: Triton on CUDA, pure torch on CPU, behind one set of signatures.

``get_backend("torch" | "triton")`` returns a namespace with ``reshape_and_cache``,
``paged_attention_decode``, ``paged_attention_prefill``, ``paged_attention_verify``,
``rms_norm``, ``rotary_embedding`` and ``silu_and_mul``; see :mod:`prefixgate.kernels.torch_ref`
for shapes and semantics. :mod:`prefixgate.kernels.cpu_ext` adds prefixgate's own C++ CPU ops
for one row (batch-1 decode), built on first use; the engine calls them directly where they apply.
"""

from __future__ import annotations

if __name__ != "prefixgate.kernels":  # the checkout's folder imported by its bare name
    from prefixgate.sdk._bare_name import step_aside

    step_aside(__name__, __file__)
else:
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

    def get_backend(name: str) -> SimpleNamespace:
        """Return the kernel namespace for ``name``.

        Raises:
            ValueError: unknown backend name.
            ImportError: ``"triton"`` without triton installed.
        """
        if name == "torch":
            return SimpleNamespace(**{k: getattr(torch_ref, k) for k in KERNEL_NAMES})
        if name == "triton":
            from prefixgate.kernels import triton_ops  # imported lazily: triton is optional

            return SimpleNamespace(**{k: getattr(triton_ops, k) for k in KERNEL_NAMES})
        raise ValueError(f"unknown attention backend {name!r}; expected 'torch' or 'triton'")

    def default_backend(device: str) -> str:
        """``"triton"`` on CUDA devices, ``"torch"`` elsewhere."""
        return "triton" if str(device).startswith("cuda") else "torch"
