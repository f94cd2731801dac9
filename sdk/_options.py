"""Per-call request options and the interface resources call the client through.

``RequestOptions`` lives here (not in ``_client``) so the resources depend only on this module
and ``_client`` imports the resources: no import cycle. ``Requester`` is the part of
``AsyncClient`` a resource uses (send one API call; the concurrency bound for batches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, TypeVar

import httpx

__all__ = [
    "OPTION_NAMES",
    "BodyCallOptions",
    "CallOptions",
    "RequestOptions",
    "Requester",
    "StreamCallOptions",
    "Timeout",
    "make_options",
    "split_call",
]

T = TypeVar("T")

Timeout = float | httpx.Timeout
"""Seconds (one number for every phase) or an ``httpx.Timeout``."""


@dataclass(slots=True)
class RequestOptions:
    """Per-call overrides (the ``extra_*`` keywords of every resource method).

    Args:
        extra_headers: headers added to (or overriding) the client's.
        extra_query: query parameters.
        extra_body: fields merged into the JSON body, for server-specific fields the method
            does not name (e.g. vLLM's ``structured_outputs``), openai-python's convention.
        timeout: seconds or ``httpx.Timeout`` for this call.
        max_retries: retries for this call.
        idle_timeout: stream only: seconds allowed between two chunks.
    """

    extra_headers: Mapping[str, str] | None = None
    extra_query: Mapping[str, Any] | None = None
    extra_body: Mapping[str, Any] | None = None
    timeout: Timeout | None = None
    max_retries: int | None = None
    idle_timeout: float | None = None


OPTION_NAMES = (
    "extra_headers",
    "extra_query",
    "extra_body",
    "timeout",
    "max_retries",
    "idle_timeout",
)
"""The keywords of a method that are ``RequestOptions`` (not body fields), in signature order."""


class CallOptions(TypedDict, total=False):
    """The option keywords of every method (``RequestOptions`` says what each does)."""

    extra_headers: Mapping[str, str] | None
    extra_query: Mapping[str, Any] | None
    timeout: Timeout | None
    max_retries: int | None


class BodyCallOptions(CallOptions, total=False):
    """The options of a method that sends a JSON body."""

    extra_body: Mapping[str, Any] | None


class StreamCallOptions(BodyCallOptions, total=False):
    """The options of a method that may stream."""

    idle_timeout: float | None


def split_call(params: Mapping[str, Any]) -> tuple[dict[str, Any], RequestOptions]:
    """A method's keywords (``**params``) as the JSON body (every field not left None:
    omitted, the server's default) and the checked ``RequestOptions`` (``OPTION_NAMES``).

    Raises:
        TypeError / ValueError: as ``make_options``.
    """
    options = make_options(**{k: v for k, v in params.items() if k in OPTION_NAMES})
    body = {k: v for k, v in params.items() if k not in OPTION_NAMES and v is not None}
    return body, options


def make_options(
    *,
    extra_headers: Mapping[str, str] | None = None,
    extra_query: Mapping[str, Any] | None = None,
    extra_body: Mapping[str, Any] | None = None,
    timeout: Timeout | None = None,
    max_retries: int | None = None,
    idle_timeout: float | None = None,
) -> RequestOptions:
    """``RequestOptions`` from a method's option keywords, checked before anything is sent.

    Raises:
        TypeError: a ``timeout`` that is neither seconds nor ``httpx.Timeout``, an
            ``extra_*`` that is not a mapping, a ``max_retries`` that is not an int.
        ValueError: a negative ``timeout`` / ``idle_timeout`` / ``max_retries``.
    """
    for name, value in (
        ("extra_headers", extra_headers),
        ("extra_query", extra_query),
        ("extra_body", extra_body),
    ):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a mapping, got {type(value).__name__}")
    if timeout is not None and not isinstance(timeout, httpx.Timeout):
        check_seconds("timeout", timeout)
    check_seconds("idle_timeout", idle_timeout)
    if max_retries is not None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            raise TypeError(f"max_retries must be an int, got {max_retries!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
    return RequestOptions(
        extra_headers, extra_query, extra_body, timeout, max_retries, idle_timeout
    )


def check_seconds(name: str, value: Any) -> None:
    """A duration: None, or a number >= 0 (seconds).

    Raises:
        TypeError: not a number.
        ValueError: negative or NaN.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be seconds (a number), got {value!r}")
    if not value >= 0:  # also NaN
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")


class Requester(Protocol):
    """What a resource needs from its client (``AsyncClient`` implements it)."""

    @property
    def max_concurrency(self) -> int:
        """The client's bound on requests in flight (batches run that many workers)."""
        ...

    async def request(
        self,
        method: str,
        path: str,
        *,
        cast: Callable[[Any], T],
        body: Mapping[str, Any] | None = None,
        stream: bool = False,
        options: RequestOptions | None = None,
        end_events: frozenset[str] | None = None,
    ) -> Any:
        """Send one API call (see ``AsyncClient.request``)."""
        ...
