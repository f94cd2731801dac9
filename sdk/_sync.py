"""``Client``: the blocking twin of ``AsyncClient``, same surface, same behaviour.

It runs an ``AsyncClient`` on an event loop in a background thread (an anyio blocking portal)
and calls into it, so limits, retries, streaming and batches behave exactly as in the async
client; several threads may share one ``Client`` (its concurrency limit is then shared too).
Streams come back as ``SyncStream`` (iterator + context manager). Every method has the async
method's parameters, spelled out (see the async twin for their meaning).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, Self, TypeVar, overload

import anyio.from_thread
import httpx

from ._client import DEFAULT_TIMEOUT, AsyncClient
from ._options import Timeout
from ._response import APIResponse, AsyncAPIResponse, _ResponseInfo, call_in_mode
from .limits import RateLimit
from .resources.chat import AsyncChatCompletions
from .resources.completions import AsyncCompletions
from .resources.models import AsyncModels
from .resources.prefixes import AsyncPrefixes, PrefixSession
from .retry import RetryPolicy
from .streaming import AsyncStream
from .types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelInfo,
    ModelList,
    ParsedChatCompletion,
    Prefix,
    PrefixDeleted,
)

__all__ = ["Client", "SyncStream", "SyncAPIResponse"]

T = TypeVar("T")
ResponseFormatT = TypeVar("ResponseFormatT")


class SyncStream(Generic[T]):
    """Blocking iterator (and context manager) over an ``AsyncStream``.

    Breaking out of the ``for`` loop or leaving the ``with`` block closes the response.
    """

    def __init__(self, stream: AsyncStream[T], portal: anyio.from_thread.BlockingPortal) -> None:
        self._stream = stream
        self._portal = portal

    @property
    def response(self) -> httpx.Response:
        """The underlying ``httpx.Response``."""
        return self._stream.response

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._portal.call(self._stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Close the response and free the concurrency slot (idempotent)."""
        self._portal.call(self._stream.close)


class SyncAPIResponse(_ResponseInfo, Generic[T]):
    """Blocking ``AsyncAPIResponse`` (``with_streaming_response``): the body is read on demand;
    leaving the ``with`` block closes it."""

    def __init__(self, response: AsyncAPIResponse[T], portal: anyio.from_thread.BlockingPortal):
        self._async = response
        self._portal = portal
        self.http_response = response.http_response

    def parse(self) -> T:
        """The typed result (a ``SyncStream`` for ``stream=True``)."""
        result = self._portal.call(self._async.parse)
        if isinstance(result, AsyncStream):
            return SyncStream(result, self._portal)  # type: ignore[return-value]
        return result

    def read(self) -> bytes:
        return self._portal.call(self._async.read)

    def text(self) -> str:
        return self._portal.call(self._async.text)

    def json(self) -> Any:
        return self._portal.call(self._async.json)

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        return self._iterate(self._async.iter_bytes(chunk_size))

    def iter_text(self, chunk_size: int | None = None) -> Iterator[str]:
        return self._iterate(self._async.iter_text(chunk_size))

    def iter_lines(self) -> Iterator[str]:
        return self._iterate(self._async.iter_lines())

    def close(self) -> None:
        """Close the response and free the call's concurrency slot (idempotent)."""
        self._portal.call(self._async.close)

    def _iterate(self, source: AsyncGenerator[Any, None]) -> Iterator[Any]:
        try:
            while True:
                try:
                    yield self._portal.call(source.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(source.aclose)


class SyncResponseContextManager(Generic[T]):
    """``with`` around a blocking ``with_streaming_response`` call: closes it on exit."""

    def __init__(self, open_response: Callable[[], SyncAPIResponse[T]]) -> None:
        self._open = open_response
        self._response: SyncAPIResponse[T] | None = None

    def __enter__(self) -> SyncAPIResponse[T]:
        self._response = self._open()
        return self._response

    def __exit__(self, *exc_info: object) -> None:
        if self._response is not None:
            self._response.close()


class _Bridge:
    """Runs coroutines of the wrapped client on the portal and wraps what comes back."""

    def __init__(self, portal: anyio.from_thread.BlockingPortal) -> None:
        self.portal = portal

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(self.portal.call(functools.partial(fn, *args, **kwargs)))

    def raw(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` answered as an ``APIResponse`` (``with_raw_response``)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(call_in_mode, "raw", fn, *args, **kwargs)

        call.__doc__ = fn.__doc__
        return call

    def streamed(self, fn: Callable[..., Any]) -> Callable[..., SyncResponseContextManager[Any]]:
        """``fn`` as a ``with`` block of a ``SyncAPIResponse`` (``with_streaming_response``)."""

        def call(*args: Any, **kwargs: Any) -> SyncResponseContextManager[Any]:
            def open_response() -> SyncAPIResponse[Any]:
                response = self.portal.call(
                    functools.partial(call_in_mode, "streaming", fn, *args, **kwargs)
                )
                return SyncAPIResponse(response, self.portal)

            return SyncResponseContextManager(open_response)

        call.__doc__ = fn.__doc__
        return call

    def _wrap(self, result: Any) -> Any:
        if isinstance(result, AsyncStream):
            return SyncStream(result, self.portal)
        if isinstance(result, APIResponse) and isinstance(result._parsed, AsyncStream):
            result._parsed = SyncStream(result._parsed, self.portal)
        return result


class _RawMethods:
    """``with_raw_response`` / ``with_streaming_response`` of a blocking resource: the named
    methods of its async twin, bridged."""

    def __init__(self, bridge: _Bridge, target: Any, names: Sequence[str], streamed: bool):
        for name in names:
            method = getattr(target, name)
            setattr(self, name, bridge.streamed(method) if streamed else bridge.raw(method))


class SyncChatCompletions:
    """``client.chat.completions`` (see ``AsyncChatCompletions``)."""

    def __init__(self, completions: AsyncChatCompletions, bridge: _Bridge) -> None:
        self._async = completions
        self._bridge = bridge
        self.with_raw_response = _RawMethods(bridge, completions, ("create", "parse"), False)
        self.with_streaming_response = _RawMethods(bridge, completions, ("create",), True)

    @overload
    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: Literal[False] = False,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: bool | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        parallel_tool_calls: bool | None = None,
        presence_penalty: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        temperature: float | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        top_logprobs: int | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        prefix_id: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> ChatCompletion: ...

    @overload
    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: Literal[True],
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: bool | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        parallel_tool_calls: bool | None = None,
        presence_penalty: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        temperature: float | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        top_logprobs: int | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        prefix_id: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> SyncStream[ChatCompletionChunk]: ...

    @overload
    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: bool | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        parallel_tool_calls: bool | None = None,
        presence_penalty: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        temperature: float | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        top_logprobs: int | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        prefix_id: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]: ...

    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: bool | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        parallel_tool_calls: bool | None = None,
        presence_penalty: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        temperature: float | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        top_logprobs: int | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        prefix_id: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``AsyncChatCompletions.create``."""
        result: ChatCompletion | SyncStream[ChatCompletionChunk] = self._bridge.run(
            self._async.create,
            model=model,
            messages=messages,
            stream=stream,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=logprobs,
            max_completion_tokens=max_completion_tokens,
            max_tokens=max_tokens,
            n=n,
            parallel_tool_calls=parallel_tool_calls,
            presence_penalty=presence_penalty,
            response_format=response_format,
            seed=seed,
            stop=stop,
            stream_options=stream_options,
            temperature=temperature,
            tool_choice=tool_choice,
            tools=tools,
            top_logprobs=top_logprobs,
            top_p=top_p,
            user=user,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            cache_salt=cache_salt,
            prefix_id=prefix_id,
            extra_headers=extra_headers,
            extra_query=extra_query,
            extra_body=extra_body,
            timeout=timeout,
            max_retries=max_retries,
            idle_timeout=idle_timeout,
        )
        return result

    def parse(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: bool | None = None,
        max_completion_tokens: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        parallel_tool_calls: bool | None = None,
        presence_penalty: float | None = None,
        response_format: type[ResponseFormatT] | Mapping[str, Any] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        temperature: float | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        top_logprobs: int | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        prefix_id: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> ParsedChatCompletion[ResponseFormatT]:
        """Blocking ``AsyncChatCompletions.parse``."""
        result: ParsedChatCompletion[ResponseFormatT] = self._bridge.run(
            self._async.parse,
            model=model,
            messages=messages,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
            logprobs=logprobs,
            max_completion_tokens=max_completion_tokens,
            max_tokens=max_tokens,
            n=n,
            parallel_tool_calls=parallel_tool_calls,
            presence_penalty=presence_penalty,
            response_format=response_format,
            seed=seed,
            stop=stop,
            stream_options=stream_options,
            temperature=temperature,
            tool_choice=tool_choice,
            tools=tools,
            top_logprobs=top_logprobs,
            top_p=top_p,
            user=user,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            cache_salt=cache_salt,
            prefix_id=prefix_id,
            extra_headers=extra_headers,
            extra_query=extra_query,
            extra_body=extra_body,
            timeout=timeout,
            max_retries=max_retries,
            idle_timeout=idle_timeout,
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

    def __init__(self, completions: AsyncChatCompletions, bridge: _Bridge) -> None:
        self.completions = SyncChatCompletions(completions, bridge)


class SyncCompletions:
    """``client.completions`` (see ``AsyncCompletions``)."""

    def __init__(self, completions: AsyncCompletions, bridge: _Bridge) -> None:
        self._async = completions
        self._bridge = bridge
        self.with_raw_response = _RawMethods(bridge, completions, ("create",), False)
        self.with_streaming_response = _RawMethods(bridge, completions, ("create",), True)

    @overload
    def create(
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
    def create(
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
    ) -> SyncStream[Completion]: ...

    @overload
    def create(
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
    ) -> Completion | SyncStream[Completion]: ...

    def create(
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
    ) -> Completion | SyncStream[Completion]:
        """Blocking ``AsyncCompletions.create``."""
        result: Completion | SyncStream[Completion] = self._bridge.run(
            self._async.create,
            model=model,
            prompt=prompt,
            stream=stream,
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
            extra_headers=extra_headers,
            extra_query=extra_query,
            extra_body=extra_body,
            timeout=timeout,
            max_retries=max_retries,
            idle_timeout=idle_timeout,
        )
        return result

    def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[Completion | Exception]:
        """Blocking ``AsyncCompletions.batch``."""
        result: list[Completion | Exception] = self._bridge.run(
            self._async.batch, requests, progress=progress
        )
        return result


class SyncModels:
    """``client.models`` (see ``AsyncModels``)."""

    def __init__(self, models: AsyncModels, bridge: _Bridge) -> None:
        self._async = models
        self._bridge = bridge
        self.with_raw_response = _RawMethods(bridge, models, ("list", "retrieve"), False)
        self.with_streaming_response = _RawMethods(bridge, models, ("list", "retrieve"), True)

    def list(
        self,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> ModelList:
        """Blocking ``AsyncModels.list``."""
        result: ModelList = self._bridge.run(
            self._async.list,
            extra_headers=extra_headers,
            extra_query=extra_query,
            timeout=timeout,
            max_retries=max_retries,
        )
        return result

    def retrieve(
        self,
        model: str,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> ModelInfo:
        """Blocking ``AsyncModels.retrieve``."""
        result: ModelInfo = self._bridge.run(
            self._async.retrieve,
            model,
            extra_headers=extra_headers,
            extra_query=extra_query,
            timeout=timeout,
            max_retries=max_retries,
        )
        return result


class SyncPrefixSession:
    """Blocking ``PrefixSession`` (context manager: leaving it deletes the prefix)."""

    def __init__(self, session: PrefixSession, bridge: _Bridge) -> None:
        self.session = session
        self._bridge = bridge

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def create(
        self, user: str | Sequence[Mapping[str, Any]], **params: Any
    ) -> ChatCompletion | SyncStream[ChatCompletionChunk]:
        """Blocking ``PrefixSession.create`` (``params``: ``chat.completions.create``'s
        keywords, checked there)."""
        result: ChatCompletion | SyncStream[ChatCompletionChunk] = self._bridge.run(
            self.session.create, user, **params
        )
        return result

    def batch(
        self,
        users: Sequence[str | Sequence[Mapping[str, Any]]],
        *,
        progress: bool = False,
        **params: Any,
    ) -> list[ChatCompletion | Exception]:
        """Blocking ``PrefixSession.batch``."""
        result: list[ChatCompletion | Exception] = self._bridge.run(
            self.session.batch, users, progress=progress, **params
        )
        return result

    def close(self) -> None:
        """Delete the prefix."""
        self._bridge.run(self.session.close)


class SyncPrefixes:
    """``client.prefixes`` (see ``AsyncPrefixes``)."""

    def __init__(self, prefixes: AsyncPrefixes, bridge: _Bridge) -> None:
        self._async = prefixes
        self._bridge = bridge
        names = ("create", "get", "delete")
        self.with_raw_response = _RawMethods(bridge, prefixes, names, False)
        self.with_streaming_response = _RawMethods(bridge, prefixes, names, True)

    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        ttl_seconds: float | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> Prefix:
        """Blocking ``AsyncPrefixes.create``."""
        result: Prefix = self._bridge.run(
            self._async.create,
            model=model,
            messages=messages,
            ttl_seconds=ttl_seconds,
            cache_salt=cache_salt,
            extra_headers=extra_headers,
            extra_query=extra_query,
            extra_body=extra_body,
            timeout=timeout,
            max_retries=max_retries,
        )
        return result

    def get(
        self,
        prefix_id: str,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> Prefix:
        """Blocking ``AsyncPrefixes.get``."""
        result: Prefix = self._bridge.run(
            self._async.get,
            prefix_id,
            extra_headers=extra_headers,
            extra_query=extra_query,
            timeout=timeout,
            max_retries=max_retries,
        )
        return result

    def delete(
        self,
        prefix_id: str,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> PrefixDeleted:
        """Blocking ``AsyncPrefixes.delete``."""
        result: PrefixDeleted = self._bridge.run(
            self._async.delete,
            prefix_id,
            extra_headers=extra_headers,
            extra_query=extra_query,
            timeout=timeout,
            max_retries=max_retries,
        )
        return result

    def session(
        self,
        system_prompt: str | Sequence[Mapping[str, Any]],
        *,
        model: str,
        ttl_seconds: float = 600.0,
    ) -> SyncPrefixSession:
        """A blocking ``PrefixSession``."""
        s = self._async.session(system_prompt, model=model, ttl_seconds=ttl_seconds)
        return SyncPrefixSession(s, self._bridge)


class Client:
    """Blocking client; takes exactly ``AsyncClient``'s arguments (see there).

    Call ``close()`` (or use ``with Client(...) as client``) to stop its background thread.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        max_concurrency: int = 64,
        max_retries: int | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        rate_limit: RateLimit | None = None,
        adaptive_concurrency: bool = False,
        retry_policy: RetryPolicy | None = None,
        stream_idle_timeout: float | None = None,
        default_headers: Mapping[str, str] | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._exit = contextlib.ExitStack()
        portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            async_client = AsyncClient(
                base_url,
                api_key,
                max_concurrency=max_concurrency,
                max_retries=max_retries,
                timeout=timeout,
                rate_limit=rate_limit,
                adaptive_concurrency=adaptive_concurrency,
                retry_policy=retry_policy,
                stream_idle_timeout=stream_idle_timeout,
                default_headers=default_headers,
                http_client=http_client,
            )
        except BaseException:
            self._exit.close()
            raise
        self._bind(async_client, portal, owner=True)

    def _bind(
        self, async_client: AsyncClient, portal: anyio.from_thread.BlockingPortal, *, owner: bool
    ) -> None:
        self._owner = owner  # closing stops the thread and the pool (not for a copy)
        self._async = async_client
        self._portal = portal
        bridge = _Bridge(portal)
        self.base_url = async_client.base_url
        self.api_key = async_client.api_key
        self.chat = SyncChat(async_client.chat.completions, bridge)
        self.completions = SyncCompletions(async_client.completions, bridge)
        self.models = SyncModels(async_client.models, bridge)
        self.prefixes = SyncPrefixes(async_client.prefixes, bridge)
        self._closed = False

    @property
    def async_client(self) -> AsyncClient:
        """The wrapped ``AsyncClient`` (lives on the background loop)."""
        return self._async

    def with_options(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        stream_idle_timeout: float | None = None,
        default_headers: Mapping[str, str] | None = None,
    ) -> Client:
        """A copy with some options changed (see ``AsyncClient.with_options``); it shares this
        client's thread, pool and limits, and closing it leaves them open."""
        new = object.__new__(Client)
        new._exit = contextlib.ExitStack()  # owns nothing
        new._bind(
            self._async.with_options(
                base_url=base_url,
                api_key=api_key,
                timeout=timeout,
                max_retries=max_retries,
                stream_idle_timeout=stream_idle_timeout,
                default_headers=default_headers,
            ),
            self._portal,
            owner=False,
        )
        return new

    copy = with_options

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool and stop the background thread (idempotent; a
        ``with_options`` copy closes nothing)."""
        if self._closed:
            return
        self._closed = True
        if not self._owner:
            return
        try:
            self._portal.call(self._async.close)
        finally:
            self._exit.close()
