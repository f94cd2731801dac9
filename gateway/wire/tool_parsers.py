"""Tool-call parsers for ``tool_choice="auto"``: find the calls a model wrote in its text.

Chosen with ``prefixgate serve --tool-call-parser NAME`` (vLLM's names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro,
  Qwen2.5 / Qwen3 chat templates);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` objects separated
  by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 JSON tool calling);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects.

Each parser has ``split(text, final) -> (content, calls)``: ``content`` is the text that is
not a tool call; ``calls`` the complete ``ToolCall`` objects found. With ``final=False`` (the
text so far of a stream) content that may still become part of a call (an unclosed block, a
suffix that could open one) is held back; later calls never change what was already
returned, so a stream (``ToolStream``) sends exactly the final result whatever the fragments.
A block that does not parse as a call (malformed JSON, no name) stays content, as in vLLM.
Parsing is never all-or-nothing: a complete call is returned whatever follows it (prose, a
cut or malformed call), and what follows is kept as content.

Each parser also has ``structural_tag(tools, parallel)``: the xgrammar structural tag that
honours ``"strict": true`` tools under ``tool_choice="auto"`` (``tools.plan_tools``): the text
is free until the format's trigger, then the call is constrained to ``{"name": <one of the
tools>, <arguments key>: <its parameters>}`` and the format's closing text. A strict tool's
arguments follow its ``parameters`` schema; a non-strict tool in the same request keeps free
JSON-object arguments (its name is still one of the tools). ``None`` where the format has no
trigger (``llama3_json``: a call is the whole answer, so free text cannot come first).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class ToolCall:
    """One function call: its name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(Protocol):
    """A tool-call format: ``split(text, final) -> (content, calls)`` and its
    ``structural_tag`` (module docstring)."""

    name: str

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]: ...

    def structural_tag(
        self, tools: list[dict[str, Any]], parallel: bool
    ) -> dict[str, Any] | None: ...


# At most one whitespace character in a row inside a constrained call: a tiny model would
# otherwise spend its tokens on spaces (xgrammar needs a positive bound).
_MAX_WHITESPACE = 1


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments constraint: its ``parameters`` when ``strict``, else any object."""
    return function["parameters"] if function.get("strict") is True else {"type": "object"}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}


def _call_from(obj: object, args_key: str) -> ToolCall | None:
    """``{"name": str, args_key: object}`` → ToolCall (arguments re-serialized), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks anywhere in the text."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                rest = text[pos:]
                if not final:
                    rest = rest[: len(rest) - _held_suffix(rest, self.start)]
                content.append(rest)
                break
            content.append(text[pos:i])
            j = text.find(self.end, i + len(self.start))
            if j < 0:  # unclosed block: a call still being written (or, at the end, text)
                if final:
                    call, rest = self._parse_open(text[i + len(self.start) :])
                    if call is not None:
                        calls.append(call)
                        content.append(rest)
                    else:
                        content.append(text[i:])
                break
            call = self._parse(text[i + len(self.start) : j])
            if call is not None:
                calls.append(call)
            else:
                content.append(text[i : j + len(self.end)])
            pos = j + len(self.end)
        return "".join(content), calls

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body.strip()), "arguments")
        except ValueError:
            return None

    @staticmethod
    def _parse_open(body: str) -> tuple[ToolCall | None, str]:
        """An unclosed last block: the call its leading JSON object makes and the text after
        that object (content), or ``(None, "")`` when it does not start with a call."""
        stripped = body.lstrip()
        try:
            obj, end = json.JSONDecoder().raw_decode(stripped)
        except ValueError:
            return None, ""
        call = _call_from(obj, "arguments")
        return (call, stripped[end:]) if call is not None else (None, "")

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Free text; after ``<tool_call>``: a newline, ``{"name": "<tool>", "arguments":
        <args>}``, a newline and ``</tool_call>`` (the Hermes / Qwen templates' layout), one
        tag per tool; without ``parallel`` the answer ends after the first call."""
        tags = [
            {
                "type": "tag",
                "begin": f'{self.start}\n{{"name": {json.dumps(t["function"]["name"])}, '
                '"arguments": ',
                "content": _json_content(_arguments_schema(t["function"])),
                "end": "}\n" + self.end,
            }
            for t in tools
        ]
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": [self.start],
                "tags": tags,
                "stop_after_first": not parallel,
            },
        }


class Llama3JsonParser:
    """The answer is ``{"name", "parameters"}`` objects separated by ``;`` (after an optional
    ``<|python_tag|>``); anything else is plain content. Calls are known at the end only (a
    JSON-looking answer may still turn out to be text)."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag) :].lstrip()
        maybe_call = body.startswith("{") or (body and self.tag.startswith(body)) or not body
        if not maybe_call:
            return text, []
        if not final:
            return "", []
        calls, rest = self._parse(body)
        return (rest, calls) if calls else (text, [])

    @staticmethod
    def _parse(body: str) -> tuple[list[ToolCall], str]:
        """The leading calls of ``body`` (objects separated by ``;`` / whitespace) and the
        text after the last of them: a complete call is kept whatever follows it (prose, a
        cut or malformed object), and what follows is content, as vLLM's parser does."""
        dec = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = rest = 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                break
            call = _call_from(obj, "parameters")
            if call is None:
                break
            calls.append(call)
            pos = rest = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls, body[rest:].lstrip(" \t\r\n;")

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> None:
        """``None``: a call is the whole answer (no trigger after free text), so a strict
        tool cannot be honoured under "auto" with this format."""
        return None


class MistralParser:
    """Content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``."""

    name = "mistral"
    marker = "[TOOL_CALLS]"

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        i = text.find(self.marker)
        if i < 0:
            if final:
                return text, []
            return text[: len(text) - _held_suffix(text, self.marker)], []
        if not final:
            return text[:i], []
        calls, rest = self._parse(text[i + len(self.marker) :])
        return (text[:i] + rest, calls) if calls else (text, [])

    @staticmethod
    def _parse(body: str) -> tuple[list[ToolCall], str]:
        """The calls of the JSON array (or single object) that opens ``body`` and the text
        after it (content: prose after a complete array never loses its calls)."""
        dec = json.JSONDecoder()
        body = body.lstrip()
        try:
            obj, end = dec.raw_decode(body)
        except ValueError:
            return [], ""
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call_from(item, "arguments") for item in items]
        if not calls or any(c is None for c in calls):
            return [], ""
        return calls, body[end:].lstrip()  # type: ignore[return-value]

    def structural_tag(self, tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Free text; after ``[TOOL_CALLS]``: a JSON array (one item without ``parallel``) of
        ``{"name": <tool>, "arguments": <args>}``, and the answer ends there (the parser
        reads one array, with nothing after it)."""
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "arguments": _arguments_schema(t["function"]),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        tag = {"type": "tag", "begin": self.marker, "content": _json_content(array), "end": ""}
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": [self.marker],
                "tags": [tag],
                "stop_after_first": True,
            },
        }


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    """A parser by its ``--tool-call-parser`` name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}"
        ) from None


class ToolStream:
    """Incremental parsing of one streamed answer: ``feed(delta_text)`` returns the new
    content text and the newly complete calls; ``finish()`` the rest at the end.

    The content sent is always a prefix of the final content and the calls a prefix of the
    final calls, wherever the fragments split the text.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_chars = 0
        self.sent_calls = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Add streamed text; returns ``(new content, new complete calls)``."""
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the answer: everything not sent yet."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.split(self.text, final)
        new_content = content[self.sent_chars :] if len(content) > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, len(content))
        new_calls = calls[self.sent_calls :]
        self.sent_calls = max(self.sent_calls, len(calls))
        self.calls.extend(new_calls)
        return new_content, new_calls
