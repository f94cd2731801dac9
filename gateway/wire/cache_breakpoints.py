"""Cache breakpoints of the OpenAI dialects, as the wire states them (what both modes read).

A breakpoint is a place in the conversation a client marked as the end of a reusable prefix:
Anthropic's ``cache_control`` (system blocks, tools, message blocks, the top-level one; read
by ``anthropic_models``), OpenAI's ``prompt_cache_breakpoint`` on a content part, and the
implicit breakpoint at the end of the messages (Anthropic's top-level ``cache_control``,
OpenAI's ``prompt_cache_options`` in ``implicit`` mode or ``prompt_cache_retention: "24h"``).
Each is a ``Breakpoint``: the conversation cut right after the marked block. Where each falls
in the prompt, the usage and the pins: ``local/cache_marks.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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
