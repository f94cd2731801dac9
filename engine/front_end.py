"""What the two front ends over one ``LLMEngine`` (``LLM``, offline; ``AsyncEngine``, asyncio)
read straight from it: its configuration, tokenizer and context length."""

from __future__ import annotations

from typing import Any

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.llm_engine import LLMEngine


class EngineFrontEnd:
    """Base of a front end holding its engine as ``self.engine`` (set by the subclass)."""

    engine: LLMEngine

    @property
    def config(self) -> EngineConfig:
        """The engine configuration (the ``EngineConfig`` the engine was built from)."""
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (``encode`` / ``decode`` / ``apply_chat_template``;
        thread-safe for them)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output in tokens."""
        return self.engine.max_model_len
