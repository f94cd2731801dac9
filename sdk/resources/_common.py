"""Helpers shared by the resources: body assembly and argument checks."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar, TypedDict, TypeVar
from urllib.parse import quote

from .._options import OPTION_NAMES, Requester
from .._response import ResponseMethods, to_raw_response_wrapper, to_streamed_response_wrapper
from ..batch import run_batch

__all__ = ["APIResource", "GenerationParams", "reject_stream", "require_str", "path_part", "takes"]

F = TypeVar("F", bound=Callable[..., Any])


class APIResource:
    """A resource of a client (``client.models``, ...): sends its calls through ``Requester``.

    ``raw_methods`` / ``streamed_methods``: the methods a subclass offers under
    ``with_raw_response`` / ``with_streaming_response`` (its blocking twin reads them too).
    """

    raw_methods: ClassVar[tuple[str, ...]] = ()
    streamed_methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, client: Requester) -> None:
        self._client = client

    @cached_property
    def with_raw_response(self) -> ResponseMethods:
        """The same methods, returning an ``APIResponse`` (headers, status, ``parse()``)."""
        return ResponseMethods(self, self.raw_methods, to_raw_response_wrapper)

    @cached_property
    def with_streaming_response(self) -> ResponseMethods:
        """The same methods as ``async with`` blocks yielding an ``AsyncAPIResponse`` whose
        body is read on demand."""
        return ResponseMethods(self, self.streamed_methods, to_streamed_response_wrapper)

    async def _batch(
        self,
        create: Callable[..., Awaitable[Any]],
        requests: Sequence[Mapping[str, Any]],
        progress: bool,
        desc: str,
    ) -> list[Any]:
        """``create(**request)`` for each request under the client's concurrency limit
        (``run_batch``: results in input order, an exception in the slot of a request that
        raised; one that asks to stream raises ``ValueError``)."""

        async def one(**request: Any) -> Any:
            reject_stream(request)
            return await create(**request)

        return await run_batch(
            one, requests, workers=self._client.max_concurrency, progress=progress, desc=desc
        )


class GenerationParams(TypedDict, total=False):
    """The generation keywords chat and text completions share: OpenAI's, then vLLM's sampling
    extensions (``top_k`` to ``stop_token_ids``) and ``cache_salt``; their meaning:
    ``AsyncChatCompletions.create``."""

    frequency_penalty: float | None
    logit_bias: Mapping[str, float] | Mapping[int, float] | None
    max_tokens: int | None
    n: int | None
    presence_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stream_options: Mapping[str, Any] | None
    temperature: float | None
    top_p: float | None
    user: str | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    min_tokens: int | None
    ignore_eos: bool | None
    stop_token_ids: Sequence[int] | None
    cache_salt: str | None


def takes(params: Any) -> Callable[[F], F]:
    """The decorated method's ``**params`` are the keys of the TypedDict ``params`` (each
    endpoint's parameters, stated once, shared by the async method and its blocking twin).

    The type checker reads them from the method's ``**params: Unpack[...]``; at run time they
    become keyword-only parameters of its signature (``inspect.signature``, ``help``: the
    required keys first without default, then the method's own keyword-only ones, then the
    others defaulting to None, the ``OPTION_NAMES`` last), and a call with an unknown or
    missing keyword raises ``TypeError`` naming it before anything runs (nothing is sent), as
    a spelled-out signature would.
    """
    hints = typing.get_type_hints(params)
    required = params.__required_keys__
    fields = [name for name in hints if name not in OPTION_NAMES]
    options = [name for name in OPTION_NAMES if name in hints]

    def keyword(name: str, default: Any) -> inspect.Parameter:
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[name]
        )

    def decorate(fn: F) -> F:
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        signature = inspect.Signature(
            [p for p in own if p.kind is not p.KEYWORD_ONLY]
            + [keyword(name, inspect.Parameter.empty) for name in fields if name in required]
            + [p for p in own if p.kind is p.KEYWORD_ONLY]
            + [keyword(name, None) for name in fields if name not in required]
            + [keyword(name, None) for name in options],
            return_annotation=inspect.signature(fn).return_annotation,
        )

        allowed = frozenset(hints) | {p.name for p in own}
        must = [name for name in fields if name in required]
        where = f"{fn.__qualname__}()"

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if not allowed.issuperset(kwargs):
                unknown = next(name for name in kwargs if name not in allowed)
                raise TypeError(f"{where} got an unexpected keyword argument {unknown!r}")
            for name in must:
                if name not in kwargs:
                    raise TypeError(f"{where} missing a required keyword argument: {name!r}")
            return fn(*args, **kwargs)  # its own parameters are checked by Python

        checked.__signature__ = signature  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


def reject_stream(request: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when a ``batch()`` request asks to stream."""
    if request.get("stream"):
        raise ValueError("batch() requests cannot stream: drop stream=True")


def require_str(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is a non-empty str."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str, got {value!r}")


def path_part(value: str, keep_slashes: bool = False) -> str:
    """``value`` as URL path text that cannot leave its place: percent-encoded (``?``, ``#``,
    ``%`` and, unless ``keep_slashes``, ``/``), "." and ".." segments encoded so the URL
    join cannot climb out of the resource (``prefixes/../models``)."""
    parts = quote(value, safe="/" if keep_slashes else "").split("/")
    return "/".join(p.replace(".", "%2E") if p in (".", "..") else p for p in parts)
