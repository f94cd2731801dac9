"""``client.completions``: legacy text completions, ``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, overload

from .._options import Timeout, make_options
from .._response import to_raw_response_wrapper, to_streamed_response_wrapper
from ..batch import run_batch
from ..streaming import AsyncStream
from ..types import Completion
from ._common import APIResource, clean_body, reject_stream, require_str

__all__ = [
    "AsyncCompletions",
    "AsyncCompletionsWithRawResponse",
    "AsyncCompletionsWithStreamingResponse",
]


class AsyncCompletions(APIResource):
    """``client.completions``."""

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: Literal[False] = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: Literal[True],
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncStream[Completion]: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: bool = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion | AsyncStream[Completion]: ...

    async def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: bool = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion | AsyncStream[Completion]:
        """Complete ``prompt`` (text, list of texts, token ids, or lists of token ids).

        ``stream=True`` returns an ``AsyncStream[Completion]`` of chunks. Every keyword is
        named (an unknown one is a ``TypeError``); the sampling extensions, ``cache_salt`` and
        the request options are those of ``chat.completions.create``.

        Raises:
            TypeError / ValueError: malformed arguments (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", model)
        if isinstance(prompt, bytes) or not isinstance(prompt, (str, Sequence)):
            raise TypeError(f"prompt must be a str or a list, got {type(prompt).__name__}")
        options = make_options(
            extra_headers=extra_headers,
            extra_query=extra_query,
            extra_body=extra_body,
            timeout=timeout,
            max_retries=max_retries,
            idle_timeout=idle_timeout,
        )
        body = clean_body(
            dict(
                model=model,
                prompt=prompt if isinstance(prompt, str) else list(prompt),
                best_of=best_of,
                echo=echo,
                frequency_penalty=frequency_penalty,
                logit_bias=logit_bias,
                logprobs=logprobs,
                max_tokens=max_tokens,
                n=n,
                presence_penalty=presence_penalty,
                seed=seed,
                stop=stop,
                stream_options=stream_options,
                suffix=suffix,
                temperature=temperature,
                top_p=top_p,
                user=user,
                top_k=top_k,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                min_tokens=min_tokens,
                ignore_eos=ignore_eos,
                stop_token_ids=stop_token_ids,
                cache_salt=cache_salt,
            )
        )
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
