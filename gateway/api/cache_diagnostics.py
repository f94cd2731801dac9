"""Anthropic's cache diagnostics: why a request did not read what an earlier one cached.

A Messages request may name an earlier message, ``diagnostics: {"previous_message_id":
"msg_..."}``; its answer then carries ``diagnostics.cache_miss_reason`` in Anthropic's shape
(``anthropic.types.CacheMissReason``), or ``null`` when it read everything the earlier
prompt left in the cache:

- ``previous_message_not_found``: no such message in the recent log, or another tenant's
  (a cache salt never learns of another's prompts);
- ``tools_changed`` / ``system_changed`` / ``messages_changed``: the prompts diverge before
  the end of the earlier one's cached blocks, and the first differing part (in prompt order:
  tools, system, then an earlier turn changed rather than turns appended) says why;
- ``unavailable``: the prompt extends the earlier one, yet fewer tokens were read than it
  had cached (evicted, or its pin lapsed).

``cache_missed_input_tokens`` is how many more tokens would have been read had the prefix
matched: the earlier prompt's whole KV blocks minus what was read. Every Messages request is
logged (``PromptLog``: the last 1024, its salt, token ids and digests of its tools, system
and turns), whether or not it asks for diagnostics, since any message may be named later.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from typing import Any

import cachetools
from aiohttp import web


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(slots=True)
class LoggedPrompt:
    """One logged prompt: its cache salt, token ids and the digests of its parts."""

    salt: str | None
    ids: array
    tools: str
    system: str
    turns: list[str]


def prompt_parts(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[str, str, list[str]]:
    """Digests of a chat's tools, system message and each other turn."""
    system = [m for m in messages if m.get("role") == "system"]
    turns = [m for m in messages if m.get("role") != "system"]
    return _digest(tools), _digest(system), [_digest(m) for m in turns]


class PromptLog:
    """The recent Messages prompts by message id (LRU of ``size``)."""

    def __init__(self, size: int = 1024) -> None:
        self._log: cachetools.LRUCache[str, LoggedPrompt] = cachetools.LRUCache(size)

    def add(
        self,
        message_id: str,
        salt: str | None,
        ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> None:
        tools_d, system_d, turns = prompt_parts(messages, tools)
        self._log[message_id] = LoggedPrompt(salt, array("i", ids), tools_d, system_d, turns)

    def get(self, message_id: str, salt: str | None) -> LoggedPrompt | None:
        """The logged prompt of ``message_id`` under ``salt`` (None for another salt's)."""
        found = self._log.get(message_id)
        return found if found is not None and found.salt == salt else None


def cache_miss_reason(
    previous: LoggedPrompt | None,
    current: LoggedPrompt,
    cached: int,
    block_size: int,
) -> dict[str, Any] | None:
    """The ``cache_miss_reason`` of ``current`` (``cached`` tokens read) against
    ``previous`` (module docstring); None when nothing was missed."""
    if previous is None:
        return {"type": "previous_message_not_found"}
    would = len(previous.ids) // block_size * block_size
    missed = max(0, would - cached)
    if not missed:
        return None
    n = min(len(previous.ids), len(current.ids))
    common = next((i for i in range(n) if previous.ids[i] != current.ids[i]), n)
    if common >= would:
        return {"type": "unavailable"}
    if previous.tools != current.tools:
        kind = "tools_changed"
    elif previous.system != current.system:
        kind = "system_changed"
    else:
        kind = "messages_changed"
    return {"type": kind, "cache_missed_input_tokens": missed}


PROMPT_LOG: web.AppKey[PromptLog] = web.AppKey("prefixgate_prompt_log", PromptLog)
