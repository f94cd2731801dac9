"""Tool calling for chat completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

- ``tool_choice="none"``: tools are not shown to the model, its answer is text.
- ``"auto"`` (the default when tools are given): the chat template receives ``tools``; the
  answer is parsed by the server's ``--tool-call-parser`` (``tool_parsers.py``). When a tool
  has ``"strict": true``, the answer is constrained by the parser's xgrammar structural tag:
  free text until the format's trigger (``<tool_call>``, ``[TOOL_CALLS]``), then a call whose
  name is one of the tools and whose arguments follow a strict tool's ``parameters`` (a
  non-strict tool's are any JSON object). A format without a trigger (``llama3_json``) cannot
  honour it: 400 naming ``tools[i].function.strict``.
- ``"required"`` and a named function: constrained decoding (xgrammar) to a tool-call JSON
  that matches the functions' parameter schemas, as vLLM does: for ``"required"`` an array
  (``minItems`` 1, ``maxItems`` 1 without ``parallel_tool_calls``) of ``{"name": <one of the
  tools>, "parameters": <that tool's schema>}``; for a named function its parameters object.

Responses carry ``message.tool_calls`` (``id``, ``type``, ``function.name``,
``function.arguments`` as a JSON string) and ``finish_reason: "tool_calls"``; streams carry
``delta.tool_calls`` fragments with ``index``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from prefixgate.engine.sampling_params import StructuredOutputsParams
from prefixgate.gateway.api.tool_parsers import ToolCall, ToolStream
from prefixgate.gateway.http.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools.

    Attributes:
        mode: ``"none"`` (no tools), ``"auto"``, ``"required"`` or ``"named"``.
        tools: the request's tools (OpenAI shape) passed to the chat template (empty with
            ``"none"``).
        named: the forced function's name (mode ``"named"``).
        structured: the constraint for ``"required"`` / ``"named"``, and for ``"auto"`` with a
            strict tool (the parser's structural tag).
        parser: the ``--tool-call-parser`` instance for ``"auto"``.
        parallel: ``parallel_tool_calls`` (False: at most one call is returned in "auto"
            mode; "required" is constrained to one).
    """

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)
    named: str | None = None
    structured: StructuredOutputsParams | None = None
    parser: Any = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Validate ``tools``: function tools with a valid name and a JSON-schema ``parameters``.

    Raises:
        APIError: 400 naming ``tools[i]...``.
    """
    if not tools:  # the usual chat: no xgrammar (and torch) import on the event loop
        return []
    from prefixgate.engine.structured_output import check_schema  # noqa: PLC0415 - needs xgrammar

    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function: an object is required", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name: must match ^[a-zA-Z0-9_-]{{1,64}}$",
                param=f"{where}.function.name",
            )
        if name in names:
            raise bad_request(f"{where}.function.name: duplicate name {name!r}", param=where)
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(
                f"{where}.function.parameters: must be a JSON schema (an object)",
                param=f"{where}.function.parameters",
            )
        try:
            check_schema(params)
        except ValueError as exc:
            raise bad_request(
                f"{where}.function.parameters: {exc}", param=f"{where}.function.parameters"
            ) from None
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                f"{where}.function.strict: must be a boolean", param=f"{where}.function.strict"
            )
        out.append(
            {"type": "function", "function": {**fn, "parameters": params}},
        )
    return out


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser_name: str | None,
) -> ToolPlan:
    """Decide how the request's tools are used (see the module docstring).

    Raises:
        APIError: 400 naming the field: a bad tool, a ``tool_choice`` naming a function that
            is not in ``tools``, ``tool_choice`` without tools, ``"auto"`` on a server without
            ``--tool-call-parser``, a strict tool under ``"auto"`` with a parser whose format
            has no trigger (``tools[i].function.strict``).
    """
    checked = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(
                f"tool_choice: must be 'none', 'auto', 'required' or a named function, got "
                f"{tool_choice[:80]!r}",
                param="tool_choice",
            )
        mode = tool_choice
        named = None
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        mode, named = "named", tool_choice["function"]["name"]
    else:
        raise bad_request(
            "tool_choice: must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if mode == "none":
        return ToolPlan()
    if not checked:
        raise bad_request(f"tool_choice: {tool_choice!r} needs tools", param="tool_choice")
    by_name = {t["function"]["name"]: t["function"] for t in checked}
    if mode == "named":
        if named not in by_name:
            raise bad_request(
                f"tool_choice: function {str(named)[:80]!r} is not among the tools "
                f"({', '.join(sorted(by_name))})",
                param="tool_choice",
            )
        spec = StructuredOutputsParams(json=by_name[named]["parameters"])
        return ToolPlan("named", checked, named, spec)
    if mode == "required":
        items = {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": fn["parameters"],
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, fn in by_name.items()
            ],
        }
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", checked, None, StructuredOutputsParams(json=schema))
    if parser_name is None:
        raise bad_request(
            "tool_choice: 'auto' needs a server started with --tool-call-parser "
            "(hermes, llama3_json, mistral); use 'required' or a named function instead",
            param="tool_choice",
        )
    from prefixgate.gateway.api.tool_parsers import get_parser  # noqa: PLC0415

    parser = get_parser(parser_name)
    parallel = parallel_tool_calls is not False
    strict = [i for i, t in enumerate(checked) if t["function"].get("strict") is True]
    structured = None
    if strict:
        tag = parser.structural_tag(checked, parallel)
        if tag is None:
            where = f"tools[{strict[0]}].function.strict"
            raise bad_request(
                f"{where}: strict tools cannot be honoured with tool_choice 'auto' on this "
                f"server's tool-call parser {parser_name!r} (its format has no trigger before "
                "which free text may come, so the call cannot be constrained); use "
                "tool_choice 'required' or a named function, or strict: false",
                param=where,
            )
        structured = StructuredOutputsParams(structural_tag=tag)
    return ToolPlan("auto", checked, None, structured, parser, parallel)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages for the template: assistant ``tool_calls`` with their ``arguments``
    as objects (templates index into them; vLLM does the same), ``tool`` messages with their
    ``tool_call_id``."""
    out = []
    for m in messages:
        d = m.as_dict()
        calls = d.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = json.loads(json.dumps(call))
                fn = call.get("function") or {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                fixed.append(call)
            d["tool_calls"] = fixed
        out.append(d)
    return out


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole answer → ``(content or None, tool calls)``."""
    if plan.mode == "named":
        return None, [ToolCall(plan.named or "", text)]
    if plan.mode == "required":
        calls = RequiredStream().feed(text)
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto":
        content, calls = plan.parser.split(text, True)
        if not plan.parallel:
            calls = calls[:1]
        return (content if content or not calls else None), calls
    return text, []


class RequiredStream:
    """Complete ``{"name", "parameters"}`` elements of a streamed (constrained) array."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.start = -1

    def feed(self, delta: str) -> list[ToolCall]:
        """Add text; return the calls whose object closed in it."""
        self.text += delta
        calls: list[ToolCall] = []
        text = self.text
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.start = i
            elif ch in "]}":
                if self.depth == 2 and ch == "}" and self.start >= 0:
                    try:
                        obj = json.loads(text[self.start : i + 1])
                    except ValueError:
                        obj = None
                    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                        args = obj.get("parameters", {})
                        calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
                    self.start = -1
                self.depth -= 1
        self.pos = len(text)
        return calls


class ToolDeltas:
    """A streamed choice's ``delta`` objects under a ``ToolPlan``: ``feed(delta_text)`` and
    ``finish()`` return the deltas to send (``{"content": ...}`` and/or ``{"tool_calls":
    [...]}``), with each call's ``index`` as OpenAI streams them (name and id in its first
    fragment, ``arguments`` in pieces)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._named_started = False
        self._required = RequiredStream() if plan.mode == "required" else None
        self._auto = ToolStream(plan.parser) if plan.mode == "auto" else None

    @property
    def called(self) -> bool:
        """True once a tool call was sent (finish reason ``"tool_calls"``)."""
        return self.num_calls > 0

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            out = []
            if not self._named_started:
                self._named_started = True
                call = ToolCall(self.plan.named or "", "")
                out.append(self._call_delta(call, first=True, arguments=""))
                self.num_calls = 1
            if delta_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            return out
        if self._required is not None:
            return [self._call_delta(c) for c in self._required.feed(delta_text)]
        if self._auto is not None:
            content, calls = self._auto.feed(delta_text)
            return self._auto_deltas(content, calls)
        return [{"content": delta_text}] if delta_text else []

    def finish(self) -> list[dict[str, Any]]:
        if self._auto is not None:
            content, calls = self._auto.finish()
            return self._auto_deltas(content, calls)
        if self.plan.mode == "named" and not self._named_started:
            return self.feed("")
        return []

    def _auto_deltas(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        out += [self._call_delta(c) for c in calls]
        return out

    def _call_delta(
        self, call: ToolCall, first: bool = True, arguments: str | None = None
    ) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        return {
            "tool_calls": [
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments if arguments is None else arguments,
                    },
                }
            ]
        }
