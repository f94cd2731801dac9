"""What OpenAI-compatible upstreams add to OpenAI's answer, and what prefixgate reads of it.

One table (``UPSTREAM_FIELDS``; ``docs/upstreams.md`` prints the same) of upstream field →
prefixgate meaning, per upstream kind, and the readers that apply it. Sources: vLLM 0.32
``entrypoints/openai/protocol.py`` (``stop_reason``; ``prompt_tokens_details`` only under
``--enable-prompt-tokens-details``), SGLang ``srt/entrypoints/openai/protocol.py``
(``matched_stop``; ``cached_tokens`` under ``--enable-cache-report``), llama.cpp
``tools/server`` (``usage.prompt_tokens_details.cached_tokens`` always; ``timings``).

- The matched stop (``matched_stop``): the stop string that ended a choice, when the upstream
  names one: vLLM's ``stop_reason``, SGLang's ``matched_stop``. Either may instead be a token
  id (an ``int``: the EOS or a ``stop_token_ids`` entry), which is no stop *sequence*. The
  Messages dialect answers ``stop_reason: "stop_sequence"`` with that string when it is one
  of the request's ``stop_sequences``, else ``end_turn``. llama.cpp's OpenAI routes name no
  matched stop (its native ``/completion``'s ``stopping_word`` is not on them): ``end_turn``.
- Cached prompt tokens (``cached_tokens``): ``usage.prompt_tokens_details.cached_tokens``
  when it is a count; absent or ``null`` is *unknown*, never 0: a vLLM started without
  ``--enable-prompt-tokens-details`` (``prompt_tokens_details: null``), SGLang without
  ``--enable-cache-report``. Unknown is carried as unknown: the Messages dialect's
  ``cache_read_input_tokens`` is ``null`` (the OpenAI dialect relays the upstream's body as
  it is), the access line shows ``cached=-``, and routing learns nothing from the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["UPSTREAM_FIELDS", "UpstreamField", "cached_tokens", "matched_stop"]


@dataclass(frozen=True, slots=True)
class UpstreamField:
    """One row of the table: ``kind`` (upstream kind), ``field`` (where it is in the answer),
    ``meaning`` (what prefixgate reads it as)."""

    kind: str
    field: str
    meaning: str


UPSTREAM_FIELDS: tuple[UpstreamField, ...] = (
    UpstreamField(
        "vllm",
        "choices[i].stop_reason (str | int | null)",
        "matched stop: a str is the stop string that ended the choice (Messages "
        "stop_sequence); an int is a stop token id (end_turn)",
    ),
    UpstreamField(
        "vllm",
        "usage.prompt_tokens_details.cached_tokens",
        "cached prompt tokens; prompt_tokens_details is null without "
        "--enable-prompt-tokens-details: unknown",
    ),
    UpstreamField(
        "sglang",
        "choices[i].matched_stop (str | int | null)",
        "matched stop, as vLLM's stop_reason",
    ),
    UpstreamField(
        "sglang",
        "usage.prompt_tokens_details.cached_tokens",
        "cached prompt tokens (only with --enable-cache-report; else unknown)",
    ),
    UpstreamField(
        "llama.cpp",
        "usage.prompt_tokens_details.cached_tokens",
        "cached prompt tokens (the slot's reused prefix)",
    ),
    UpstreamField(
        "llama.cpp",
        "timings (prompt_n, predicted_n, *_ms)",
        "not read (relayed as sent on the OpenAI routes)",
    ),
    UpstreamField(
        "llama.cpp",
        "no matched stop on the OpenAI routes",
        "a stop string's finish is end_turn, stop_sequence null",
    ),
    UpstreamField(
        "prefixgate",
        "choices[i].stop_reason, usage.prompt_tokens_details.cached_tokens",
        "as vLLM's (always reported)",
    ),
)


def matched_stop(choice: dict[str, Any]) -> str | int | None:
    """The matched stop a choice names: vLLM's (and prefixgate's) ``stop_reason``, else
    SGLang's ``matched_stop``; ``None`` when neither is a str or an int."""
    for key in ("stop_reason", "matched_stop"):
        value = choice.get(key)
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
    return None


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when it is a count (an int >= 0), else
    ``None`` (unknown: the upstream does not report it)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
