"""Anthropic's Messages API to an OpenAI-compatible upstream (vLLM, SGLang, llama.cpp): the
request translated to a chat completion, the answer — whole or streamed chunk by chunk —
translated back to a ``message`` and its events.

Request (validated first by the local dialect's models, ``wire.anthropic_models``, so what
local mode refuses is refused here by the same name; ``to_chat`` makes the chat): ``system``
→ a system message, text blocks joined, ``tool_use`` blocks → the assistant's
``tool_calls`` (arguments as JSON text), ``tool_result`` blocks → ``tool`` messages
(``is_error`` ones prefixed ``Error: ``), ``tools`` → function tools, ``tool_choice``
(``auto``, ``any`` → ``required``, ``tool`` → the named function, ``none``,
``disable_parallel_tool_use`` → ``parallel_tool_calls: false``), ``stop_sequences`` →
``stop``, ``max_tokens``, ``temperature``, ``top_p``, ``metadata.user_id`` → ``user``.
Refused by name (400): ``top_k`` (no OpenAI field; servers differ on the extra) and
``diagnostics`` (it needs the prompt log of a prefixgate engine). Dropped, and said so:
``cache_control`` breakpoints — an OpenAI-compatible server has no pin to put them on; its
own automatic prefix cache (vLLM's, SGLang's) still serves repeated prefixes, reported as
``cache_read_input_tokens``, and ``cache_creation_input_tokens`` is always 0 — the answer's
``x-prefixgate-cache`` header lists them as ``WHERE=dropped``.

Answer: ``content`` → a ``text`` block, ``tool_calls`` → ``tool_use`` blocks (the
upstream's call id kept, so a ``tool_result`` finds its call again); ``finish_reason`` →
``stop_reason`` (``stop`` → ``end_turn``, or ``stop_sequence`` with the sequence when the
upstream names it — vLLM's ``stop_reason``, SGLang's ``matched_stop``: ``upstream_fields``;
``length`` → ``max_tokens``; ``tool_calls`` → ``tool_use``; ``content_filter`` → ``refusal``);
usage: ``input_tokens`` = prompt − cached, ``cache_read_input_tokens`` =
``prompt_tokens_details.cached_tokens`` (``null`` when the upstream does not report it: vLLM
without ``--enable-prompt-tokens-details``), ``output_tokens`` = completion (0 when the
upstream reports none). The message and its events are built by ``wire.anthropic_events``
(the builder local mode shares); this module reads the upstream's answer into it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.proxy.upstream_fields import cached_tokens, matched_stop
from prefixgate.gateway.wire.anthropic_events import (
    MessageEvents,
    content_blocks,
    message,
    stop_reason,
    tool_input,
    usage_block,
)
from prefixgate.gateway.wire.anthropic_models import Chat, MessagesRequest
from prefixgate.gateway.wire.tools import prompt_tools


class Malformed(Exception):
    """The upstream's answer is not the chat completion (or chunk) it must be."""


def refuse_unmapped(req: MessagesRequest) -> None:
    """Refuse what an OpenAI-compatible upstream cannot take (module docstring).

    Raises:
        APIError: 400 naming the field.
    """
    if req.top_k is not None:
        raise bad_request(
            "top_k: not supported for this model's OpenAI-compatible upstream "
            "(OpenAI's chat API has no top_k)",
            param="top_k",
            code="unsupported_parameter",
        )
    if req.diagnostics is not None:
        raise bad_request(
            "diagnostics: cache diagnostics need a prefixgate upstream; this model's "
            "upstream is OpenAI-compatible",
            param="diagnostics",
            code="unsupported_parameter",
        )


def dropped_marks(chat: Chat) -> str | None:
    """The ``x-prefixgate-cache`` value naming the breakpoints not sent (None without any)."""
    if not chat.breakpoints:
        return None
    return "; ".join(f"{b.where}=dropped" for b in chat.breakpoints)


def openai_messages(chat: Chat) -> list[dict[str, Any]]:
    """The chat's messages as OpenAI sends them (tool call arguments as JSON text)."""
    messages: list[dict[str, Any]] = []
    for m in chat.messages:
        out = {k: v for k, v in m.items() if k != "tool_calls"}
        calls = m.get("tool_calls")
        if calls:
            out["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in calls
            ]
            if not out.get("content"):
                out["content"] = None
        messages.append(out)
    return messages


def to_chat_body(req: MessagesRequest, chat: Chat, model: str) -> dict[str, Any]:
    """The OpenAI chat completions body of a Messages request (``chat``: ``to_chat(req)``)
    for the upstream's ``model``."""
    messages = openai_messages(chat)
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": req.max_tokens}
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if chat.tools:
        body["tools"] = chat.tools
    if chat.tool_choice is not None:
        body["tool_choice"] = chat.tool_choice
    if chat.parallel_tool_calls is False and chat.tools:
        body["parallel_tool_calls"] = False
    schema, _ = req.output_schema()
    if schema is not None:  # Anthropic's structured output as OpenAI's
        json_schema = {"name": "output", "schema": schema.json, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def message_id() -> str:
    """A new Anthropic message id."""
    return "msg_" + uuid.uuid4().hex[:24]


def usage_of(usage: Any) -> dict[str, int | None]:
    """Anthropic usage of an OpenAI ``usage`` object (zeros when it is not one).

    ``cache_read_input_tokens`` is ``None`` (JSON ``null``) when the upstream does not report
    its cached tokens (``upstream_fields.cached_tokens``): unknown is not a miss;
    ``input_tokens`` is then the whole prompt."""
    if not isinstance(usage, dict):
        return usage_block(0, 0, 0, 0)
    prompt = _int(usage.get("prompt_tokens"))
    cached = cached_tokens(usage)
    if cached is None:
        return usage_block(prompt, 0, None, _int(usage.get("completion_tokens")))
    cached = min(cached, prompt)
    return usage_block(prompt - cached, 0, cached, _int(usage.get("completion_tokens")))


def _int(value: Any) -> int:
    """A token count, 0 when ``value`` is not one."""
    return int(value) if _count(value) else 0


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def stop_of(finish: Any, matched: Any, stops: list[str], called: bool) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of an OpenAI ``finish_reason`` (``matched``: the stop
    the upstream names, ``upstream_fields.matched_stop``: vLLM's ``stop_reason``, SGLang's
    ``matched_stop``; a sequence only when it is one of the request's ``stops``); tool calls
    make ``tool_use`` only under ``stop``, an unknown finish reason is ``end_turn``."""
    if finish != "stop":
        return stop_reason(str(finish), False, None)
    sequence = matched if isinstance(matched, str) and matched in stops else None
    return stop_reason(finish, called, sequence)


def to_message(data: Any, rid: str, model: str, stops: list[str]) -> dict[str, Any]:
    """The Anthropic ``message`` of a ``chat.completion`` answer, under the public ``model``.

    Raises:
        Malformed: the answer is not a chat completion with one choice.
    """
    if not isinstance(data, dict):
        raise Malformed("a body that is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise Malformed("a chat completion without choices")
    choice = choices[0]
    msg = choice.get("message")
    if not isinstance(msg, dict):
        raise Malformed("a choice without a message")
    text = msg.get("content")
    if text is not None and not isinstance(text, str):
        raise Malformed("a message content that is not text")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise Malformed("tool_calls that are not a list")
    uses = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Malformed("a tool call without a function name")
        cid = c.get("id") if isinstance(c.get("id"), str) else "toolu_" + uuid.uuid4().hex
        uses.append((cid, fn["name"], tool_input(fn.get("arguments"))))
    stop = stop_of(choice.get("finish_reason"), matched_stop(choice), stops, bool(calls))
    return message(rid, model, content_blocks(text, uses), stop, usage_of(data.get("usage")))


class ChunkTranslator:
    """OpenAI ``chat.completion.chunk`` payloads in, Anthropic stream events out (bytes), built
    by ``wire.anthropic_events`` (the builder local mode shares).

    ``feed(obj) -> bytes`` per chunk; ``finish() -> bytes`` at ``[DONE]`` (the last block's
    stop, ``message_delta``, ``message_stop``); ``usage`` the Anthropic usage so far.
    ``message_start`` goes out with the first chunk (its ``input_tokens`` 0: an OpenAI stream
    says the prompt's size only in its last chunk; ``message_delta`` carries the exact
    usage, which the ``anthropic`` package takes over ``message_start``'s).

    Raises (from ``feed`` / ``finish``): ``Malformed`` for a chunk that is not one, or a
    stream that ends without a finish reason.
    """

    def __init__(self, rid: str, model: str, stops: list[str]) -> None:
        self.rid = rid
        self.model = model
        self.stops = stops
        self.usage = usage_block(0, 0, 0, 0)
        self.usage_seen = False
        self.content_chunks = 0
        self._events = MessageEvents(rid, model)
        self._calls: dict[int, int] = {}  # OpenAI tool call index -> block index
        self._finish: Any = None
        self._matched: Any = None

    def _start(self) -> list[bytes]:
        # not known before the last chunk: null, so a client that keeps message_start's
        # value when message_delta's is null (the anthropic package) never shows a 0
        return self._events.start({**self.usage, "cache_read_input_tokens": None})

    def feed(self, obj: Any) -> bytes:
        if not isinstance(obj, dict):
            raise Malformed("a chunk that is not a JSON object")
        out = [] if self._events.started else self._start()
        if obj.get("usage") is not None:
            self.usage = usage_of(obj["usage"])
            self.usage_seen = True
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise Malformed("a chunk whose choices are not a list")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise Malformed("a chunk whose delta is not an object")
            out += self._delta(delta)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._matched = matched_stop(choice)
        return b"".join(out)

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        text = delta.get("content")
        if isinstance(text, str) and text:
            self.content_chunks += 1
            out += self._events.text(text)
        calls = delta.get("tool_calls") or []
        if not isinstance(calls, list):
            raise Malformed("a chunk whose tool_calls are not a list")
        for call in calls:
            if not isinstance(call, dict):
                raise Malformed("a tool call fragment that is not an object")
            n = call.get("index", 0)
            fn = call.get("function") or {}
            if n not in self._calls:
                self.content_chunks += 1
                name = fn.get("name")
                if not isinstance(name, str) or not name:
                    raise Malformed("a tool call that starts without a function name")
                cid = call.get("id") if isinstance(call.get("id"), str) else None
                out += self._events.tool_use(cid or "toolu_" + uuid.uuid4().hex, name)
                self._calls[n] = self._events.index
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                out.append(self._events.input_json(self._calls[n], args))
        return out

    @property
    def finish_reason(self) -> Any:
        """The finish reason of choice 0 so far (None: none yet)."""
        return self._finish

    def finish(self) -> bytes:
        """The events closing the message (at the upstream's ``[DONE]``)."""
        if self._finish is None:
            raise Malformed("a stream that ended without a finish reason")
        out = [] if self._events.started else self._start()
        if not self.usage_seen:
            self.usage["output_tokens"] = self.content_chunks
        stop = stop_of(self._finish, self._matched, self.stops, bool(self._calls))
        return b"".join(out + self._events.finish(stop, self.usage))


def tokenize_body(chat: Chat, model: str) -> dict[str, Any]:
    """vLLM's ``POST /tokenize`` chat body for the prompt of ``chat``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": openai_messages(chat),
        "add_generation_prompt": True,
    }
    tools = prompt_tools(chat.tools, chat.tool_choice)  # as local mode renders them
    if tools:
        body["tools"] = tools
    return body


def token_count(data: Any) -> int:
    """The prompt's tokens in a ``/tokenize`` answer (vLLM's ``count``, else its ``tokens``).

    Raises:
        APIError: 502 when the answer holds neither.
    """
    if isinstance(data, dict):
        if _count(data.get("count")):
            return int(data["count"])
        if isinstance(data.get("tokens"), list):
            return len(data["tokens"])
    raise APIError(502, "the upstream's /tokenize answer holds no count", code="upstream_error")
