"""``client.completions``: legacy text completions, ``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, TypedDict, Unpack, overload

from .._options import StreamCallOptions, split_call
from .._response import to_raw_response_wrapper, to_streamed_response_wrapper
from ..batch import run_batch
from ..streaming import AsyncStream
from ..types import Completion
from ._common import APIResource, GenerationParams, reject_stream, require_str, takes

__all__ = [
    "CompletionCreateParams",
    "CompletionRequired",
    "AsyncCompletions",
    "AsyncCompletionsWithRawResponse",
    "AsyncCompletionsWithStreamingResponse",
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
        return await run_batch(
            self._non_stream_create,
            requests,
            workers=self._client.max_concurrency,
            progress=progress,
            desc="completions",
        )

    async def _non_stream_create(self, **request: Any) -> Completion:
        reject_stream(request)
        result: Completion = await self.create(**request)
        return result

    @cached_property
    def with_raw_response(self) -> AsyncCompletionsWithRawResponse:
        """The same methods, returning an ``APIResponse`` (headers, status, ``parse()``)."""
        return AsyncCompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncCompletionsWithStreamingResponse:
        """The same methods as ``async with`` blocks yielding an ``AsyncAPIResponse``."""
        return AsyncCompletionsWithStreamingResponse(self)


class AsyncCompletionsWithRawResponse:
    """``client.completions.with_raw_response``."""

    def __init__(self, completions: AsyncCompletions) -> None:
        self.create = to_raw_response_wrapper(completions.create)


class AsyncCompletionsWithStreamingResponse:
    """``client.completions.with_streaming_response``."""

    def __init__(self, completions: AsyncCompletions) -> None:
        self.create = to_streamed_response_wrapper(completions.create)
