"""What local mode holds beside the shared state: the attached engine, its prefix registry and
its token texts (``LocalServing``, by app key ``LOCAL``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.local.cache_pins import CachePins
from prefixgate.gateway.local.prefixes import PrefixRegistry
from prefixgate.gateway.local.token_texts import TokenTexts

_T = TypeVar("_T")


@dataclass(slots=True)
class LocalServing:
    """The local engine's side of the app; every field is set together by
    ``app.attach_engine`` (until then the engine routes answer 503 ``model_not_ready``)."""

    engine: EngineClient | None = None
    prefixes: PrefixRegistry | None = None
    token_texts: TokenTexts | None = None  # token id -> text, for logprobs
    cache_pins: CachePins | None = None  # cache breakpoints (Messages cache_control, ...)

    def require_engine(self) -> EngineClient:
        """The engine, or 503 while it loads.

        Raises:
            APIError: 503 ``model_not_ready``.
        """
        if self.engine is None:
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                code="model_not_ready",
                retry_after=2.0,
            )
        return self.engine

    def require_token_texts(self) -> TokenTexts:
        """Token id → text of the attached engine's tokenizer (logprobs), or 503 while it
        loads."""
        return self._attached(self.token_texts)

    def require_cache_pins(self) -> CachePins:
        """The cache breakpoint pins of the attached engine, or 503 while it loads.

        Raises:
            APIError: 503 ``model_not_ready``.
        """
        return self._attached(self.cache_pins)

    def require_prefixes(self) -> PrefixRegistry:
        """The prefix registry of the attached engine, or 503 while it loads.

        Raises:
            APIError: 503 ``model_not_ready``.
        """
        return self._attached(self.prefixes)

    def _attached(self, part: _T | None) -> _T:
        """``part`` of the attached engine (set together with it), or 503 while it loads."""
        self.require_engine()
        assert part is not None  # set with the engine
        return part


LOCAL: web.AppKey[LocalServing] = web.AppKey("prefixgate_local", LocalServing)
