"""``client.responses``: OpenAI's Responses API, ``POST /v1/responses`` (create, streamed or
not)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack, overload

from .._options import StreamCallOptions, split_call
from ..streaming import AsyncStream
from ..types import Response, ResponseStreamEvent
from ._common import APIResource, require_str, takes

__all__ = ["AsyncResponses", "ResponseCreateParams", "ResponseRequired", "STREAM_END"]

STREAM_END = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The events that end a Responses stream (it has no ``data: [DONE]``)."""


class ResponseRequired(TypedDict):
    """The keywords a response cannot do without."""

    model: str
    input: str | Sequence[Mapping[str, Any]]


class ResponseCreateParams(ResponseRequired, StreamCallOptions, total=False):
    """The keywords of ``responses.create`` besides ``stream`` (async and blocking):
    openai-python's, and prefixgate's ``cache_salt`` / ``prompt_cache_options``. The server
    refuses what it does not implement by name (400: stored responses, tools, reasoning,
    ``include``, ``background``, logprobs; docs/serving.md)."""

    background: bool | None
    conversation: str | Mapping[str, Any] | None
    include: Sequence[str] | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: Mapping[str, str] | None
    parallel_tool_calls: bool | None
    previous_response_id: str | None
    prompt: Mapping[str, Any] | None
    prompt_cache_key: str | None
    prompt_cache_options: Mapping[str, Any] | None
    prompt_cache_retention: str | None
    reasoning: Mapping[str, Any] | None
    safety_identifier: str | None
    service_tier: str | None
    store: bool | None
    stream_options: Mapping[str, Any] | None
    temperature: float | None
    text: Mapping[str, Any] | None
    tool_choice: str | Mapping[str, Any] | None
    tools: Sequence[Mapping[str, Any]] | None
    top_logprobs: int | None
    top_p: float | None
    truncation: str | None
    user: str | None
    cache_salt: str | None


class AsyncResponses(APIResource):
    """``client.responses``."""

    raw_methods = streamed_methods = ("create",)

    @overload
    async def create(
        self, *, stream: Literal[False] = False, **params: Unpack[ResponseCreateParams]
    ) -> Response: ...

    @overload
    async def create(
        self, *, stream: Literal[True], **params: Unpack[ResponseCreateParams]
    ) -> AsyncStream[ResponseStreamEvent]: ...

    @overload
    async def create(
        self, *, stream: bool = False, **params: Unpack[ResponseCreateParams]
    ) -> Response | AsyncStream[ResponseStreamEvent]: ...

    @takes(ResponseCreateParams)
    async def create(
        self, *, stream: bool = False, **params: Unpack[ResponseCreateParams]
    ) -> Response | AsyncStream[ResponseStreamEvent]:
        """Answer ``input`` (a string, or a list of message items ``{"role", "content"}``)
        after ``instructions`` (the system message).

        ``stream=True`` returns an ``AsyncStream[ResponseStreamEvent]`` of the typed events
        (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``);
        it ends with ``response.completed``, ``response.incomplete`` or ``response.failed``
        (``STREAM_END``: the stream has no ``data: [DONE]``), and a body that ends before
        one raises ``APIConnectionError``; an ``error`` event raises ``APIError``.

        Raises:
            TypeError: a ``model`` that is not a non-empty str, an ``input`` that is neither
                a str nor a list of dicts, an unknown keyword (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", params["model"])
        given = params["input"]
        if not isinstance(given, str):
            if not isinstance(given, Sequence) or isinstance(given, bytes):
                raise TypeError(f"input must be a str or a list, got {type(given).__name__}")
            for i, item in enumerate(given):
                if not isinstance(item, Mapping):
                    raise TypeError(f"input[{i}] must be a dict, got {item!r}")
        body, options = split_call(params)
        body["input"] = given if isinstance(given, str) else [dict(m) for m in given]
        if stream:
            body["stream"] = True
        result: Response | AsyncStream[ResponseStreamEvent] = await self._client.request(
            "POST",
            "responses",
            body=body,
            cast=ResponseStreamEvent.model_validate if stream else Response.model_validate,
            stream=stream,
            options=options,
            end_events=STREAM_END,
        )
        return result
