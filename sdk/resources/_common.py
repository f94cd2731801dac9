"""Helpers shared by the resources: request options and body assembly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from .._client import RequestOptions

__all__ = ["split_options", "only_options", "clean_body", "require_str", "path_part"]

_OPTION_NAMES = frozenset(RequestOptions.__slots__)


def split_options(params: dict[str, Any]) -> tuple[dict[str, Any], RequestOptions]:
    """Pop the ``RequestOptions`` keywords (``extra_headers``, ``timeout``, ...) from ``params``."""
    opts = {k: params.pop(k) for k in list(params) if k in _OPTION_NAMES}
    timeout = opts.get("timeout")
    if timeout is not None and not isinstance(timeout, (int, float, httpx.Timeout)):
        raise TypeError(f"timeout must be seconds or httpx.Timeout, got {timeout!r}")
    return params, RequestOptions(**opts)


def clean_body(params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body: every parameter except those left ``None`` (omitted, server default)."""
    return {k: v for k, v in params.items() if v is not None}


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


def only_options(options: Mapping[str, Any]) -> RequestOptions:
    """``RequestOptions`` from keywords that must all be option names.

    Raises:
        TypeError: another keyword.
    """
    rest, opts = split_options(dict(options))
    if rest:
        raise TypeError(f"unexpected keyword arguments: {sorted(rest)}")
    return opts
