"""Cache breakpoints of every dialect: where each falls in the prompt, what the usage says,
the diagnostics header, and the pins they become.

A breakpoint is a place in the conversation a client marked as the end of a reusable prefix:
Anthropic's ``cache_control`` (system blocks, tools, message blocks, the top-level one),
OpenAI's ``prompt_cache_breakpoint`` on a content part, and the implicit breakpoint at the
end of the messages (Anthropic's top-level ``cache_control``, OpenAI's
``prompt_cache_options`` in ``implicit`` mode or ``prompt_cache_retention: "24h"``). Each is a
``Breakpoint`` (``wire/cache_breakpoints.py``): the conversation cut right after the marked
block. Its position in the prompt (``Mark.tokens``) is what the prompt's tokens share with that cut's rendering (no generation
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
from prefixgate.gateway.wire.cache_breakpoints import Breakpoint

CACHE_HEADER = "x-prefixgate-cache"


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
    template_kwargs: dict[str, Any] | None = None,
) -> list[Mark]:
    """Each breakpoint's ``Mark`` in the prompt ``ids`` (rendered in a worker thread;
    ``with_tools``: the prompt was rendered with tools, so the cuts are too;
    ``template_kwargs``: the request's ``chat_template_kwargs``, the prompt's variables). A
    cut the template refuses (a tools breakpoint with no message, on some templates) marks 0."""
    if not breakpoints:
        return []

    def marks() -> list[Mark]:
        out = []
        for bp in breakpoints:
            kwargs: dict[str, Any] = dict(template_kwargs or {})
            if with_tools and bp.tools:
                kwargs["tools"] = bp.tools
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
