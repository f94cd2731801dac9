"""Where a translated request's chat completions fields came from in the client's request.

Upstream mode sends an OpenAI-compatible upstream an OpenAI chat body built from an Anthropic
Messages, a Gemini or a Responses request (``proxy/messages_openai.py``,
``proxy/gemini_relay.py``, ``proxy/responses_relay.py``); an
upstream's refusal names the chat body's fields (``stop``, ``max_completion_tokens``,
``tools[0].function.parameters``, ``messages[2]``, where the client sent ``stop_sequences``,
``max_tokens``, ``tools.0.input_schema`` and ``messages.1``: the system message is no
message of Anthropic's, a ``tool_result`` block is a chat message of its own).
``ClientFields`` names each of them as the client's request spells it
(``proxy/redact.upstream_error`` rewords the refusal with it):

* ``fields``: a top-level chat field (or a dotted path under one, the longest listed taken
  first) → the client's field (the dialect's table,
  ``ANTHROPIC_FIELDS`` / ``GEMINI_FIELDS`` / ``RESPONSES_FIELDS``);
* ``messages``: chat message ``k`` → its ``Origin`` (the client's path of the turn, system
  instruction or block it was made of, and how its own fields are spelt there);
* ``tools``: chat tool ``k`` → its ``Origin``;
* ``choice``: the dialect's spelling of the tool choice (``wire.tools.ChoiceWords``): a
  ``tool_choice`` refusal's field and advice (``'required'``) said in the client's terms.

Paths are read in any of the spellings servers use (``messages[2].content``,
``messages.[2].content``, ``messages.2.content``) and written as local mode writes them
(``messages.1.content``). vLLM's ``input_tokens`` (the prompt over the context,
``PROMPT_PARAM``) is named as ``messages`` is. A chat field the client did not send (the relay's own, e.g.
``stream_options``) has no name: None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.gemini_models import CHAT_FIELD_IN_GEMINI, GenerationConfig, Tool
from prefixgate.gateway.wire.responses_models import ResponsesRequest
from prefixgate.gateway.wire.tools import (
    ANTHROPIC_CHOICE,
    GEMINI_CHOICE,
    OPENAI_CHOICE,
    ChoiceWords,
)

Segment = str | int


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one chat message (or tool) came from: ``path`` in the client's request, and
    ``parts``: the chat object's field → the client's sub-path under ``path`` (``""``: the
    origin itself); a field not listed is named by ``path``."""

    path: str
    parts: Mapping[str, str] = field(default_factory=dict)

    def name(self, rest: list[Segment]) -> str:
        """The client's path of the chat sub-path ``rest`` under this origin (its parts' table
        tried on the longest dotted name first: ``function.parameters`` before ``function``)."""
        names = [s for s in rest if isinstance(s, str)]
        for n in range(len(names), 0, -1):
            sub = self.parts.get(".".join(names[:n]))
            if sub is not None:
                return f"{self.path}.{sub}" if sub else self.path
        return self.path


@dataclass(frozen=True, slots=True)
class ClientFields:
    """A translated request's chat fields in the client's words (module docstring)."""

    fields: Mapping[str, str]
    messages: tuple[Origin, ...] = ()
    tools: tuple[Origin, ...] = ()
    choice: ChoiceWords = OPENAI_CHOICE

    def name(self, path: str) -> str | None:
        """The client's spelling of the chat body's ``path`` (``messages[2].content``), or
        None when ``path`` names nothing the client sent."""
        segments = parse_path("messages" if path == PROMPT_PARAM else path)  # vLLM's prompt
        if not segments or not isinstance(segments[0], str):
            return None
        head, rest = segments[0], segments[1:]
        origins = {"messages": self.messages, "tools": self.tools}.get(head)
        if origins is not None and rest and isinstance(rest[0], int):
            k = rest[0]
            return origins[k].name(rest[1:]) if k < len(origins) else self.fields.get(head)
        for n in range(len(segments), 0, -1):  # a dotted entry first: the longest that is one
            found = self.fields.get(".".join(str(s) for s in segments[:n]))
            if found is not None:
                return found
        return None


PROMPT_PARAM = "input_tokens"
"""The ``param`` of vLLM's refusal of a prompt over the context (``context_length_exceeded``):
no chat field, the rendered ``messages``; named as the client's conversation (``input``,
``messages``, ``contents``), as local mode names it."""

_SEGMENT = re.compile(r"\.?\[(\d+)\]|\.(\d+)|\.([A-Za-z_]\w*)")
PATH = re.compile(r"[A-Za-z_]\w*(?:\.?\[\d+\]|\.\d+|\.[A-Za-z_]\w*)*")
"""A field path in any server's spelling: ``messages[2].content``, ``messages.2.content``."""


def parse_path(path: str) -> list[Segment]:
    """``messages[2].content`` (or ``messages.2.content``, ``messages.[2].content``) →
    ``["messages", 2, "content"]``; ``[]`` when ``path`` is not a field path."""
    head = re.match(r"[A-Za-z_]\w*", path)
    if head is None:
        return []
    out: list[Segment] = [head.group()]
    at = head.end()
    while at < len(path):
        found = _SEGMENT.match(path, at)
        if found is None:
            return []
        index = found.group(1) or found.group(2)
        out.append(int(index) if index is not None else found.group(3))
        at = found.end()
    return out


def in_client_words(err: APIError, fields: ClientFields) -> APIError:
    """``err`` (a refusal of the chat a Messages or Gemini request was translated into: an
    upstream's, or local mode's own rendering and tool checks) naming the client's fields
    (``fields``): its
    ``param``, and in its message each chat field path that is surely one: indexed or dotted
    (``messages[2].content``, ``tools.0.function.parameters``), spelt with an underscore
    (``max_completion_tokens``), quoted (``'stop'``), or the message's leading field
    (``stop: ...``) — a plain word in prose (``stop``, ``messages``) is left as it is.
    Returns ``err``, changed in place."""
    if err.param == "tool_choice" and fields.choice != OPENAI_CHOICE:
        err.param, err.message = fields.choice.field, _choice_advice(err.message, fields.choice)
    elif err.param:
        err.param = fields.name(err.param) or err.param
    message = err.message

    def renamed(found: re.Match[str]) -> str:
        path = found.group()
        before = message[found.start() - 1] if found.start() else ""
        after = message[found.end()] if found.end() < len(message) else ""
        quoted = before in "'\"`" and before != "" and after == before
        leading = found.start() == 0 and message[found.end() :].lstrip().startswith(":")
        if not (quoted or leading or "_" in path or len(parse_path(path)) > 1):
            return path
        return fields.name(path) or path

    err.message = PATH.sub(renamed, message)
    return err


def _choice_advice(message: str, words: ChoiceWords) -> str:
    """A ``tool_choice`` refusal in OpenAI's words (``plan_tools``' own: a prefixgate
    upstream's) spoken in the dialect's: its field and its modes' spellings."""
    if message.startswith("tool_choice: "):
        message = f"{words.field}: " + message.removeprefix("tool_choice: ")
    for mode in ("auto", "required", "named"):
        message = message.replace(OPENAI_CHOICE.mode(mode), words.mode(mode))
    return message


# --- the dialects' tables: chat field -> the client's field ----------------------------------
ANTHROPIC_FIELDS: Mapping[str, str] = {
    "model": "model",
    "messages": "messages",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "stream": "stream",
}
"""Anthropic Messages: a chat completions field (``messages_openai.to_chat_body``) → the
Messages field it came from (``response_format``: ``anthropic_fields``, the spelling sent)."""

ANTHROPIC_TOOL_PARTS: Mapping[str, str] = {
    "type": "",
    "function": "",
    "function.name": "name",
    "function.description": "description",
    "function.parameters": "input_schema",
    "function.strict": "strict",
}
"""An OpenAI function tool's fields → an Anthropic tool's."""

GEMINI_FIELDS: Mapping[str, str] = {
    **CHAT_FIELD_IN_GEMINI,
    "model": "model",
    "tools": "tools",
    "tool_choice": "toolConfig",
    "response_format": "generationConfig.responseMimeType",
}
"""Gemini: a chat completions field (``gemini_relay._chat_body``) → the Gemini request field
it came from (``response_format``: ``gemini_fields``, the schema field sent)."""


RESPONSES_FIELDS: Mapping[str, str] = {
    "model": "model",
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "user": "user",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema.name": "text.format.name",
    "response_format.json_schema.strict": "text.format.strict",
    "response_format.json_schema.description": "text.format.description",
    "stream": "stream",
    "prompt_cache_key": "prompt_cache_key",
    "prompt_cache_retention": "prompt_cache_retention",
    "prompt_cache_options": "prompt_cache_options",
    "cache_salt": "cache_salt",
}
"""The Responses API: a chat completions field (``responses_relay.chat_body``) → the
Responses field it came from."""


def responses_fields(req: ResponsesRequest) -> ClientFields:
    """The ``ClientFields`` of a Responses request translated to a chat body: its
    ``instructions`` the first chat message when given, then ``input`` (a string: one
    message; else item ``i`` is ``input.i``); ``response_format`` is ``text.format.schema``
    for a ``json_schema`` format (what the chat refuses of it is its schema, as local mode
    names it), else ``text.format``."""
    messages = [Origin("instructions")] if req.instructions else []
    if isinstance(req.input, str):
        messages.append(Origin("input"))
    else:
        parts = {"content": "content", "role": "role"}
        messages.extend(Origin(f"input.{i}", parts) for i in range(len(req.input)))
    fields = dict(RESPONSES_FIELDS)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":  # the chat's refusal is of the schema
        fields["response_format"] = "text.format.schema"
    return ClientFields(fields, tuple(messages))


def anthropic_fields(origins: list[str], n_tools: int, output_field: str) -> ClientFields:
    """The ``ClientFields`` of a Messages request translated to a chat body: ``origins`` the
    client's path of each chat message (``anthropic_models.Chat.origins``), ``n_tools`` its
    tools, ``output_field`` the structured-output field sent (``output_schema``'s, or "")."""
    messages = []
    for path in origins:
        if path == "system":
            messages.append(Origin("system"))
        elif path.count(".") == 3:  # messages.I.content.J: a tool_result block
            messages.append(Origin(path, {"content": "content", "tool_call_id": "tool_use_id"}))
        else:
            messages.append(Origin(path, {"content": "content", "role": "role"}))
    tools = tuple(Origin(f"tools.{k}", ANTHROPIC_TOOL_PARTS) for k in range(n_tools))
    fields = dict(ANTHROPIC_FIELDS)
    if output_field:
        fields["response_format"] = output_field
    return ClientFields(fields, tuple(messages), tools, ANTHROPIC_CHOICE)


def gemini_fields(
    origins: list[str], tools: list[Tool] | None, config: GenerationConfig | None
) -> ClientFields:
    """The ``ClientFields`` of a Gemini request translated to a chat body: ``origins`` the
    client's path of each chat message (``gemini_models.Chat.origins``), ``tools`` and
    ``config`` the request's (each function declaration one chat tool, in order, as
    ``openai_tools`` makes them; ``response_format`` from the schema field sent)."""
    messages = []
    for path in origins:
        if path in ("systemInstruction", "cachedContent"):
            messages.append(Origin(path))
        elif ".parts." in path:  # a functionResponse part
            parts = {"content": "functionResponse.response", "tool_call_id": "functionResponse"}
            messages.append(Origin(path, parts))
        else:
            messages.append(Origin(path, {"content": "parts", "tool_calls": "parts"}))
    declared = []
    for i, t in enumerate(tools or []):
        for j, f in enumerate(t.functionDeclarations or []):
            schema = "parametersJsonSchema" if f.parametersJsonSchema is not None else "parameters"
            parts = {
                "type": "",
                "function": "",
                "function.name": "name",
                "function.description": "description",
                "function.parameters": schema,
            }
            declared.append(Origin(f"tools.{i}.functionDeclarations.{j}", parts))
    fields = dict(GEMINI_FIELDS)
    if config is not None:
        for name in ("responseJsonSchema", "responseSchema"):
            if getattr(config, name) is not None:
                fields["response_format"] = f"generationConfig.{name}"
                break
    return ClientFields(fields, tuple(messages), tuple(declared), GEMINI_CHOICE)


__all__ = [
    "ANTHROPIC_FIELDS",
    "ANTHROPIC_TOOL_PARTS",
    "GEMINI_FIELDS",
    "PATH",
    "RESPONSES_FIELDS",
    "ClientFields",
    "Origin",
    "anthropic_fields",
    "gemini_fields",
    "in_client_words",
    "parse_path",
    "responses_fields",
]
