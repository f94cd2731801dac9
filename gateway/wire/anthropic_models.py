"""Anthropic's Messages API request bodies, validated, and their conversion to a chat.

``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` take Anthropic's shapes (the
``anthropic`` package's ``MessageCreateParams`` / ``MessageCountTokensParams``): ``system`` as
a string or text blocks, ``messages`` whose content is a string or ``text`` / ``tool_use`` /
``tool_result`` blocks, ``tools`` (custom tools: ``name``, ``description``, ``input_schema``),
``tool_choice`` (``auto`` / ``any`` / ``tool`` / ``none``, ``disable_parallel_tool_use``),
``stop_sequences``, ``max_tokens`` (required), ``temperature`` (0-1), ``top_p``, ``top_k``,
``metadata.user_id``, and ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}``
breakpoints on system blocks, tools and message blocks (at most 4, the top-level
``cache_control`` included, which marks the end of the last message).

``to_chat`` turns a request into the chat the gateway already serves: a system message, the
turns (``tool_use`` blocks become an assistant message's ``tool_calls``, ``tool_result``
blocks ``tool`` messages), OpenAI-shaped function tools and a ``tool_choice``; each
breakpoint becomes a ``Breakpoint``: the conversation cut right after its block (rendered
later to find where the breakpoint falls in the prompt's tokens) and its TTL in seconds.

What is not implemented is refused by name (400), never ignored: ``thinking`` other than
disabled, images, documents and other block types, server tools, ``container``,
``mcp_servers``, ``inference_geo``, ``speed`` other than
standard, ``citations``, ``max_tokens: 0`` (cache pre-warming), a final assistant turn
(prefill), ``user_profile_id`` / ``workspace_id``, ``output_config.effort`` other than
``"high"`` (the default). An unknown field is a 400 naming it.

Structured output: ``output_config.format`` (or the older ``output_format``) ``{"type":
"json_schema", "schema": {...}}`` constrains the answer's text to the schema on the grammar path
OpenAI's ``response_format`` takes (``OutputFormat.structured``); it is one output constraint,
so not with a forced tool call (``tool_choice`` any / tool) nor with ``stop_sequences``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pydantic_core
from prefixgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from prefixgate.gateway.http.errors import bad_request
from prefixgate.gateway.tenancy.keys import MAX_SALT_CHARS
from prefixgate.gateway.wire.cache_breakpoints import Breakpoint
from prefixgate.gateway.wire.sampling import StopString, sampling_params
from pydantic import BaseModel, ConfigDict, Field

_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

MAX_BREAKPOINTS = 4  # Anthropic's limit of cache_control breakpoints per request
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}

# Known fields of MessageCreateParams refused unless absent or holding their no-op value.
_REFUSED: dict[str, str] = {
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported",
    "inference_geo": "inference_geo is not supported",
    "user_profile_id": "user_profile_id is not supported",
    "workspace_id": "workspace_id is not supported",
    "context_management": "context_management is not supported",
}


class CacheControl(BaseModel):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (``ttl`` default ``"5m"``)."""

    model_config = _CONFIG
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def ttl_s(self) -> float:
        """The breakpoint's TTL in seconds."""
        return TTL_SECONDS[self.ttl or "5m"]


class TextBlock(BaseModel):
    """``{"type": "text", "text", "cache_control"?}`` (``citations`` only null or empty)."""

    model_config = _CONFIG
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(None, max_length=0)


class ToolUseBlock(BaseModel):
    """An assistant's earlier tool call: ``{"type": "tool_use", "id", "name", "input"}``."""

    model_config = _CONFIG
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """A tool's answer: ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``
    (``content`` a string or text blocks)."""

    model_config = _CONFIG
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The result as text (blocks joined); an error result is prefixed ``"Error: "``."""
        body = (
            self.content
            if isinstance(self.content, str)
            else "".join(b.text for b in self.content or [])
        )
        return "Error: " + body if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(BaseModel):
    """One turn: ``role`` user or assistant, ``content`` a string or blocks."""

    model_config = _CONFIG
    role: Literal["user", "assistant"]
    content: str | list[Block]


class InputSchema(BaseModel):
    """A custom tool's ``input_schema``: a JSON schema of ``type: "object"``."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["object"]


class ToolParam(BaseModel):
    """A custom (client) tool: ``name``, ``description``, ``input_schema``."""

    model_config = _CONFIG
    name: str
    input_schema: InputSchema
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoice(BaseModel):
    """``{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}``."""

    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(BaseModel):
    """``metadata``: ``user_id``, an end-user identifier (logged nowhere, changes nothing)."""

    model_config = _CONFIG
    user_id: str | None = None


class ThinkingDisabled(BaseModel):
    """``thinking``: only ``{"type": "disabled"}`` (the model does not reason)."""

    model_config = _CONFIG
    type: Literal["disabled"]


class OutputFormat(BaseModel):
    """``output_config.format`` / ``output_format``: ``{"type": "json_schema", "schema": {...}}``
    (a JSON schema the answer's text follows)."""

    model_config = _CONFIG
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    def structured(self) -> StructuredOutputsParams:
        """The engine's constraint: the schema, as ``response_format`` json_schema gives it."""
        return StructuredOutputsParams(json=self.json_schema)


class OutputConfig(BaseModel):
    """``output_config``: ``format`` (structured output); ``effort`` only ``"high"``, the
    default (the model does not reason, so no other effort changes anything)."""

    model_config = _CONFIG
    format: OutputFormat | None = None
    effort: Literal["high"] | None = None


class _Conversation(BaseModel):
    """What ``messages`` and ``count_tokens`` share: the prompt."""

    model_config = _CONFIG
    # the content blocks' discriminator values, left out of an error's path (request_models.parse)
    union_tags: ClassVar[frozenset[str]] = frozenset({"text", "tool_use", "tool_result"})
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None
    thinking: ThinkingDisabled | None = None
    # prefixgate's extra (vLLM's name): a prefix-cache partition inside the key's
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the older spelling of output_config.format

    def output_schema(self) -> tuple[StructuredOutputsParams | None, str]:
        """The structured-output constraint and the field it came from
        (``output_config.format`` or ``output_format``), or ``(None, "")``.

        Raises:
            APIError: 400 when both spellings are given.
        """
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None and self.output_format is not None:
            raise bad_request(
                "output_format: give the format once, in output_config.format",
                param="output_format",
            )
        if fmt is not None:
            return fmt.structured(), "output_config.format"
        if self.output_format is not None:
            return self.output_format.structured(), "output_format"
        return None, ""


class Diagnostics(BaseModel):
    """``diagnostics``: ``previous_message_id`` names an earlier message whose cached prompt
    this one is compared with (``cache_diagnostics.py``)."""

    model_config = _CONFIG
    previous_message_id: str | None = None


class MessagesRequest(_Conversation):
    """POST /v1/messages. ``max_tokens`` >= 1 (required); ``temperature`` in [0, 1] (default
    1); ``top_p`` in (0, 1]; ``top_k`` >= 1; at most 16 ``stop_sequences``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopString] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard"] | None = None
    diagnostics: Diagnostics | None = None

    def sampling_params(
        self,
        max_tokens: int,
        structured: StructuredOutputsParams | None,
        skip_special_tokens: bool,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` (``max_tokens``: the checked limit).

        Raises:
            APIError: 400 naming the field the engine refuses.
        """
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": max_tokens,
            "stop": list(self.stop_sequences or []),
            "structured_outputs": structured,
            "skip_special_tokens": skip_special_tokens,
        }
        return sampling_params(fields, _MESSAGES_NAMES)


_MESSAGES_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_tokens",
    "stop": "stop_sequences",
}
"""Engine field → the Messages field that sets it."""


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt of a ``messages`` request."""


M = TypeVar("M", bound=_Conversation)


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a body: known fields not implemented, block types other than text /
    tool_use / tool_result, server tools and ``max_tokens: 0`` are refused by name first.

    Raises:
        APIError: 400 naming the field (``param``).
    """
    # the shared JSON → 400 mapping, and empty fields as absent ones
    from prefixgate.gateway.wire.request_models import parse, without_empty

    try:
        raw = pydantic_core.from_json(body)  # nesting bounded: never a RecursionError
    except ValueError:
        raw = None  # parse() reports it
    if isinstance(raw, dict):
        _refuse(without_empty(raw), model)
    return parse(model, body)


def _refuse(raw: dict[str, Any], model: type[_Conversation]) -> None:
    from prefixgate.gateway.wire.request_models import is_empty

    for name, why in _REFUSED.items():
        if not is_empty(raw.get(name)):
            raise bad_request(f"{name}: {why}", param=name, code="unsupported_parameter")
    thinking = raw.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") != "disabled":
        raise bad_request(
            'thinking: extended thinking is not supported (send {"type": "disabled"})',
            param="thinking",
            code="unsupported_parameter",
        )
    if model is MessagesRequest and raw.get("max_tokens") == 0:
        raise bad_request(
            "max_tokens: 0 (cache pre-warming without a response) is not supported",
            param="max_tokens",
            code="unsupported_parameter",
        )
    if raw.get("speed") not in (None, "standard"):
        raise bad_request(
            "speed: only 'standard' is supported", param="speed", code="unsupported_parameter"
        )
    for i, tool in enumerate(_listed(raw.get("tools"))):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            where = f"tools.{i}.type"
            raise bad_request(
                f"{where}: server tool {str(kind)[:60]!r} is not supported (custom tools only)",
                param=where,
                code="unsupported_parameter",
            )
    system = raw.get("system")
    blocks = [(f"system.{j}", b) for j, b in enumerate(system)] if isinstance(system, list) else []
    for i, m in enumerate(_listed(raw.get("messages"))):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            blocks += [(f"messages.{i}.content.{j}", b) for j, b in enumerate(content)]
            for j, b in enumerate(content):
                inner = b.get("content") if isinstance(b, dict) else None
                if isinstance(inner, list):
                    where = f"messages.{i}.content.{j}.content"
                    blocks += [(f"{where}.{k}", c) for k, c in enumerate(inner)]
    allowed = {"text", "tool_use", "tool_result"}
    for where, b in blocks:
        kind = b.get("type") if isinstance(b, dict) else None
        ok = allowed if where.count("content") == 1 else {"text"}
        if isinstance(kind, str) and kind not in ok:
            raise bad_request(
                f"{where}.type: {kind[:60]!r} blocks are not supported here "
                f"({', '.join(sorted(ok))} only)",
                param=f"{where}.type",
                code="unsupported_parameter",
            )


def _listed(value: Any) -> list[Any]:
    """``value`` when it is a list, else empty (the models then name what is wrong with it)."""
    return value if isinstance(value, list) else []


@dataclass(slots=True)
class Chat:
    """A Messages request as a chat: template messages, OpenAI function tools, the
    ``tool_choice`` / ``parallel_tool_calls`` for ``tools.plan_tools``, and its breakpoints."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool | None
    breakpoints: list[Breakpoint] = field(default_factory=list)
    # the client's path of each message (``system``, ``messages.I``, a tool_result block's
    # ``messages.I.content.J``): an upstream's refusal named in the client's words
    origins: list[str] = field(default_factory=list)


def _openai_tool(t: ToolParam) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema.model_dump()}
    if t.description is not None:
        fn["description"] = t.description
    if t.strict is not None:
        fn["strict"] = t.strict
    return {"type": "function", "function": fn}


def output_constraint(req: _Conversation, chat: Chat) -> tuple[StructuredOutputsParams | None, str]:
    """The request's structured-output constraint and its field (``output_schema``), refused
    beside a forced tool call (``chat.tool_choice`` required or named: one constraint each).

    Raises:
        APIError: 400 naming the format's field.
    """
    schema, where = req.output_schema()
    forced = chat.tool_choice == "required" or isinstance(chat.tool_choice, dict)
    if schema is not None and forced:
        raise bad_request(
            f"{where}: only one output constraint per request (tool_choice forces a tool "
            "call, which constrains the output too)",
            param=where,
        )
    return schema, where


def to_chat(req: _Conversation) -> Chat:
    """The request as a chat (module docstring).

    Raises:
        APIError: 400 naming the field: more than 4 breakpoints, a ``tool_choice`` ``tool``
            without ``name``, an empty conversation, a turn against ``check_turns``.
    """
    tools = [_openai_tool(t) for t in req.tools or []]
    tc = req.tool_choice
    choice: Any = None
    parallel: bool | None = None
    if tc is not None and tc.type != "none" and not tools:  # Anthropic's words, not OpenAI's
        raise bad_request("tool_choice: may only be specified while providing tools", "tool_choice")
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise bad_request("tool_choice.name: required for type 'tool'", "tool_choice.name")
            choice = {"type": "function", "function": {"name": tc.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        if tc.disable_parallel_tool_use:
            parallel = False
    chat = Chat([], tools, choice, parallel)
    marks = chat.breakpoints
    for i, t in enumerate(req.tools or []):
        if t.cache_control is not None:
            marks.append(Breakpoint(f"tools.{i}", t.cache_control.ttl_s, [], tools[: i + 1]))
    msgs = chat.messages
    if isinstance(req.system, str):
        if req.system:
            msgs.append({"role": "system", "content": req.system})
    elif req.system:
        text = ""
        for j, b in enumerate(req.system):
            text += b.text
            if b.cache_control is not None:
                cut = [{"role": "system", "content": text}]
                marks.append(Breakpoint(f"system.{j}", b.cache_control.ttl_s, cut, tools))
        msgs.append({"role": "system", "content": text})
    if msgs:
        chat.origins.append("system")
    check_turns(req.messages)  # a first turn not the user's is told so, even when it is the last
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise bad_request(
            f"messages.{last}: a final assistant turn (prefill: continuing the assistant's "
            "text) is not supported; end with a user turn",
            param=f"messages.{last}.role",
            code="unsupported_parameter",
        )
    for i, m in enumerate(req.messages):
        _add_turn(chat, i, m)
    if req.cache_control is not None:
        marks.append(Breakpoint("cache_control", req.cache_control.ttl_s, list(msgs), tools))
    if len(marks) > MAX_BREAKPOINTS:
        raise bad_request(
            f"{marks[MAX_BREAKPOINTS].where}.cache_control: at most {MAX_BREAKPOINTS} "
            f"cache_control breakpoints per request, got {len(marks)}",
            param=f"{marks[MAX_BREAKPOINTS].where}.cache_control",
        )
    return chat


def check_turns(messages: list[MessageParam]) -> None:
    """Anthropic's structural rules of a conversation, checked before it is rendered (the
    messages Anthropic's API answers, the field as ``param``):

    - every turn has content: not ``""``, not ``[]``, no text block with empty ``text``;
    - ``tool_use`` blocks only in assistant turns, ids unique; ``tool_result`` blocks only in
      user turns, before any text of the turn;
    - a ``tool_result`` answers a ``tool_use`` of the previous turn (its ``tool_use_id``), and
      the turn after an assistant's ``tool_use`` blocks answers every one of them;
    - the first turn is the user's.

    Consecutive turns of one role are accepted (Anthropic combines them into one turn).

    Raises:
        APIError: 400 ``invalid_request_error`` naming the block or turn.
    """
    seen: set[str] = set()
    asked: list[str] = []  # tool_use ids of the previous turn, each awaiting its result
    for i, m in enumerate(messages):
        if not m.content:  # (Anthropic exempts a final assistant turn: refused here anyway)
            raise bad_request(
                f"messages.{i}: all messages must have non-empty content",
                param=f"messages.{i}.content",
            )
        blocks = [] if isinstance(m.content, str) else m.content
        answered: list[str] = []
        other_seen = False  # a text or tool_use block came before in this turn
        for j, b in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            if isinstance(b, TextBlock) and not b.text:
                raise bad_request(
                    f"{where}.text: text content blocks must be non-empty", param=f"{where}.text"
                )
            if isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise bad_request(f"{where}: tool_result blocks belong to user turns", where)
                if other_seen:
                    raise bad_request(
                        f"{where}: tool_result blocks must come first in the content, before "
                        "any text",
                        param=where,
                    )
                if b.tool_use_id not in asked:
                    raise bad_request(
                        f"{where}.tool_use_id: unexpected tool_use_id found in tool_result "
                        f"blocks: {b.tool_use_id[:80]!r}. Each tool_result block must have a "
                        "corresponding tool_use block in the previous message",
                        param=f"{where}.tool_use_id",
                    )
                answered.append(b.tool_use_id)
                continue
            other_seen = True
            if isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise bad_request(f"{where}: tool_use blocks belong to assistant turns", where)
                if b.id in seen:
                    raise bad_request(
                        f"{where}.id: tool_use ids must be unique ({b.id[:80]!r} is used twice)",
                        param=f"{where}.id",
                    )
                seen.add(b.id)
        missing = [t for t in asked if t not in answered]
        if missing:
            raise bad_request(
                f"messages.{i - 1}: tool_use ids were found without tool_result blocks "
                f"immediately after: {', '.join(t[:80] for t in missing)}. Each tool_use block "
                "must have a corresponding tool_result block in the next message",
                param=f"messages.{i - 1}.content",
            )
        asked = [b.id for b in blocks if isinstance(b, ToolUseBlock)]
    if messages and messages[0].role != "user":
        raise bad_request(
            "messages.0.role: the first message must use the user role", "messages.0.role"
        )


def _add_turn(chat: Chat, i: int, m: MessageParam) -> None:
    """Append turn ``i`` to ``chat.messages`` (tool results as ``tool`` messages first, then
    the turn's text; an assistant's ``tool_use`` blocks as its ``tool_calls``), noting the
    breakpoints of its blocks."""
    msgs = chat.messages
    if isinstance(m.content, str):
        msgs.append({"role": m.role, "content": m.content})
        chat.origins.append(f"messages.{i}")
        return
    text = ""
    calls: list[dict[str, Any]] = []

    def current() -> dict[str, Any]:
        d: dict[str, Any] = {"role": m.role, "content": text}
        if calls:
            d["tool_calls"] = [json.loads(json.dumps(c)) for c in calls]
        return d

    opened = False  # the turn's own message (text / tool calls) has started
    for j, b in enumerate(m.content):
        if isinstance(b, ToolResultBlock):  # where blocks may be: check_turns
            msgs.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            chat.origins.append(f"messages.{i}.content.{j}")
            cut = list(msgs)
        else:
            if isinstance(b, ToolUseBlock):
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": b.input},
                    }
                )
            else:
                text += b.text
            opened = True
            cut = [*msgs, current()]
        if b.cache_control is not None:
            where = f"messages.{i}.content.{j}"
            chat.breakpoints.append(Breakpoint(where, b.cache_control.ttl_s, cut, chat.tools))
    if opened:
        msgs.append(current())
        chat.origins.append(f"messages.{i}")


# --- answers: what a Messages answer must be (proxy/answers.py checks upstreams' with it) ---
_ANSWER = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_Count = Annotated[int, Field(ge=0)]


class AnswerBlock(BaseModel):
    """A content block of an answer: any block with a string ``type`` (its fields pass)."""

    model_config = _ANSWER
    type: str


class AnswerUsage(BaseModel):
    """An answer's ``usage``: ``input_tokens`` and ``output_tokens``, whole counts >= 0
    (the cache fields pass as they are)."""

    model_config = _ANSWER
    input_tokens: _Count
    output_tokens: _Count


class MessageAnswer(BaseModel):
    """A whole Messages answer: ``{"type": "message", "id", "role": "assistant", "content":
    [blocks], "usage"}`` (other fields pass; none may be missing)."""

    model_config = _ANSWER
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    content: list[AnswerBlock]
    usage: AnswerUsage
