"""prefixgate.engine: paged-KV LLM engine with prefix caching (offline ``LLM``, ``AsyncEngine``).

Never imported by ``prefixgate.sdk`` (the SDK installs without torch).
"""

from prefixgate.engine.async_engine import AsyncEngine, EngineDeadError
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import PinLimitError
from prefixgate.engine.kv_cache_manager import PrefixPin
from prefixgate.engine.llm import LLM
from prefixgate.engine.llm_engine import LLMEngine
from prefixgate.engine.outputs import CompletionOutput, RequestOutput
from prefixgate.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "PinLimitError",
    "PrefixPin",
    "RequestOutput",
    "SamplingParams",
]
