"""``client.completions``: legacy text completions, ``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack, overload

from .._options import StreamCallOptions, split_call
from ..streaming import AsyncStream
from ..types import Completion
from ._common import APIResource, GenerationParams, require_str, takes

__all__ = [
    "CompletionCreateParams",
    "CompletionRequired",
    "AsyncCompletions",
]


class CompletionRequired(TypedDict):
    """The keywords a completion cannot do without."""

    model: str
    prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]


class CompletionCreateParams(CompletionRequired, GenerationParams, StreamCallOptions, total=False):
    """The keywords of ``completions.create`` besides ``stream`` (async and blocking)."""

    best_of: int | None
    echo: bool | None
    logprobs: int | None
    suffix: str | None


class AsyncCompletions(APIResource):
    """``client.completions``."""

    raw_methods = streamed_methods = ("create",)

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion: ...

    @overload
    async def create(
        self, *, stream: Literal[True], **params: Unpack[CompletionCreateParams]
    ) -> AsyncStream[Completion]: ...

    @overload
    async def create(
        self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion | AsyncStream[Completion]: ...

    @takes(CompletionCreateParams)
    async def create(
        self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion | AsyncStream[Completion]:
        """Complete ``prompt`` (text, list of texts, token ids, or lists of token ids).

        ``stream=True`` returns an ``AsyncStream[Completion]`` of chunks. Every keyword is
        named (an unknown one is a ``TypeError``); the sampling extensions, ``cache_salt`` and
        the request options are those of ``chat.completions.create``.

        Raises:
            TypeError / ValueError: malformed arguments (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", params["model"])
        prompt = params["prompt"]
        if isinstance(prompt, bytes) or not isinstance(prompt, (str, Sequence)):
            raise TypeError(f"prompt must be a str or a list, got {type(prompt).__name__}")
        body, options = split_call(params)
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        if stream:
            body["stream"] = True
        result: Completion | AsyncStream[Completion] = await self._client.request(
            "POST",
            "completions",
            body=body,
            cast=Completion.model_validate,
            stream=stream,
            options=options,
        )
        return result

    async def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[Completion | Exception]:
        """Like ``chat.completions.batch`` for ``create(**request)`` of this resource."""
        return await self._batch(self.create, requests, progress, "completions")
