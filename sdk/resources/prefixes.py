"""``client.prefixes``: prefixgate's prefix API and the ``PrefixSession`` reuse helper.

``POST /v1/prefixes {model, messages, ttl_seconds}`` renders and pins the leading messages
(typically the system prompt) on the server; a chat request carrying ``prefix_id`` and only
its new messages is served as the whole conversation, its prefix KV blocks from the pin.
``PrefixSession`` registers once, sends only the user turns, re-registers when the prefix
expired, and against a server without the route (404/405/501 on ``/v1/prefixes``, e.g. any
other OpenAI-compatible server) or with its prefix space full falls back to sending the full
messages, which that server's own prefix cache (if any) may still serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self, Unpack

import anyio

from .._options import BodyCallOptions, CallOptions, split_call
from ..batch import run_batch
from ..errors import APIStatusError, NotFoundError, RateLimitError
from ..streaming import AsyncStream
from ..types import ChatCompletion, ChatCompletionChunk, Prefix, PrefixDeleted
from ._common import APIResource, path_part, reject_stream, require_str, takes
from .chat import AsyncChatCompletions, ChatRequired, validate_messages

__all__ = [
    "PrefixCreateParams",
    "AsyncPrefixes",
    "PrefixSession",
]

_UNSUPPORTED_STATUSES = frozenset({404, 405, 501})


class PrefixCreateParams(ChatRequired, BodyCallOptions, total=False):
    """The keywords of ``prefixes.create`` (async and blocking)."""

    ttl_seconds: float | None
    cache_salt: str | None


class AsyncPrefixes(APIResource):
    """``client.prefixes``."""

    raw_methods = streamed_methods = ("create", "get", "delete")

    @takes(PrefixCreateParams)
    async def create(self, **params: Unpack[PrefixCreateParams]) -> Prefix:
        """Register and pin ``messages`` as a prefix for ``ttl_seconds`` (server default if None).

        Raises:
            TypeError / ValueError: malformed arguments (nothing is sent).
            NotFoundError: unknown model, or a server without ``/v1/prefixes``.
            RateLimitError: the server's prefix space is full (``code ==
                "prefix_limit_exceeded"``; not retried).
        """
        require_str("model", params["model"])
        ttl_seconds = params.get("ttl_seconds")
        if ttl_seconds is not None and not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds!r}")
        messages = validate_messages(params["messages"])
        body, options = split_call(params)
        body["messages"] = messages
        result: Prefix = await self._client.request(
            "POST", "prefixes", body=body, cast=Prefix.model_validate, options=options
        )
        return result

    @takes(CallOptions)
    async def get(self, prefix_id: str, **options: Unpack[CallOptions]) -> Prefix:
        """The live prefix ``prefix_id``. Raises ``NotFoundError`` when unknown or expired."""
        result: Prefix = await self._by_id("GET", Prefix.model_validate, prefix_id, options)
        return result

    @takes(CallOptions)
    async def delete(self, prefix_id: str, **options: Unpack[CallOptions]) -> PrefixDeleted:
        """Unpin and forget ``prefix_id``. Raises ``NotFoundError`` when unknown or expired."""
        result: PrefixDeleted = await self._by_id(
            "DELETE", PrefixDeleted.model_validate, prefix_id, options
        )
        return result

    async def _by_id(
        self, method: str, cast: Callable[[Any], Any], prefix_id: str, params: CallOptions
    ) -> Any:
        """``method`` on ``/v1/prefixes/{prefix_id}`` (checked, path-escaped), answer ``cast``."""
        require_str("prefix_id", prefix_id)
        _, options = split_call(params)
        return await self._client.request(
            method, f"prefixes/{path_part(prefix_id)}", cast=cast, options=options
        )

    def session(
        self,
        system_prompt: str | Sequence[Mapping[str, Any]],
        *,
        model: str,
        ttl_seconds: float = 600.0,
    ) -> PrefixSession:
        """A ``PrefixSession`` for ``system_prompt`` (a str, or the leading messages)."""
        return PrefixSession(
            AsyncChatCompletions(self._client),
            self,
            system_prompt,
            model=model,
            ttl_seconds=ttl_seconds,
        )


class PrefixSession:
    """Chat on top of a registered prefix; sends only the new turns with ``prefix_id``.

    Use as ``async with client.prefixes.session(system, model=m) as s: await s.create("hi")``
    (leaving the block deletes the prefix). Registration happens once, on first use, shared by
    concurrent callers. State: ``prefix`` (the live ``Prefix`` or None) and ``supported``
    (None until known; False: the server lacks the prefix API, full messages are sent).

    Args:
        completions: the client's ``chat.completions`` (what sends the turns).
        prefixes: the client's ``prefixes`` (what registers and deletes the prefix).
        system_prompt: the shared leading text (sent as one system message) or messages.
        model: served model name.
        ttl_seconds: lifetime asked for the prefix (seconds); it is re-registered when its
            ``expires_at`` is near (``refresh_margin_s``) or the server answers 404 for it.
        clock: ``() -> Unix seconds`` (injectable for tests).

    Raises:
        TypeError / ValueError: malformed arguments.
    """

    retry_after_full_s = 60.0  # how long to send full messages after "prefix space full"

    def __init__(
        self,
        completions: AsyncChatCompletions,
        prefixes: AsyncPrefixes,
        system_prompt: str | Sequence[Mapping[str, Any]],
        *,
        model: str,
        ttl_seconds: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        require_str("model", model)
        if not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds!r}")
        if isinstance(system_prompt, str):
            self.prefix_messages = [{"role": "system", "content": system_prompt}]
        else:
            self.prefix_messages = validate_messages(system_prompt)
        self._completions = completions
        self._prefixes = prefixes
        self.model = model
        self.ttl_seconds = ttl_seconds
        self.refresh_margin_s = min(30.0, ttl_seconds / 10)
        self._clock = clock
        self.prefix: Prefix | None = None
        self.supported: bool | None = None
        self._full_until = 0.0
        self._lock: anyio.Lock | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def create(
        self, user: str | Sequence[Mapping[str, Any]], **params: Any
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``chat.completions.create`` for the new turn(s) after the prefix.

        Args:
            user: the user text (one user message) or the messages that follow the prefix.
            params: any other ``chat.completions.create`` keyword (``stream``, ``max_tokens``,
                ``extra_body``, ...), except ``model`` / ``messages`` / ``prefix_id``.
        """
        turn = validate_messages(
            [{"role": "user", "content": user}] if isinstance(user, str) else user
        )
        for key in ("model", "messages", "prefix_id"):
            if key in params:
                raise TypeError(f"PrefixSession.create() sets {key!r} itself")
        prefix = await self._ensure()
        if prefix is None:
            return await self._send(self.prefix_messages + turn, None, params)
        try:
            return await self._send(turn, prefix.id, params)
        except NotFoundError as exc:
            if exc.param != "prefix_id" and exc.code != "prefix_not_found":
                raise
        # The prefix expired or was dropped on the server: register again, once.
        self._invalidate(prefix)
        prefix = await self._ensure()
        if prefix is None:
            return await self._send(self.prefix_messages + turn, None, params)
        return await self._send(turn, prefix.id, params)

    async def _send(
        self, messages: Sequence[Mapping[str, Any]], prefix_id: str | None, params: dict[str, Any]
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        result: ChatCompletion | AsyncStream[ChatCompletionChunk] = await self._completions.create(
            model=self.model, messages=messages, prefix_id=prefix_id, **params
        )
        return result

    async def batch(
        self,
        users: Sequence[str | Sequence[Mapping[str, Any]]],
        *,
        progress: bool = False,
        **params: Any,
    ) -> list[ChatCompletion | Exception]:
        """``create(user, **params)`` for each user turn, in input order, errors per item."""
        reject_stream(params)
        return await run_batch(
            self._non_stream_create,
            [dict(user=u, **params) for u in users],
            workers=self._prefixes._client.max_concurrency,
            progress=progress,
            desc="prefix session",
        )

    async def _non_stream_create(
        self, user: str | Sequence[Mapping[str, Any]], **params: Any
    ) -> ChatCompletion:
        return await self.create(user, **params)  # type: ignore[return-value]

    async def close(self) -> None:
        """Delete the registered prefix (a prefix already gone is fine)."""
        prefix, self.prefix = self.prefix, None
        if prefix is not None:
            try:
                await self._prefixes.delete(prefix.id)
            except NotFoundError:
                pass

    def _invalidate(self, prefix: Prefix) -> None:
        if self.prefix is not None and self.prefix.id == prefix.id:
            self.prefix = None

    def _fresh(self, prefix: Prefix | None) -> bool:
        if prefix is None:
            return False
        exp = prefix.expires_at
        return exp is None or self._clock() < exp - self.refresh_margin_s

    def _send_full(self) -> bool:
        """True while full messages are sent: no prefix API, or its space was full."""
        return self.supported is False or self._clock() < self._full_until

    async def _ensure(self) -> Prefix | None:
        """The live prefix, registering it if needed; None: send full messages."""
        if self._send_full():
            return None
        if self._fresh(self.prefix):
            return self.prefix
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._fresh(self.prefix):
                return self.prefix
            if self._send_full():  # decided by a caller that held the lock before
                return None
            try:
                self.prefix = await self._prefixes.create(
                    model=self.model, messages=self.prefix_messages, ttl_seconds=self.ttl_seconds
                )
            except RateLimitError as exc:
                if exc.code != "prefix_limit_exceeded":
                    raise
                self._full_until = self._clock() + self.retry_after_full_s
                return None
            except APIStatusError as exc:
                if exc.status_code not in _UNSUPPORTED_STATUSES or exc.code == "model_not_found":
                    raise
                self.supported = False
                return None
            self.supported = True
            return self.prefix
