"""Cache breakpoints of every dialect: where each falls in the prompt, what the usage says,
the diagnostics header, and the pins they become.

A breakpoint is a place in the conversation a client marked as the end of a reusable prefix:
Anthropic's ``cache_control`` (system blocks, tools, message blocks, the top-level one),
OpenAI's ``prompt_cache_breakpoint`` on a content part, and the implicit breakpoint at the
end of the messages (Anthropic's top-level ``cache_control``, OpenAI's
``prompt_cache_options`` in ``implicit`` mode or ``prompt_cache_retention: "24h"``). Each is a
``Breakpoint``: the conversation cut right after the marked block. Its position in the prompt
(``Mark.tokens``) is what the prompt's tokens share with that cut's rendering (no generation
prompt), in whole KV blocks: always safe (a template that re-renders earlier text when more
follows just moves the mark back), 0 when below one block.

Usage: ``written`` (Anthropic ``cache_creation_input_tokens``, OpenAI
``prompt_tokens_details.cache_write_tokens``) = the marked tokens past the ones read from the
prefix cache; read (``cache_read_input_tokens`` / ``cached_tokens``) = the engine's cached
tokens; the uncached input the rest: read + written + input == prompt, exactly.

After the answer, ``pin_marks`` hands the marks to ``local.cache_pins.CachePins`` (one pin
per mark under the request's salt, charged to the key's pin share). The ``x-prefixgate-cache``
header (``cache_header``) tells the client what happened: ``read=<tokens>`` (whole bodies),
then per breakpoint ``<field>=<tokens>:<state>`` with state ``hit`` (read covers it),
``written`` (computed by this request, pinned after it), ``expired`` (it was pinned before
and is not anymore: TTL passed or evicted, then written again) or ``below_one_block``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prefixgate.engine.protocol import TokenizerLike
from prefixgate.gateway.local.cache_pins import CachePins, pin_key
from prefixgate.gateway.local.prefix_routes import prefix_quota
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import Principal

CACHE_HEADER = "x-prefixgate-cache"


@dataclass(slots=True)
class Breakpoint:
    """One marked place.

    Attributes:
        where: the marked field (``system.0``, ``tools.2``, ``messages.3.content.1``,
            ``cache_control`` / ``prompt_cache_options`` for the implicit one).
        ttl_s: its TTL in seconds.
        messages: the template messages up to and including the marked block (the block's
            own message cut right after it); ``tools``: the tools the cut renders with.
    """

    where: str
    ttl_s: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass(slots=True)
class Mark:
    """Where one breakpoint fell: ``tokens`` of the prompt it covers in whole KV blocks
    (0: below one block, or nothing shared with the cut rendering), its TTL in seconds, the
    field that set it and, once known, ``state`` for the header."""

    where: str
    tokens: int
    ttl_s: float
    state: str = ""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


async def find_marks(
    tokenizer: TokenizerLike,
    breakpoints: list[Breakpoint],
    with_tools: bool,
    ids: list[int],
    block_size: int,
) -> list[Mark]:
    """Each breakpoint's ``Mark`` in the prompt ``ids`` (rendered in a worker thread;
    ``with_tools``: the prompt was rendered with tools, so the cuts are too). A cut the
    template refuses (a tools breakpoint with no message, on some templates) marks 0."""
    if not breakpoints:
        return []

    def marks() -> list[Mark]:
        out = []
        for bp in breakpoints:
            kwargs: dict[str, Any] = {"tools": bp.tools} if with_tools and bp.tools else {}
            try:
                cut = tokenizer.encode_chat(bp.messages, add_generation_prompt=False, **kwargs)
            except Exception:  # noqa: BLE001 - the template refuses the cut: no cacheable prefix
                shared = 0
            else:
                shared = _common_prefix(ids, list(cut))
            out.append(Mark(bp.where, shared // block_size * block_size, bp.ttl_s))
        return out

    return await asyncio.to_thread(marks)


def written_tokens(cached: int, marks: Sequence[Mark]) -> dict[float, int]:
    """Tokens written at the breakpoints past the ``cached`` ones, by the TTL (seconds) of
    the breakpoint each falls under (the nearest mark at or after it)."""
    by_ttl: dict[float, int] = {}
    done = cached
    for m in sorted(marks, key=lambda m: m.tokens):
        seg = max(0, m.tokens - done)
        if seg:
            by_ttl[m.ttl_s] = by_ttl.get(m.ttl_s, 0) + seg
            done += seg
    return by_ttl


def note_states(
    marks: list[Mark], cached: int, pins: CachePins, salt: str | None, ids: list[int]
) -> None:
    """Fill each mark's ``state`` (module docstring) from what was read and the pins' past."""
    for m in marks:
        if not m.tokens:
            m.state = "below_one_block"
        elif cached >= m.tokens:
            m.state = "hit"
        elif pin_key(salt, ids[: m.tokens]) in pins.outcomes:
            m.state = "expired"
        else:
            m.state = "written"


def cache_header(marks: list[Mark], cached: int | None = None) -> str:
    """The ``x-prefixgate-cache`` value: ``read=<tokens>`` when known, then each mark as
    ``<field>=<tokens>:<state>`` (``<field>=<tokens>`` before its state is known); e.g.
    ``read=64; system.0=64:hit``."""
    parts = [] if cached is None else [f"read={cached}"]
    for m in marks:
        parts.append(f"{m.where}={m.tokens}" + (f":{m.state}" if m.state else ""))
    return "; ".join(parts)


def pin_marks(
    request: web.Request,
    principal: Principal,
    salt: str | None,
    ids: list[int],
    marks: list[Mark],
) -> None:
    """Pin the marks of an answered request in the background, charged to the key's pin
    share (``prefix_routes.prefix_quota``), each TTL capped at ``max_prefix_ttl_s``."""
    settings = request.app[STATE].settings
    longest = settings.max_prefix_ttl_s  # a breakpoint's TTL is capped like a prefix's
    runs = [(ids[: m.tokens], min(m.ttl_s, longest)) for m in marks if m.tokens]
    if not runs:
        return
    local = request.app[LOCAL]
    engine = local.require_engine()
    quota = prefix_quota(principal.spec, settings, engine.stats().get("kv_blocks_total", 0))
    local.require_cache_pins().pin_soon(
        runs, salt, principal.id, quota.max_pinned_blocks if quota else 0
    )


_OPENAI_TTL = {"30m": 1800.0, "12h": 43_200.0}
_ANTHROPIC_TTL = {"5m": 300.0, "1h": 3600.0}
MAX_EXPLICIT = 4  # breakpoints one request may write (OpenAI's and Anthropic's limit)


def chat_breakpoints(
    req: Any, messages: list[dict[str, Any]], offset: int, tools: list[dict[str, Any]]
) -> list[Breakpoint]:
    """The breakpoints of a chat completion (``openai_breakpoints`` of its ``messages``).

    Raises:
        APIError: 400 naming the fifth explicit breakpoint.
    """
    return openai_breakpoints(
        req.messages,
        req.prompt_cache_options,
        req.prompt_cache_retention,
        messages,
        offset,
        tools,
    )


def openai_breakpoints(
    items: Sequence[Any],
    options: Any,
    retention: str | None,
    messages: list[dict[str, Any]],
    offset: int,
    tools: list[dict[str, Any]],
    field: str = "messages",
) -> list[Breakpoint]:
    """The breakpoints of an OpenAI request (chat completions, or the Responses API with
    ``field="input"``): each text part's ``prompt_cache_breakpoint`` or ``cache_control``,
    and the implicit one at the end of the messages (``options`` = ``prompt_cache_options``
    in mode ``implicit``: its ``ttl``, 30 min by default; ``retention`` =
    ``prompt_cache_retention`` ``"24h"``: 24 h). ``items`` are the request's messages (or
    input items: ``.content`` a string or parts with ``.text``, ``.prompt_cache_breakpoint``,
    ``.cache_control``); ``messages`` the template messages, ``items[i]`` being
    ``messages[offset + i]`` (a ``prefix_id``'s messages or the ``instructions`` come first).

    Raises:
        APIError: 400 naming the fifth explicit breakpoint, or a breakpoint set on a message
            rather than on one of its parts.
    """
    from prefixgate.gateway.http.errors import bad_request

    default_ttl = _OPENAI_TTL[options.ttl if options is not None and options.ttl else "30m"]
    out: list[Breakpoint] = []
    for i, m in enumerate(items):
        for name in ("prompt_cache_breakpoint", "cache_control"):
            if getattr(m, name, None) is not None:
                raise bad_request(
                    f"{field}.{i}.{name}: a cache breakpoint goes on a text part of the "
                    f"content ({field}.{i}.content.<j>.{name}), not on the message",
                    param=f"{field}.{i}.{name}",
                )
        if not isinstance(m.content, list):
            continue
        text = ""
        for j, part in enumerate(m.content):
            text += part.text
            where = f"{field}.{i}.content.{j}"
            if part.prompt_cache_breakpoint is not None and part.cache_control is not None:
                raise bad_request(
                    f"{where}: prompt_cache_breakpoint and cache_control are two spellings of "
                    "one breakpoint; send one",
                    param=f"{where}.cache_control",
                )
            if part.prompt_cache_breakpoint is not None:
                ttl = part.prompt_cache_breakpoint.ttl
                seconds = _OPENAI_TTL[ttl] if ttl else default_ttl
                where += ".prompt_cache_breakpoint"
            elif part.cache_control is not None:
                seconds = _ANTHROPIC_TTL[part.cache_control.ttl or "5m"]
                where += ".cache_control"
            else:
                continue
            own = {k: v for k, v in messages[offset + i].items() if k != "tool_calls"}
            cut = [*messages[: offset + i], {**own, "content": text}]
            out.append(Breakpoint(where, seconds, cut, tools))
    if len(out) > MAX_EXPLICIT:
        where = out[MAX_EXPLICIT].where
        raise bad_request(
            f"{where}: at most {MAX_EXPLICIT} cache breakpoints per request, got {len(out)}",
            param=where,
        )
    implicit = []
    if options is not None and options.mode == "implicit":
        implicit.append(("prompt_cache_options", default_ttl))
    if retention == "24h":
        implicit.append(("prompt_cache_retention", 86_400.0))
    if implicit:
        where, seconds = max(implicit, key=lambda w: w[1])
        out.append(Breakpoint(where, seconds, list(messages), tools))
    return out
