"""Cache diagnostics of every dialect: why a request did not read what an earlier one cached.

One diagnosis (``diagnose``), three renderings:

- Anthropic's Messages API: a request names an earlier message, ``diagnostics:
  {"previous_message_id": "msg_..."}``, and the answer carries ``diagnostics.cache_miss_reason``
  (``anthropic.types.CacheMissReason``; ``anthropic_reason``);
- OpenAI's Responses API: ``prompt_cache_options.comparison_response_id: "resp_..."``, and the
  response carries ``prompt_cache_diagnostics`` (``openai.types.responses.response.
  PromptCacheDiagnostics``; ``openai_diagnostics``);
- both answers' ``x-prefixgate-cache`` header (whole bodies) add ``compare=<kind>`` with the
  missed tokens and the first divergent token index (``header_part``).

The kinds of ``Diagnosis`` (``reusable`` = the earlier prompt's whole KV blocks, in tokens;
``missed`` = ``reusable`` minus the tokens read):

- ``not_found``: no such prompt in the recent log, or another key's under another cache salt
  (a cache partition never learns of another's prompts). Anthropic
  ``previous_message_not_found``, OpenAI ``comparison_response_not_found``;
- ``salt_differs``: the same API key's prompt (on an open gateway every caller is one key)
  under another cache salt (``cache_salt``): nothing can be shared. Rendered as ``not_found`` in both dialects (neither has the
  notion); the header says ``salt_differs``;
- ``below_one_block``: the earlier prompt is shorter than one KV block, so nothing of it was
  cacheable. Anthropic ``null`` (nothing missed), OpenAI ``unavailable``;
- ``hit``: every reusable token was read. Anthropic ``null``, OpenAI ``cache_hit``;
- ``tools_changed`` / ``system_changed`` / ``messages_changed``: the prompts diverge before
  the end of the earlier one's reusable blocks, and the first differing part (in prompt
  order: tools, system, then an earlier turn changed rather than turns appended) says why.
  Anthropic the same with ``cache_missed_input_tokens``; OpenAI ``cache_miss`` with reason
  ``tools_changed`` or ``input_changed`` (the instructions are input there),
  ``cache_missed_tokens`` and ``comparison_reusable_tokens``;
- ``evicted``: the prompt extends the earlier one, yet fewer tokens were read than it had
  cached (evicted, or its pin lapsed). Anthropic and OpenAI ``unavailable``.

Every Messages and Responses request is logged (``PromptLog``: the last 1024, its salt, the
key's id, token ids and digests of its tools, system and turns), whether or not it asks for
diagnostics, since any answer may be named later.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal

import cachetools
from aiohttp import web


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(slots=True)
class LoggedPrompt:
    """One logged prompt: its cache salt, token ids, the digests of its parts and the key id
    that sent it (``owner``; None on an open gateway)."""

    salt: str | None
    ids: array
    tools: str
    system: str
    turns: list[str]
    owner: str | None = None


def prompt_parts(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[str, str, list[str]]:
    """Digests of a chat's tools, system message and each other turn."""
    system = [m for m in messages if m.get("role") == "system"]
    turns = [m for m in messages if m.get("role") != "system"]
    return _digest(tools), _digest(system), [_digest(m) for m in turns]


class PromptLog:
    """The recent Messages and Responses prompts by answer id (LRU of ``size``)."""

    def __init__(self, size: int = 1024) -> None:
        self._log: cachetools.LRUCache[str, LoggedPrompt] = cachetools.LRUCache(size)

    def add(
        self,
        message_id: str,
        salt: str | None,
        ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        owner: str | None = None,
    ) -> LoggedPrompt:
        """Log one prompt under its answer's id; returns the entry."""
        tools_d, system_d, turns = prompt_parts(messages, tools)
        entry = LoggedPrompt(salt, array("i", ids), tools_d, system_d, turns, owner)
        self._log[message_id] = entry
        return entry

    def get(self, message_id: str, salt: str | None) -> LoggedPrompt | None:
        """The logged prompt of ``message_id`` under ``salt`` (None for another salt's)."""
        found = self._log.get(message_id)
        return found if found is not None and found.salt == salt else None

    def find(self, message_id: str) -> LoggedPrompt | None:
        """The logged prompt of ``message_id`` whatever its salt: for ``diagnose`` only,
        which never reveals another partition's prompt."""
        return self._log.get(message_id)


Kind = Literal[
    "not_found",
    "salt_differs",
    "below_one_block",
    "hit",
    "tools_changed",
    "system_changed",
    "messages_changed",
    "evicted",
]


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What one request read against an earlier prompt (module docstring).

    Attributes:
        kind: the verdict; reusable: the earlier prompt's whole KV blocks (tokens);
        missed: reusable tokens not read; diverged_at: the first differing token index
        (None when the prompt extends the earlier one, or no comparison was possible).
    """

    kind: Kind
    reusable: int = 0
    missed: int = 0
    diverged_at: int | None = None


def diagnose(
    previous: LoggedPrompt | None, current: LoggedPrompt, cached: int, block_size: int
) -> Diagnosis:
    """The ``Diagnosis`` of ``current`` (``cached`` of its tokens read from the prefix cache)
    against ``previous`` (the named answer's logged prompt, any salt, or None)."""
    if previous is None:
        return Diagnosis("not_found")
    if previous.salt != current.salt:
        same_key = previous.owner == current.owner
        return Diagnosis("salt_differs" if same_key else "not_found")
    reusable = len(previous.ids) // block_size * block_size
    if not reusable:
        return Diagnosis("below_one_block")
    missed = max(0, reusable - cached)
    n = min(len(previous.ids), len(current.ids))
    common = next((i for i in range(n) if previous.ids[i] != current.ids[i]), n)
    diverged = None if common == len(previous.ids) else common
    if not missed:
        return Diagnosis("hit", reusable, 0, diverged)
    if common >= reusable:
        return Diagnosis("evicted", reusable, missed, diverged)
    if previous.tools != current.tools:
        kind: Kind = "tools_changed"
    elif previous.system != current.system:
        kind = "system_changed"
    else:
        kind = "messages_changed"
    return Diagnosis(kind, reusable, missed, diverged)


def anthropic_reason(d: Diagnosis) -> dict[str, Any] | None:
    """Anthropic's ``cache_miss_reason`` (None: nothing missed)."""
    if d.kind in ("hit", "below_one_block"):
        return None
    if d.kind in ("not_found", "salt_differs"):
        return {"type": "previous_message_not_found"}
    if d.kind == "evicted":
        return {"type": "unavailable"}
    return {"type": d.kind, "cache_missed_input_tokens": d.missed}


def openai_diagnostics(d: Diagnosis) -> dict[str, Any]:
    """OpenAI's Responses ``prompt_cache_diagnostics``."""
    if d.kind == "hit":
        return {"type": "cache_hit"}
    if d.kind in ("not_found", "salt_differs"):
        return {"type": "comparison_response_not_found"}
    if d.kind in ("evicted", "below_one_block"):
        return {"type": "unavailable"}
    return {
        "type": "cache_miss",
        "reason": "tools_changed" if d.kind == "tools_changed" else "input_changed",
        "cache_missed_tokens": d.missed,
        "comparison_reusable_tokens": d.reusable,
    }


def header_part(d: Diagnosis) -> str:
    """The ``x-prefixgate-cache`` part: ``compare=<kind>``, then ``:missed=<tokens>`` when
    some were missed and ``:at=<index>`` of the first differing token, e.g.
    ``compare=system_changed:missed=64:at=37``."""
    out = f"compare={d.kind}"
    if d.missed:
        out += f":missed={d.missed}"
    if d.diverged_at is not None and d.kind not in ("not_found", "salt_differs"):
        out += f":at={d.diverged_at}"
    return out


@dataclass(slots=True)
class Comparison:
    """One request's comparison against a named earlier answer: ``diagnosis(cached)`` once
    its cached tokens are known (remembered, so the body, the stream and the header agree)."""

    previous: LoggedPrompt | None
    current: LoggedPrompt
    block_size: int
    _done: dict[int, Diagnosis] = field(default_factory=dict)

    def diagnosis(self, cached: int) -> Diagnosis:
        if cached not in self._done:
            self._done[cached] = diagnose(self.previous, self.current, cached, self.block_size)
        return self._done[cached]


def cache_miss_reason(
    previous: LoggedPrompt | None,
    current: LoggedPrompt,
    cached: int,
    block_size: int,
) -> dict[str, Any] | None:
    """Anthropic's ``cache_miss_reason`` of ``current`` (``cached`` tokens read) against
    ``previous`` (module docstring); None when nothing was missed."""
    return anthropic_reason(diagnose(previous, current, cached, block_size))


PROMPT_LOG: web.AppKey[PromptLog] = web.AppKey("prefixgate_prompt_log", PromptLog)
