"""``GET /v1/models`` and ``GET /v1/models/{model}`` in the client's dialect: the one place that
picks it, for both modes.

A Google client (it sends its key in ``x-goog-api-key``, or as ``?key=`` in Google's REST
examples; ``v1`` is google-genai's default API version) gets Gemini's answer (``{"models":
[...]}``, a ``Model``; errors in Gemini's shape).
An Anthropic client (it sends ``anthropic-version``) gets Anthropic's: the OpenAI cards of the
mode's own handler as Anthropic ``ModelInfo`` objects (``{"type": "model", "id",
"display_name", "created_at"}``, ``created_at`` RFC 3339 from the card's ``created``), the list
as ``{"data", "has_more", "first_id", "last_id"}`` paged by ``limit`` (1 to 1000, default 20),
``after_id`` and ``before_id``; errors in Anthropic's shape. Any other client gets OpenAI's.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from prefixgate.gateway.http.errors import ANTHROPIC, GEMINI, APIError, Handler, bad_request
from prefixgate.gateway.wire.gemini_routes import GOOGLE_KEY_HEADER, rfc3339

ANTHROPIC_VERSION_HEADER = "anthropic-version"  # every Anthropic client sends it
ANTHROPIC_PAGE_LIMIT = (1, 1000, 20)  # Anthropic's ``limit``: least, most, default


def models_route(openai: Handler, gemini: Handler) -> Handler:
    """The handler of ``GET /v1/models`` (or ``/v1/models/{model}``) that answers each client in
    its dialect (module docstring); ``openai`` and ``gemini``: the mode's handlers of the
    route."""

    async def handler(request: web.Request) -> web.StreamResponse:
        dialect = client_dialect(request)
        if dialect == GEMINI:
            if "model" in request.match_info:  # Gemini's handlers read the name as {target}
                request.match_info["target"] = request.match_info["model"]
            try:
                return await gemini(request)
            except APIError as exc:
                return exc.response(GEMINI)
        if dialect == ANTHROPIC:
            try:
                return _as_anthropic(request, await openai(request))
            except APIError as exc:
                return exc.response(ANTHROPIC)
        return await openai(request)

    # the errors given before the handler runs (401 of the key, 503 while the model loads)
    handler.error_dialect = client_dialect  # type: ignore[attr-defined]
    return handler


def client_dialect(request: web.Request) -> str:
    """The dialect of the client asking for the models (module docstring): ``GEMINI``,
    ``ANTHROPIC`` or ``"openai"``."""
    if GOOGLE_KEY_HEADER in request.headers or "key" in request.query:  # ?key=: Google's REST
        return GEMINI
    if ANTHROPIC_VERSION_HEADER in request.headers:
        return ANTHROPIC
    return "openai"


def _as_anthropic(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """The OpenAI answer ``resp`` (a card, or ``{"object": "list", "data": [cards]}``) in
    Anthropic's shape; anything else (an upstream's error, relayed) as it came."""
    if resp.status != 200 or not isinstance(resp, web.Response):
        return resp
    body = resp.body
    if not isinstance(body, bytes | bytearray):
        return resp
    got = json.loads(body)
    if "model" in request.match_info:
        return web.json_response(model_info(got))
    cards = [model_info(card) for card in got.get("data", [])]
    return web.json_response(_page(cards, request.query))


def _created_s(created: Any) -> float:
    """An OpenAI card's ``created`` as Unix seconds for ``created_at``: 0 (the epoch) when it
    is not a number of seconds a date can hold (another upstream's milliseconds, a string,
    1e20), as vLLM's cards always are."""
    if isinstance(created, bool) or not isinstance(created, int | float):
        return 0.0
    return float(created) if 0 <= created < 253402300800 else 0.0  # before year 10000


def model_info(card: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's ``ModelInfo`` of an OpenAI model card (``created``: Unix seconds); the
    card's context length (``max_model_len``, when it has one) as ``max_input_tokens`` (the
    context window); ``max_tokens`` is left out: the most an answer may take depends on its
    prompt."""
    model_id = str(card["id"])
    info: dict[str, Any] = {
        "type": "model",
        "id": model_id,
        "display_name": model_id,
        "created_at": rfc3339(_created_s(card.get("created"))),
    }
    length = card.get("max_model_len")
    if isinstance(length, int):
        info["max_input_tokens"] = length
    return info


def _page(models: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of Anthropic's list: ``limit`` models after ``after_id`` (or the last ``limit``
    before ``before_id``).

    Raises:
        APIError: 400 naming ``limit`` (not an integer in 1..1000), ``after_id`` /
            ``before_id`` (not a listed model, or both given).
    """
    least, most, default = ANTHROPIC_PAGE_LIMIT
    raw = query.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not least <= limit <= most:
        raise bad_request(f"limit: must be an integer from {least} to {most}", param="limit")
    ids = [m["id"] for m in models]
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise bad_request("after_id and before_id: give one of them", param="before_id")
    for name, value in (("after_id", after), ("before_id", before)):
        if value is not None and value not in ids:
            raise bad_request(f"{name}: no model {value!r} is listed", param=name)
    if before is not None:
        end = ids.index(before)
        page = models[max(0, end - limit) : end]
        has_more = end - limit > 0
    else:
        start = ids.index(after) + 1 if after is not None else 0
        page = models[start : start + limit]
        has_more = start + limit < len(models)
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
