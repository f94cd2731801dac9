"""Gemini's route table (``/v1beta``, and its model methods under ``/v1`` too: google-genai's
default API version) and what both modes' handlers share: the method names,
the ``cachedContents/`` name prefix and default life, a stream's keep-alive, the model object, the 405 of a GET of a
method, RFC 3339 times, the 404 / 405 of any other path (local mode: ``local/gemini.py``;
proxy mode: ``proxy/gemini_relay.py``)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web
from prefixgate.gateway.http.errors import GEMINI, APIError, bad_request, error_dialect, route_miss

T = TypeVar("T")

CACHE_PREFIX = "cachedContents/"
DEFAULT_CACHE_TTL_S = 3600.0  # Gemini's default cache life (1 hour)
GENERATION_METHODS = [
    "generateContent",
    "streamGenerateContent",
    "countTokens",
    "createCachedContent",
]
MODEL_METHODS = ("generateContent", "streamGenerateContent", "countTokens")  # served by POST
# what a Gemini stream sends while it waits (both modes): an empty line, not SSE's ``:``
# comment, which google-genai reads as a JSON chunk
KEEPALIVE = b"\n"


def model_object(name: str, description: str, max_model_len: int | None = None) -> dict[str, Any]:
    """Gemini's ``Model`` of the served model ``name`` (token limits when ``max_model_len`` is
    known)."""
    out: dict[str, Any] = {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "1",
        "displayName": name,
        "description": description,
        "supportedGenerationMethods": GENERATION_METHODS,
    }
    if max_model_len is not None:
        out["inputTokenLimit"] = max_model_len
        out["outputTokenLimit"] = max_model_len
    return out


PAGE_SIZE_DEFAULT = 50  # Google's models.list default ("If unspecified, 50 models")
PAGE_SIZE_MAX = 1000  # larger values are coerced to 1000, as Google does
_PAGE_NUMBER = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit takes '²')


def list_page(items: list[T], query: Mapping[str, str]) -> tuple[list[T], dict[str, str]]:
    """One page of a Gemini list (``models``, ``cachedContents``), as Google pages them:
    ``pageSize`` items (unset or 0: ``PAGE_SIZE_DEFAULT``; above ``PAGE_SIZE_MAX``: that many)
    from ``pageToken`` (the ``nextPageToken`` of an earlier page: an index); the page and
    ``{"nextPageToken": ...}`` when more follow, else ``{}``.

    Raises:
        APIError: 400 naming ``pageSize`` when it is not a whole number, or ``pageToken``
            when it is not one this list gave.
    """
    size_text, token = query.get("pageSize") or "0", query.get("pageToken") or "0"
    if _PAGE_NUMBER.fullmatch(size_text) is None:
        raise bad_request(
            f"pageSize: a whole number (at most {PAGE_SIZE_MAX} are returned), "
            f"got {size_text[:40]!r}",
            "pageSize",
        )
    if _PAGE_NUMBER.fullmatch(token) is None or int(token) > len(items):
        raise bad_request(
            f"pageToken: not one this list gave ({token[:40]!r}; it may have changed)", "pageToken"
        )
    start, size = int(token), min(int(size_text) or PAGE_SIZE_DEFAULT, PAGE_SIZE_MAX)
    more = {"nextPageToken": str(start + size)} if start + size < len(items) else {}
    return items[start : start + size], more


def split_model_method(request: web.Request) -> tuple[str, str]:
    """``{model}:{method}`` of a model route's path → ``(model, method)``, the method one of
    ``MODEL_METHODS``; both modes split and refuse it here, in the same words. The method is
    what follows the last colon (a model's name may hold colons: Ollama's ``llama:latest``).

    Raises:
        APIError: 404 ``not_found`` for a path without a method or with another method.
    """
    target = request.match_info["target"]
    model, sep, method = target.rpartition(":")
    if not sep:
        raise APIError(
            404,
            f"unknown route: models/{target[:80]} needs a method (:generateContent)",
            code="not_found",
        )
    if method not in MODEL_METHODS:
        raise APIError(
            404,
            f"method {method[:60]!r} is not served on models/{model[:80]} "
            f"({', '.join(MODEL_METHODS)})",
            code="not_found",
        )
    return model, method


def cache_miss(exc: APIError, param: str) -> APIError:
    """The prefix API's refusal of a cache (404: unknown, expired, revoked or another key's)
    in Gemini's words, the same in both modes: "cached content" for "prefix", naming
    ``param`` — ``name`` on the ``cachedContents/{id}`` routes (get, patch, delete: the path
    names the resource), ``cachedContent`` for a ``generateContent`` body's field."""
    return APIError(
        exc.status,
        exc.message.replace("prefix", "cached content", 1),
        param=param,
        code=exc.code,
    )


def require_sse_alt(request: web.Request) -> None:
    """``streamGenerateContent`` is served as server-sent events only (``?alt=sse``), in both
    modes.

    Raises:
        APIError: 400 naming ``alt`` and what came.
    """
    alt = request.query.get("alt")
    if alt != "sse":
        got = "no alt" if alt is None else f"alt={alt[:20]!r}"
        raise bad_request(
            f"alt: streamGenerateContent is served as server-sent events only (?alt=sse), "
            f"got {got}",
            param="alt",
        )


def refuse_get_of_method(request: web.Request) -> None:
    """A GET of ``models/{model}:generateContent`` (a method, served by POST) is a 405 with
    ``Allow: POST``, not a 404 for a model of that name. The method is what follows the
    target's last colon, as the POST handlers split it: a model's name may hold colons
    (Ollama's ``llama:latest``).

    Raises:
        APIError: 405 ``method_not_allowed``.
    """
    _, _, method = request.match_info["target"].rpartition(":")
    if method in GENERATION_METHODS:
        exc = APIError(
            405,
            f"method GET is not allowed on {request.path[:120]}; allowed: POST",
            code="method_not_allowed",
        )
        exc.headers = {"Allow": "POST"}
        raise exc


def rfc3339(unix_s: float) -> str:
    """Unix seconds as RFC 3339 UTC (``inf``: the far future)."""
    if unix_s == float("inf"):
        return "9999-12-31T23:59:59Z"
    at = dt.datetime.fromtimestamp(unix_s, dt.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


GOOGLE_KEY_HEADER = "x-goog-api-key"  # what Google's clients send their key in


@error_dialect(GEMINI)
async def no_route(request: web.Request) -> web.Response:
    """Any other /v1beta path or method: 404 / 405 in Gemini's shape."""
    raise await route_miss(request)


# ``POST /v1/models/{model}:{method}``: Gemini's stable ``v1`` API, google-genai's default
# (``HttpOptions.api_version``). Only a path with a ``:method`` is Gemini's: ``/v1/models/{id}``
# itself stays the OpenAI route. A model's name may hold slashes (a hub id, ``org/name``, the
# default served name), which google-genai sends unquoted: ``{target}`` takes them.
V1_MODEL_METHOD = "/v1/models/{target:.+:[A-Za-z]+}"
MODEL_TARGET = "/v1beta/models/{target:.+}"


def add_gemini_routes(app: web.Application, handlers: Any, expect_handler: Any) -> None:
    """Gemini's routes on ``app``, each to the function of that name in ``handlers`` (this
    module in local mode, ``proxy.gemini_relay`` in proxy mode): one table for both modes.
    The model methods are served under ``/v1`` as under ``/v1beta`` (``V1_MODEL_METHOD``)."""
    r = app.router
    h = handlers
    r.add_post(V1_MODEL_METHOD, h.model_method, expect_handler=expect_handler)
    r.add_get("/v1beta/models", h.list_models, expect_handler=expect_handler)
    r.add_get(MODEL_TARGET, h.get_model, expect_handler=expect_handler)
    r.add_post(MODEL_TARGET, h.model_method, expect_handler=expect_handler)
    r.add_post("/v1beta/cachedContents", h.create_cache, expect_handler=expect_handler)
    r.add_get("/v1beta/cachedContents", h.list_caches, expect_handler=expect_handler)
    r.add_get("/v1beta/cachedContents/{cache_id}", h.get_cache, expect_handler=expect_handler)
    r.add_patch("/v1beta/cachedContents/{cache_id}", h.update_cache, expect_handler=expect_handler)
    r.add_delete("/v1beta/cachedContents/{cache_id}", h.delete_cache, expect_handler=expect_handler)
    r.add_route("*", "/v1beta/{tail:.*}", h.no_route, expect_handler=expect_handler)
