"""OpenAI's Responses API (``POST /v1/responses``) on the wire: what both modes read and write.

The request's model (``ResponsesRequest``, ``parse_request``: the same fields accepted and
the same ones refused by name, with the same 400 words, in local mode,
``local/responses_api.py``, and through a proxy, ``proxy/responses_relay.py``), and the
answer's shapes (``ResponseEvents``): the ``response`` object, its ``usage``
(``usage_object``) and the typed stream events of the API reference
(https://platform.openai.com/docs/api-reference/responses-streaming) in the order both
modes write them: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` …, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``
(or ``response.incomplete``), each with a ``sequence_number``; a stream cut short ends with
an ``error`` event and ``response.failed``. No ``[DONE]``, as OpenAI's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic_core
from prefixgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.wire.request_models import (
    MAX_MESSAGES,
    PartCacheControl,
    PromptCacheBreakpoint,
    is_empty,
    parse,
)
from prefixgate.gateway.wire.sampling import sampling_params
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import from_json

_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

# Fields of openai-python's ResponseCreateParams that are refused unless absent or inert.
REFUSED = (
    "previous_response_id",
    "conversation",
    "reasoning",
    "include",
    "background",
    "top_logprobs",
    "prompt",
    "max_tool_calls",
    "context_management",
)
# Taken as on chat, with no effect: ``service_tier`` only at its no-op values (the one tier
# served), ``safety_identifier`` (an end-user identifier); wire/request_fields.py has chat's.
_SERVICE_TIERS = ("auto", "default")


class InputText(BaseModel):
    """``{"type": "input_text" | "output_text", "text": ...}``: a text part of an input item,
    optionally a cache breakpoint (``prompt_cache_breakpoint``, or ``cache_control`` as on
    chat: ``local/cache_marks.py``)."""

    model_config = _CONFIG
    type: Literal["input_text", "output_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None
    cache_control: PartCacheControl | None = None
    # an earlier response's output text given back as input (openai-python's
    # ResponseOutputText): its metadata, not part of the text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    """A message item of ``input`` (``type`` "message" or left out)."""

    model_config = _CONFIG
    type: Literal["message"] = "message"
    # an earlier response's output message given back as input (ResponseOutputMessage)
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    # a breakpoint on the item itself, not on a part: refused by name (cache_marks.py)
    prompt_cache_breakpoint: Any = None
    cache_control: Any = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}`` (plain text, the default), ``{"type":
    "json_object"}`` (any JSON object) or ``{"type": "json_schema", "name": ..., "schema":
    {...}, "strict": ..., "description": ...}`` (JSON valid against the schema, enforced
    whether ``strict`` or not, as chat's ``response_format``; the flat shape of the Responses
    API, where chat nests them under ``json_schema``).

    Raises:
        ValueError: (a 400 naming ``text.format``) ``name`` / ``schema`` missing for
            ``json_schema``, or given for another type.
    """

    model_config = _CONFIG
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _shape(self) -> TextFormat:
        if self.type == "json_schema":
            if self.name is None or self.json_schema is None:
                raise ValueError("type json_schema needs 'name' and 'schema'")
        elif any(
            v is not None for v in (self.name, self.json_schema, self.description, self.strict)
        ):
            raise ValueError(f"type {self.type} takes no name, schema, description or strict")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """The engine's constraint (``None`` for plain text)."""
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema)
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return None

    def echoed(self) -> dict[str, Any]:
        """The format as the ``response`` object states it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    """``text``: the output format (``verbosity`` is accepted as the API's default only)."""

    model_config = _CONFIG
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesCacheOptions(BaseModel):
    """``prompt_cache_options`` of the Responses API: ``mode`` ``implicit`` (default: a
    breakpoint at the end of the input, plus the explicit ones) or ``explicit`` (the parts'
    ``prompt_cache_breakpoint`` only); ``ttl`` ``"30m"`` (default) or ``"12h"``, the
    breakpoints' TTL; ``comparison_response_id``: an earlier response to diagnose cache reuse
    against (the answer's ``prompt_cache_diagnostics``); ``prewarm`` only ``false``."""

    model_config = _CONFIG
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: str | None = Field(None, min_length=1, max_length=256)
    prewarm: Literal[False] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses body (the fields this server implements).

    ``max_output_tokens`` in tokens; ``temperature`` in [0, 2]; ``top_p`` in (0, 1].
    """

    model_config = _CONFIG
    model: str
    input: str | Annotated[list[InputMessage], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # accepted with no effect, as on chat: every prompt is prefix-cached already
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_options: ResponsesCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None

    def messages(self) -> list[dict[str, str]]:
        """The conversation for the chat template: instructions first, then ``input``."""
        out = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
        else:
            out.extend({"role": m.role, "content": m.text()} for m in self.input)
        return out

    def output_constraint(self) -> StructuredOutputsParams | None:
        """``text.format``'s constraint on the output, or ``None`` (plain text)."""
        fmt = self.text.format if self.text is not None else None
        return fmt.constraint() if fmt is not None else None

    def sampling_params(
        self, max_tokens: int, structured: StructuredOutputsParams | None = None
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` (``max_tokens``: the checked limit; ``structured``:
        ``output_constraint``'s).

        Raises:
            APIError: 400 naming the field the engine refuses.
        """
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": max_tokens,
            "structured_outputs": structured,
        }
        return sampling_params(fields, _RESPONSES_NAMES)


_RESPONSES_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_output_tokens",
}
"""Engine field → the Responses field that sets it."""


def parse_request(body: bytes) -> ResponsesRequest:
    """Validate a body; unknown or unimplemented fields are 400 naming them.

    Raises:
        APIError: 400 (``param`` names the field at fault).
    """
    try:
        raw = from_json(body)  # nesting bounded (MAX_JSON_DEPTH): a ValueError, never recursion
    except ValueError:
        raw = None  # parse() reports it
    if isinstance(raw, dict):
        for name in REFUSED:
            if not is_empty(raw.get(name)) and raw.get(name) is not False:
                raise bad_request(
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        if raw.get("store") is True:
            raise bad_request(
                "store=true is not supported: responses are not stored (send store=false)",
                param="store",
                code="unsupported_parameter",
            )
        tier = raw.get("service_tier")
        if not is_empty(tier) and tier not in _SERVICE_TIERS:
            raise bad_request(
                f"service_tier: {json.dumps(tier)[:80]} is not supported (only 'auto' or 'default')",
                param="service_tier",
                code="unsupported_parameter",
            )
        if raw.get("tools"):
            raise bad_request(
                "tools are not supported on /v1/responses",
                param="tools",
                code="unsupported_parameter",
            )
        options = raw.get("prompt_cache_options")
        if isinstance(options, dict) and options.get("prewarm") is True:
            raise bad_request(
                "prompt_cache_options.prewarm is not supported (send the request itself; "
                "its prefix is cached by answering it)",
                param="prompt_cache_options.prewarm",
            )
        items = raw.get("input")
        if isinstance(items, list):
            for i, item in enumerate(items):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if kind != "message":
                    raise bad_request(
                        f"input item type {str(kind)[:40]!r} is not supported (messages only)",
                        param=f"input.{i}.type",
                    )
        for name in raw:
            if name not in ResponsesRequest.model_fields and name not in REFUSED:
                raise bad_request(
                    f"Unrecognized request argument supplied: {name[:80]}", param=name[:80]
                )
        if any(name in raw for name in REFUSED):  # each holds its no-op value: absent
            kept = {k: v for k, v in raw.items() if k not in REFUSED}
            body = pydantic_core.to_json(kept)
    return parse(ResponsesRequest, body)


def options_object(options: ResponsesCacheOptions | None) -> dict[str, Any] | None:
    """The ``prompt_cache_options`` applied (None when the request sent none)."""
    if options is None:
        return None
    return {
        "mode": options.mode,
        "ttl": options.ttl or "30m",
        "comparison_response_id": options.comparison_response_id,
    }


def ttl_field(ttl_s: float) -> str:
    """The ``cache_write_tokens_details`` field of writes kept ``ttl_s`` seconds:
    ``ttl_30m_tokens`` (1800), ``ttl_12h_tokens`` (43200), ``ttl_24h_tokens``
    (``prompt_cache_retention: "24h"``), ``ttl_5m_tokens`` and ``ttl_1h_tokens`` (a part's
    ``cache_control``): whole hours in ``h``, else whole minutes in ``m``, else seconds."""
    seconds = round(ttl_s)
    if seconds % 3600 == 0:
        return f"ttl_{seconds // 3600}h_tokens"
    if seconds % 60 == 0:
        return f"ttl_{seconds // 60}m_tokens"
    return f"ttl_{seconds}s_tokens"


def usage_object(
    input_tokens: int,
    output_tokens: int,
    cached: int | None,
    written: int | None,
    written_by_ttl: dict[str, int] | None = None,
    reasoning: int | None = 0,
) -> dict[str, Any]:
    """The Responses ``usage`` (tokens): ``input_tokens_details.cached_tokens`` read from the
    prefix cache and ``cache_write_tokens`` written at the breakpoints (``None``: not known,
    JSON ``null``, never a 0 posing as a count), ``cache_write_tokens_details`` (the writes
    by the TTL they were written with, ``ttl_field`` names) when given;
    ``total_tokens`` = input + output."""
    details: dict[str, Any] = {"cached_tokens": cached, "cache_write_tokens": written}
    if written_by_ttl is not None:
        details["cache_write_tokens_details"] = written_by_ttl
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": details,
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""A chat ``finish_reason`` that leaves the response ``incomplete`` → its
``incomplete_details.reason``."""


class ResponseEvents:
    """The answer to one Responses request (one output message, one text part): the
    ``response`` object and its stream events, numbered in order (``seq``); ``text``: the
    text streamed so far (``delta``)."""

    def __init__(self, rid: str, created: int, model: str, req: ResponsesRequest) -> None:
        self.rid = rid
        self.msg_id = "msg_" + rid.removeprefix("resp_")
        self.created = created
        self.model = model  # the model name the answer states
        self.req = req
        self.seq = 0
        self.text = ""

    def _format(self) -> dict[str, Any]:
        """``text.format`` as asked (plain text when not)."""
        text = self.req.text
        if text is None or text.format is None:
            return {"type": "text"}
        return text.format.echoed()

    # --- whole objects ------------------------------------------------------------------
    def response(
        self,
        status: str,
        text: str | None,
        usage: dict[str, Any] | None,
        finish: str | None = None,
        diagnostics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object (``text`` None: no output item yet; ``usage``:
        ``usage_object``'s; ``finish``: the chat finish reason, ``length`` making it
        ``incomplete``; ``diagnostics``: ``prompt_cache_diagnostics``)."""
        req = self.req
        incomplete = None
        if finish in INCOMPLETE:
            status = "incomplete"
            incomplete = {"reason": INCOMPLETE[finish]}
        output = [] if text is None else [self.item("completed", text)]
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": self._format()},
            "tool_choice": req.tool_choice or "auto",
            "tools": [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "prompt_cache_options": options_object(req.prompt_cache_options),
            "prompt_cache_diagnostics": diagnostics,
        }

    def item(self, status: str, text: str) -> dict[str, Any]:
        """The output message item (``in_progress``: no content yet)."""
        content = [] if status == "in_progress" else [self.part(text)]
        return {
            "id": self.msg_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        """The ``output_text`` content part."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # --- stream ---------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event ``kind`` (its ``sequence_number`` the next), as bytes."""
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def part_event(self, kind: str, **fields: Any) -> bytes:
        """An event of the one content part (item ``msg_id``, output and content index 0)."""
        return self.event(kind, item_id=self.msg_id, output_index=0, content_index=0, **fields)

    def opening(self) -> list[bytes]:
        """``response.created`` … ``response.content_part.added``."""
        pending = self.response("in_progress", None, None)
        return [
            self.event("response.created", response=pending),
            self.event("response.in_progress", response=pending),
            self.event(
                "response.output_item.added", output_index=0, item=self.item("in_progress", "")
            ),
            self.part_event("response.content_part.added", part=self.part("")),
        ]

    def delta(self, text: str) -> bytes:
        """``response.output_text.delta`` of new text (noted in ``text``)."""
        self.text += text
        return self.part_event("response.output_text.delta", delta=text, logprobs=[])

    def closing(
        self,
        text: str,
        usage: dict[str, Any] | None,
        finish: str | None,
        diagnostics: dict[str, Any] | None = None,
    ) -> list[bytes]:
        """``response.output_text.done`` … ``response.completed`` (or ``.incomplete``)."""
        final = self.response("completed", text, usage, finish, diagnostics)
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [
            self.part_event("response.output_text.done", text=text, logprobs=[]),
            self.part_event("response.content_part.done", part=self.part(text)),
            self.event(
                "response.output_item.done", output_index=0, item=self.item("completed", text)
            ),
            self.event(done, response=final),
        ]

    def failed(self, err: APIError) -> bytes:
        """The ending of a stream cut short: an ``error`` event (``code``, ``message``,
        ``param``), then ``response.failed`` whose response has ``status: "failed"``, the
        ``error`` (``code``, ``message``) and the text so far as an incomplete item — the
        terminal event openai-python's Responses stream reads instead of
        ``response.completed``. An answer its engine aborted (``wire.endings``) ends so
        too: ``failed`` is in the ``Response.status`` enum openai-python parses and says what
        happened (an error, with its ``error`` object); ``cancelled`` is a client's cancel
        of a background response, which nobody asked for here, and ``incomplete`` a limit's
        cut (``incomplete_details.reason`` has no value for an abort) that reads as a normal
        end."""
        failed = self.response("failed", None, None)
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        if self.text:
            failed["output"] = [self.item("incomplete", self.text)]
        return self.event("error", code=err.code, message=err.message, param=err.param) + (
            self.event("response.failed", response=failed)
        )
