"""``client.chat.completions``: ``POST /v1/chat/completions`` (create, parse, stream, batch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, TypeVar, overload

from .._options import Requester, Timeout, make_options
from .._parsing import parse_chat_completion, response_format_param
from .._response import (
    APIResponse,
    to_raw_response_wrapper,
    to_streamed_response_wrapper,
)
from ..batch import run_batch
from ..streaming import AsyncStream
from ..types import ChatCompletion, ChatCompletionChunk, ParsedChatCompletion
from ._common import APIResource, call_args, clean_body, reject_stream, require_str

__all__ = [
    "AsyncChat",
    "AsyncChatCompletions",
    "AsyncChatCompletionsWithRawResponse",
    "AsyncChatCompletionsWithStreamingResponse",
    "validate_messages",
]

ResponseFormatT = TypeVar("ResponseFormatT")


def validate_messages(messages: Any, *, allow_empty: bool = False) -> list[dict[str, Any]]:
    """Check a chat ``messages`` list: mappings with a str ``role``.

    Raises:
        TypeError: not a list of mappings, or a role that is not a str.
        ValueError: an empty list (unless ``allow_empty``).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError(f"messages[{i}] must be a dict with a str 'role', got {m!r}")
        out.append(dict(m))
    return out


class AsyncChatCompletions(APIResource):
    """``client.chat.completions``."""

    @overload
    async def create(
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
    async def create(
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
    ) -> AsyncStream[ChatCompletionChunk]: ...

    @overload
    async def create(
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
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]: ...

    async def create(
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
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """Create a chat completion (OpenAI API parameters; None: the server's default).

        Every keyword is named: an unknown one is a ``TypeError`` (nothing is sent). Send a
        field this method does not name with ``extra_body`` (openai-python's convention).

        Args:
            model: served model name.
            messages: ``[{"role": ..., "content": ...}, ...]`` (assistant messages may carry
                ``tool_calls``, tool results are ``{"role": "tool", "tool_call_id", ...}``);
                with ``prefix_id`` only the turns after the registered prefix.
            stream: return an ``AsyncStream[ChatCompletionChunk]`` (``async for`` / ``async
                with``) instead of a ``ChatCompletion``.
            response_format: ``{"type": "text" | "json_object" | "json_schema", ...}``; for a
                pydantic model use ``parse``.
            tools, tool_choice, parallel_tool_calls: function calling as in the OpenAI API;
                the answer's ``message.tool_calls`` (stream: ``delta.tool_calls``) are typed.
            logit_bias: token id -> bias in [-100, 100].
            top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids: vLLM's
                sampling extensions (prefixgate implements them).
            cache_salt: prefixgate/vLLM extension: requests share cached prefix blocks only
                with requests of the same salt.
            prefix_id: prefixgate extension: id of a prefix registered with
                ``client.prefixes.create`` that the server prepends to ``messages``.
            extra_headers, extra_query, extra_body: added to the HTTP request.
            timeout: seconds or ``httpx.Timeout`` for this call; ``max_retries``: retries for
                this call; ``idle_timeout``: stream only, seconds allowed between two chunks.

        Raises:
            TypeError / ValueError: malformed arguments (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", model)
        msgs = validate_messages(messages, allow_empty=prefix_id is not None)
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
                messages=msgs,
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
            )
        )
        if stream:
            body["stream"] = True
            chunks: AsyncStream[ChatCompletionChunk] = await self._client.request(
                "POST",
                "chat/completions",
                body=body,
                cast=ChatCompletionChunk.model_validate,
                stream=True,
                options=options,
            )
            return chunks
        completion: ChatCompletion = await self._client.request(
            "POST",
            "chat/completions",
            body=body,
            cast=ChatCompletion.model_validate,
            options=options,
        )
        return completion

    async def parse(
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
        """``create`` whose answer is parsed: ``choices[i].message.parsed`` (openai-python's).

        ``response_format`` may be a pydantic model class (or any type pydantic validates: a
        dataclass, a TypedDict): it is sent as a strict ``json_schema`` and each choice's
        content is validated into ``message.parsed`` (None on a refusal). Tool calls of tools
        declared ``"strict": true`` get ``function.parsed_arguments``. Other arguments: as
        ``create`` (never streams).

        Raises:
            LengthFinishReasonError: a choice was cut at the length limit (its JSON is
                incomplete: raise ``max_tokens``).
            ContentFilterFinishReasonError: a choice was withheld by a content filter.
            pydantic.ValidationError: content that does not validate against the type.
            TypeError: a ``response_format`` that is neither a type nor a mapping.
            APIStatusError, APIConnectionError, APITimeoutError: see ``create``.
        """
        params = call_args(locals())
        if response_format is not None:  # a type becomes its strict json_schema
            params["response_format"] = response_format_param(response_format)
        completion: ChatCompletion = await self.create(stream=False, **params)
        if isinstance(completion, APIResponse):  # with_raw_response: parse what it holds
            completion._parsed = parse_chat_completion(completion.parse(), response_format, tools)
            return completion  # type: ignore[return-value]
        return parse_chat_completion(completion, response_format, tools)

    async def batch(
        self,
        requests: Sequence[Mapping[str, Any]],
        *,
        progress: bool = False,
    ) -> list[ChatCompletion | Exception]:
        """Run ``create(**request)`` for each request under the client's concurrency limit.

        Returns:
            one entry per request, in input order: the ``ChatCompletion`` or the exception that
            request raised (one failure cancels nothing).

        Raises:
            TypeError: an item is not a mapping.
        """
        return await run_batch(
            self._non_stream_create,
            requests,
            workers=self._client.max_concurrency,
            progress=progress,
            desc="chat.completions",
        )

    async def _non_stream_create(self, **request: Any) -> ChatCompletion:
        reject_stream(request)
        result: ChatCompletion = await self.create(**request)
        return result

    @cached_property
    def with_raw_response(self) -> AsyncChatCompletionsWithRawResponse:
        """The same methods, returning an ``APIResponse`` (headers, status, ``parse()``)."""
        return AsyncChatCompletionsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncChatCompletionsWithStreamingResponse:
        """The same methods as ``async with`` blocks yielding an ``AsyncAPIResponse`` whose
        body is read on demand."""
        return AsyncChatCompletionsWithStreamingResponse(self)


class AsyncChatCompletionsWithRawResponse:
    """``client.chat.completions.with_raw_response``."""

    def __init__(self, completions: AsyncChatCompletions) -> None:
        self.create = to_raw_response_wrapper(completions.create)
        self.parse = to_raw_response_wrapper(completions.parse)


class AsyncChatCompletionsWithStreamingResponse:
    """``client.chat.completions.with_streaming_response``."""

    def __init__(self, completions: AsyncChatCompletions) -> None:
        self.create = to_streamed_response_wrapper(completions.create)


class AsyncChat:
    """``client.chat`` (holds ``completions``)."""

    def __init__(self, client: Requester) -> None:
        self.completions = AsyncChatCompletions(client)
