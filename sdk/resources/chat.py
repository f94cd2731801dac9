"""``client.chat.completions``: ``POST /v1/chat/completions`` (create, stream, batch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from ..batch import run_batch
from ..streaming import AsyncStream
from ..types import ChatCompletion, ChatCompletionChunk
from ._common import clean_body, require_str, split_options

if TYPE_CHECKING:
    from .._client import AsyncClient

__all__ = ["AsyncChat", "AsyncChatCompletions", "validate_messages"]


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


class AsyncChatCompletions:
    """``client.chat.completions``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: Literal[False] = False,
        **params: Any,
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: Literal[True],
        **params: Any,
    ) -> AsyncStream[ChatCompletionChunk]: ...

    async def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        stream: bool = False,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        stream_options: Mapping[str, Any] | None = None,
        prefix_id: str | None = None,
        user: str | None = None,
        **params: Any,
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """Create a chat completion (OpenAI API parameters; None = server default).

        Args:
            model: served model name.
            messages: ``[{"role": ..., "content": ...}, ...]``; with ``prefix_id`` only the
                turns after the registered prefix.
            stream: return an ``AsyncStream[ChatCompletionChunk]`` (``async for`` / ``async
                with``) instead of a ``ChatCompletion``.
            prefix_id: prefixgate extension: id of a prefix registered with
                ``client.prefixes.create`` that the server prepends to ``messages``.
            params: further body fields (passed through), or the ``RequestOptions`` keywords
                ``extra_headers``, ``extra_query``, ``extra_body``, ``timeout``,
                ``max_retries``, ``idle_timeout``.

        Raises:
            TypeError / ValueError: malformed ``model`` or ``messages`` (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", model)
        msgs = validate_messages(messages, allow_empty=prefix_id is not None)
        params, options = split_options(params)
        body = clean_body(
            dict(
                model=model,
                messages=msgs,
                max_tokens=max_tokens,
                max_completion_tokens=max_completion_tokens,
                temperature=temperature,
                top_p=top_p,
                n=n,
                stop=stop,
                seed=seed,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                stream_options=stream_options,
                prefix_id=prefix_id,
                user=user,
                **params,
            )
        )
        cast: Callable[[Mapping[str, Any]], ChatCompletion | ChatCompletionChunk]
        if stream:
            body["stream"] = True
            cast = ChatCompletionChunk.from_dict
        else:
            cast = ChatCompletion.from_dict
        return await self._client.request(
            "POST", "chat/completions", body=body, cast=cast, stream=stream, options=options
        )

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
        if request.get("stream"):
            raise ValueError("batch() requests cannot stream: drop stream=True")
        return await self.create(**request)


class AsyncChat:
    """``client.chat`` (holds ``completions``)."""

    def __init__(self, client: AsyncClient) -> None:
        self.completions = AsyncChatCompletions(client)
