"""prefixgate.engine: paged-KV LLM engine with prefix caching (offline ``LLM``, ``AsyncEngine``).

Never imported by ``prefixgate.sdk`` (the SDK installs without torch).

The package is lazy (PEP 562 module ``__getattr__``, as vLLM's ``vllm/__init__.py``): importing
``prefixgate.engine`` or its torch-free modules (``sampling_params``, ``outputs``, ``errors``,
``config``, ``protocol``) loads no torch, so the gateway in proxy mode runs without it. A name
below is imported on first use (``from prefixgate.engine import AsyncEngine`` loads torch then).
"""

from __future__ import annotations

if __name__ != "prefixgate.engine":  # the checkout's folder imported by its bare name
    from prefixgate.sdk._bare_name import step_aside

    step_aside(__name__, __file__)
else:
    from typing import TYPE_CHECKING

    from prefixgate.engine.lazy import lazy_getattr

    # Public name -> the module that defines it.
    _LAZY = {
        "LLM": "prefixgate.engine.llm",
        "AsyncEngine": "prefixgate.engine.async_engine",
        "CompletionOutput": "prefixgate.engine.outputs",
        "EngineConfig": "prefixgate.engine.config",
        "EngineDeadError": "prefixgate.engine.errors",
        "EngineRequest": "prefixgate.engine.protocol",
        "LLMEngine": "prefixgate.engine.llm_engine",
        "PinLimitError": "prefixgate.engine.errors",
        "PrefixPin": "prefixgate.engine.kv_cache_manager",
        "RequestOutput": "prefixgate.engine.outputs",
        "SamplingParams": "prefixgate.engine.sampling_params",
    }

    __all__ = [
        "LLM",
        "AsyncEngine",
        "CompletionOutput",
        "EngineConfig",
        "EngineDeadError",
        "EngineRequest",
        "LLMEngine",
        "PinLimitError",
        "PrefixPin",
        "RequestOutput",
        "SamplingParams",
    ]

    if TYPE_CHECKING:
        from prefixgate.engine.async_engine import AsyncEngine
        from prefixgate.engine.config import EngineConfig
        from prefixgate.engine.errors import EngineDeadError, PinLimitError
        from prefixgate.engine.kv_cache_manager import PrefixPin
        from prefixgate.engine.llm import LLM
        from prefixgate.engine.llm_engine import LLMEngine
        from prefixgate.engine.outputs import CompletionOutput, RequestOutput
        from prefixgate.engine.protocol import EngineRequest
        from prefixgate.engine.sampling_params import SamplingParams

    __getattr__ = lazy_getattr(__name__, globals(), _LAZY)

    def __dir__() -> list[str]:
        return sorted([*globals(), *_LAZY])
