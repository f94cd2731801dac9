"""Anthropic Messages answers and stream events from OpenAI-style output, for both modes.

Local mode feeds it the engine's deltas (``local/messages.py``), proxy mode an OpenAI-compatible
upstream's chat completion or chunks (``proxy/messages_openai.py``, which reads the upstream's
own fields first). One place says what a ``message`` holds, how an OpenAI ``finish_reason``
becomes a ``stop_reason`` and in which order the events go out:

``message_start`` (the message with no content and its usage so far), ``ping``, then per
content block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, stop
sequence, cumulative usage) and ``message_stop``; a stream cut short ends with an ``error``
event instead (Anthropic's error body). Each event is framed ``event: KIND\\ndata: JSON\\n\\n``
(compact JSON, UTF-8 as is), the shapes of Anthropic's streaming docs and the ``anthropic``
package's parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.partial_json import arguments_object

# OpenAI finish_reason -> Anthropic stop_reason, beside "stop" (end_turn, tool_use or
# stop_sequence: ``stop_reason``)
STOP_REASONS = {
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# the usage fields ``message_delta`` repeats (cumulative), in Anthropic's order
DELTA_USAGE_KEYS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)


def stop_reason(finish: Any, called: bool, sequence: str | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished choice.

    ``finish``: the OpenAI ``finish_reason`` (``STOP_REASONS``; anything else counts as
    ``stop``); ``called``: the answer holds tool calls (→ ``tool_use``); ``sequence``: the
    stop string that ended it, when known (→ ``stop_sequence``), else ``end_turn``."""
    if isinstance(finish, str) and finish in STOP_REASONS:
        return STOP_REASONS[finish], None
    if called:
        return "tool_use", None
    if sequence is not None:
        return "stop_sequence", sequence
    return "end_turn", None


def usage_block(
    input_tokens: int, cache_creation: int, cache_read: int | None, output_tokens: int
) -> dict[str, int | None]:
    """Anthropic's ``usage`` (tokens). ``cache_read`` None (JSON ``null``): not known — never
    reported as 0."""
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": cache_creation,
        "cache_read_input_tokens": cache_read,
        "output_tokens": output_tokens,
    }


def tool_input(arguments: Any) -> dict[str, Any]:
    """A ``tool_use`` block's ``input`` of OpenAI tool-call ``arguments`` (JSON text, or an
    object some upstreams send): ``partial_json.arguments_object`` — what the ``anthropic``
    package makes of the same text streamed as ``input_json_delta``, also when ``max_tokens``
    cut it."""
    return arguments_object(arguments)


def content_blocks(text: str | None, calls: Iterable[tuple[str, str, Any]]) -> list[dict]:
    """A whole message's ``content``: one ``text`` block (also when empty, if there is no
    tool call), then a ``tool_use`` block per ``(id, name, input)``."""
    uses = [{"type": "tool_use", "id": i, "name": n, "input": v} for i, n, v in calls]
    return ([{"type": "text", "text": text or ""}] if text or not uses else []) + uses


def message(
    rid: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``message`` object (``extra``, e.g. ``diagnostics``, first)."""
    return {
        **(extra or {}),
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def message_json(body: dict[str, Any]) -> bytes:
    """A whole answer's bytes (compact JSON, UTF-8 as is)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def sse(kind: str, **fields: Any) -> bytes:
    """One framed event, ``{"type": kind, **fields}``."""
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def error_event(err: APIError) -> bytes:
    """The ``error`` event that ends a stream cut short (``APIError.anthropic_body``)."""
    data = json.dumps(err.anthropic_body(), separators=(",", ":"), ensure_ascii=False)
    return f"event: error\ndata: {data}\n\n".encode()


class MessageEvents:
    """The stream of one message: the event order and the content blocks' indexes.

    ``start`` → ``message_start`` + ``ping``; ``text`` / ``tool_use`` open a block (closing the
    open one) and ``text`` / ``input_json`` add deltas; ``finish`` closes the last block (one
    empty text block when nothing was said, as the whole message has) and sends
    ``message_delta`` + ``message_stop``. Each returns the framed events (bytes)."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid = rid
        self.model = model
        self.started = False
        self.index = -1  # the open (or last) block's index
        self.open_kind: str | None = None  # the open block's type

    def start(self, usage: dict[str, Any], extra: dict[str, Any] | None = None) -> list[bytes]:
        """``message_start`` with ``usage`` (what is known so far), then ``ping``."""
        self.started = True
        body = message(self.rid, self.model, [], (None, None), usage, extra)
        return [sse("message_start", message=body), sse("ping")]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        return [*out, sse("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse("content_block_stop", index=self.index)]

    def text(self, text: str) -> list[bytes]:
        """A ``text_delta`` (a text block opened first unless one is open)."""
        out = [] if self.open_kind == "text" else self._open("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*out, sse("content_block_delta", index=self.index, delta=delta)]

    def tool_use(self, tool_id: str, name: str) -> list[bytes]:
        """Open a ``tool_use`` block (its index is then ``self.index``)."""
        block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
        return self._open("tool_use", block)

    def input_json(self, index: int, partial_json: str) -> bytes:
        """An ``input_json_delta`` of the tool call in block ``index``."""
        delta = {"type": "input_json_delta", "partial_json": partial_json}
        return sse("content_block_delta", index=index, delta=delta)

    def finish(self, stop: tuple[str | None, str | None], usage: dict[str, Any]) -> list[bytes]:
        """The last block's stop, ``message_delta`` (``stop``, ``usage``'s
        ``DELTA_USAGE_KEYS``) and ``message_stop``; ``start`` must have been sent."""
        out = self._open("text", {"type": "text", "text": ""}) if self.index < 0 else []
        out += self._close()
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        cumulative = {k: usage[k] for k in DELTA_USAGE_KEYS}
        return [*out, sse("message_delta", delta=delta, usage=cumulative), sse("message_stop")]
