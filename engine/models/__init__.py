"""Model side of the engine: config, the Llama-family model over a paged KV cache, loading."""

from prefixgate.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from prefixgate.engine.models.errors import ModelFileNotFoundError
from prefixgate.engine.models.llama import CausalLM
from prefixgate.engine.models.loader import load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "ModelFileNotFoundError",
    "load_model",
]
