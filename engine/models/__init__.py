"""Model side of the engine: config, the Llama-family model over a paged KV cache, loading.

Lazy (PEP 562, as ``prefixgate.engine``): importing the package or its torch-free module
``errors`` loads no torch, so ``engine.tokenizer`` (which names ``ModelFileNotFoundError``)
runs in a torch-free gateway (proxy mode's ``precise`` routing tokenizes there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixgate.engine.lazy import lazy_getattr

_LAZY = {
    "SUPPORTED_ARCHITECTURES": "prefixgate.engine.models.config",
    "ModelConfig": "prefixgate.engine.models.config",
    "ModelFileNotFoundError": "prefixgate.engine.models.errors",
    "CausalLM": "prefixgate.engine.models.llama",
    "load_model": "prefixgate.engine.models.loader",
}

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "ModelFileNotFoundError",
    "load_model",
]

if TYPE_CHECKING:
    from prefixgate.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
    from prefixgate.engine.models.errors import ModelFileNotFoundError
    from prefixgate.engine.models.llama import CausalLM
    from prefixgate.engine.models.loader import load_model


__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
