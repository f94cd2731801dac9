"""``client.chat.completions`` of the blocking ``Client``: ``AsyncChatCompletions``'s methods
with the same parameters, run through the bridge (see ``chat.py`` for their meaning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

from .._blocking import Bridge, RawMethods, SyncStream
from .._options import Timeout
from ..types import ChatCompletion, ChatCompletionChunk, ParsedChatCompletion
from ._common import call_args
from .chat import AsyncChatCompletions

__all__ = ["SyncChat", "SyncChatCompletions"]

ResponseFormatT = TypeVar("ResponseFormatT")


class SyncChatCompletions:
    """``client.chat.completions`` (see ``AsyncChatCompletions``)."""

    def __init__(self, completions: AsyncChatCompletions, bridge: Bridge) -> None:
        self._async = completions
        self._bridge = bridge
        self.with_raw_response = RawMethods(bridge, completions, ("create", "parse"), False)
        self.with_streaming_response = RawMethods(bridge, completions, ("create",), True)

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
            self._async.create, **call_args(locals())
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
            self._async.parse, **call_args(locals())
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
