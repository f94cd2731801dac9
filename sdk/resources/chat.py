"""``client.chat.completions``: ``POST /v1/chat/completions`` (create, parse, stream, batch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar, Unpack, overload

from .._options import Requester, StreamCallOptions, split_call
from .._parsing import parse_chat_completion, response_format_param
from .._response import (
    APIResponse,
)
from ..streaming import AsyncStream
from ..types import ChatCompletion, ChatCompletionChunk, ParsedChatCompletion
from ._common import APIResource, GenerationParams, require_str, takes

__all__ = [
    "ChatCompletionCreateParams",
    "ChatCompletionParseParams",
    "ChatRequired",
    "AsyncChat",
    "AsyncChatCompletions",
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


class ChatRequired(TypedDict):
    """The keywords a chat request (and a prefix) cannot do without."""

    model: str
    messages: Sequence[Mapping[str, Any]]


class ChatCompletionParseParams(ChatRequired, GenerationParams, StreamCallOptions, total=False):
    """The keywords of ``chat.completions.parse`` besides its ``response_format`` (their
    meaning: ``AsyncChatCompletions.create``)."""

    logprobs: bool | None
    max_completion_tokens: int | None
    parallel_tool_calls: bool | None
    tool_choice: str | Mapping[str, Any] | None
    tools: Sequence[Mapping[str, Any]] | None
    top_logprobs: int | None
    prefix_id: str | None


class ChatCompletionCreateParams(ChatCompletionParseParams, total=False):
    """The keywords of ``chat.completions.create`` besides ``stream`` (async and blocking)."""

    response_format: Mapping[str, Any] | None


class AsyncChatCompletions(APIResource):
    """``client.chat.completions``."""

    raw_methods = ("create", "parse")
    streamed_methods = ("create",)

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self, *, stream: Literal[True], **params: Unpack[ChatCompletionCreateParams]
    ) -> AsyncStream[ChatCompletionChunk]: ...

    @overload
    async def create(
        self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]: ...

    @takes(ChatCompletionCreateParams)
    async def create(
        self, *, stream: bool = False, **params: Unpack[ChatCompletionCreateParams]
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
        require_str("model", params["model"])
        allow_empty = params.get("prefix_id") is not None
        messages = validate_messages(params["messages"], allow_empty=allow_empty)
        body, options = split_call(params)
        body["messages"] = messages
        if stream:
            body["stream"] = True
        result: ChatCompletion | AsyncStream[ChatCompletionChunk] = await self._client.request(
            "POST",
            "chat/completions",
            body=body,
            cast=ChatCompletionChunk.model_validate if stream else ChatCompletion.model_validate,
            stream=stream,
            options=options,
        )
        return result

    @takes(ChatCompletionParseParams)
    async def parse(
        self,
        *,
        response_format: type[ResponseFormatT] | Mapping[str, Any] | None = None,
        **params: Unpack[ChatCompletionParseParams],
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
        # a type becomes its strict json_schema
        wire_format = None if response_format is None else response_format_param(response_format)
        completion: ChatCompletion = await self.create(
            stream=False, response_format=wire_format, **params
        )
        tools = params.get("tools")
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
        return await self._batch(self.create, requests, progress, "chat.completions")


class AsyncChat:
    """``client.chat`` (holds ``completions``)."""

    def __init__(self, client: Requester) -> None:
        self.completions = AsyncChatCompletions(client)
