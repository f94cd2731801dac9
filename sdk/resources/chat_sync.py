"""``client.chat.completions`` of the blocking ``Client``: ``AsyncChatCompletions``'s methods
with the same parameters (``ChatCompletionCreateParams``, stated once in ``chat.py`` with their
meaning), run through the bridge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Unpack, overload

from .._blocking import Bridge, SyncResource, SyncStream
from ..types import ChatCompletion, ChatCompletionChunk, ParsedChatCompletion
from ._common import takes
from .chat import AsyncChatCompletions, ChatCompletionCreateParams, ChatCompletionParseParams

__all__ = ["SyncChat", "SyncChatCompletions"]

ResponseFormatT = TypeVar("ResponseFormatT")


class SyncChatCompletions(SyncResource[AsyncChatCompletions]):
    """``client.chat.completions`` (see ``AsyncChatCompletions``)."""

    @overload
    def create(
        self, *, stream: Literal[False] = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> ChatCompletion: ...

    @overload
    def create(
        self, *, stream: Literal[True], **params: Unpack[ChatCompletionCreateParams]
    ) -> SyncStream[ChatCompletionChunk]: ...

    @overload
    def create(
        self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]: ...

    @takes(ChatCompletionCreateParams)
    def create(
        self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``AsyncChatCompletions.create``."""
        result: ChatCompletion | SyncStream[ChatCompletionChunk] = self._bridge.run(
            self._async.create, stream=stream, **params
        )
        return result

    @takes(ChatCompletionParseParams)
    def parse(
        self,
        *,
        response_format: type[ResponseFormatT] | Mapping[str, Any] | None = None,
        **params: Unpack[ChatCompletionParseParams],
    ) -> ParsedChatCompletion[ResponseFormatT]:
        """Blocking ``AsyncChatCompletions.parse``."""
        result: ParsedChatCompletion[ResponseFormatT] = self._bridge.run(
            self._async.parse, response_format=response_format, **params
        )
        return result

    def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[ChatCompletion | Exception]:
        """Blocking ``AsyncChatCompletions.batch`` (runs concurrently under the limit)."""
        result: list[ChatCompletion | Exception] = self._bridge.run(
            self._async.batch, requests, progress=progress
        )
        return result


class SyncChat:
    """``client.chat``."""

    def __init__(self, completions: AsyncChatCompletions, bridge: Bridge) -> None:
        self.completions = SyncChatCompletions(completions, bridge)
