"""Helpers shared by the resources: body assembly and argument checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from .._options import Requester

__all__ = ["APIResource", "call_args", "clean_body", "reject_stream", "require_str", "path_part"]


class APIResource:
    """A resource of a client (``client.models``, ...): sends its calls through ``Requester``."""

    def __init__(self, client: Requester) -> None:
        self._client = client


def clean_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body: every parameter except those left ``None`` (omitted, server default)."""
    return {k: v for k, v in params.items() if v is not None}


def call_args(frame_locals: Mapping[str, Any]) -> dict[str, Any]:
    """A method's arguments by name, from its ``locals()`` taken first thing in its body
    (before any other local is bound), less ``self``.

    Lets a method whose parameters are spelled out (typed, keyword-only: the API) hand them
    all on to its twin with the same names (the blocking resource to the async one, ``parse``
    to ``create``) without restating each one; tests/sdk/test_request_params.py checks the
    twins' signatures match.
    """
    return {k: v for k, v in frame_locals.items() if k != "self"}


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
