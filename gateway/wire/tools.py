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
  that matches the functions' parameter schemas. The constraint spends no token on what the
  request already decides (``ToolPlan.shape``):

  - ``"arguments"``: a named function, or ``"required"`` with one tool (whatever
    ``parallel_tool_calls``: one tool is exactly one call, as pydantic-ai's output tool):
    the text is the parameters object itself, the call by name;
  - ``"call"``: ``"required"`` with several tools and ``parallel_tool_calls: false``: one
    ``{"name": <one of the tools>, "parameters": <that tool's schema>}`` object, no array;
  - ``"calls"``: ``"required"`` with several tools and parallel calls: an array
    (``minItems`` 1) of such objects, as vLLM does.

  The text is never content: a cut answer (``finish_reason: "length"``, or a stop string)
  returns the call(s) started so far (a started call with the arguments written so far, a
  ``"calls"`` array its complete items) and ``content: null``, never the internal JSON. The
  finish reason is ``"tool_calls"`` only when the constrained JSON is complete; streams and
  whole answers go through the same ``ConstrainedCalls`` state machine, so they agree in
  every case (content, calls, finish reason).

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
from prefixgate.gateway.http.errors import bad_request
from prefixgate.gateway.wire.tool_parsers import ToolCall, ToolStream

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ChoiceWords:
    """How a dialect spells the tool choice, for ``plan_tools``' refusals and advice:
    ``field`` (the request's field), and its spelling of the modes ``auto``, ``required``
    (some call) and ``named`` (one function's call)."""

    field: str
    auto: str
    required: str
    named: str

    def mode(self, mode: str) -> str:
        """The dialect's spelling of a chat mode (``auto``, ``required``, ``named``)."""
        return {"auto": self.auto, "required": self.required, "named": self.named}[mode]


OPENAI_CHOICE = ChoiceWords("tool_choice", "'auto'", "'required'", "a named function")
ANTHROPIC_CHOICE = ChoiceWords(
    "tool_choice",
    '{"type": "auto"} (the default with tools)',
    '{"type": "any"}',
    '{"type": "tool", "name": ...}',
)
GEMINI_CHOICE = ChoiceWords(
    "toolConfig.functionCallingConfig.mode",
    "AUTO (the default with tools)",
    "ANY",
    "ANY with allowedFunctionNames",
)


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
        shape: what the constrained text of ``"required"`` / ``"named"`` is (module
            docstring): ``"arguments"`` (the call's parameters; ``named`` is its function),
            ``"call"`` (one ``{"name", "parameters"}`` object) or ``"calls"`` (an array of
            them); ``None`` for ``"none"`` / ``"auto"``.
    """

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)
    named: str | None = None
    structured: StructuredOutputsParams | None = None
    parser: Any = None
    parallel: bool = True
    shape: str | None = None

    def __post_init__(self) -> None:
        if self.mode == "named" and self.shape is None:
            self.shape = "arguments"  # a named function's text is its arguments

    @property
    def active(self) -> bool:
        return self.mode != "none"


_TOOL_KEYS = {"type", "function"}  # openai's ChatCompletionFunctionToolParam
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}  # its FunctionDefinition


def _refuse_unknown(obj: dict[str, Any], known: set[str], where: str) -> None:
    """400 naming the first key of ``obj`` not in ``known`` (never ignored: e.g. a
    ``cache_control`` on a tool, which OpenAI's tools do not take)."""
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        name = f"{where}.{unknown[0][:80]}"
        hint = (
            " (a cache breakpoint goes on a message's text part)"
            if unknown[0] == "cache_control"
            else ""
        )
        raise bad_request(f"Unrecognized request argument supplied: {name}{hint}", param=name)


def check_tools(tools: list[Any] | None, schemas: bool = True) -> list[dict[str, Any]]:
    """Validate ``tools``: function tools with a valid name and a JSON-schema ``parameters``
    (each schema against its metaschema and the grammar's features unless ``schemas`` is
    False: the form alone, which needs no engine package).

    Raises:
        APIError: 400 naming ``tools[i]...`` (an unknown key of a tool or its function too).
    """
    if not tools:  # the usual chat: no xgrammar (and torch) import on the event loop
        return []
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}: only tools of type 'function' are supported", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function: an object is required", param=f"{where}.function")
        _refuse_unknown(tool, _TOOL_KEYS, where)
        _refuse_unknown(fn, _FUNCTION_KEYS, f"{where}.function")
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
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                f"{where}.function.strict: must be a boolean", param=f"{where}.function.strict"
            )
        out.append(
            {"type": "function", "function": {**fn, "parameters": params}},
        )
    if schemas:
        from prefixgate.engine.structured_output import check_schema  # noqa: PLC0415 - xgrammar

        for i, tool in enumerate(out):
            try:
                check_schema(tool["function"]["parameters"])
            except ValueError as exc:
                where = f"tools[{i}].function.parameters"
                raise bad_request(f"{where}: {exc}", param=where) from None
    return out


def choose_tool(
    tools: list[Any] | None,
    tool_choice: Any,
    words: ChoiceWords = OPENAI_CHOICE,
    schemas: bool = True,
) -> tuple[list[dict[str, Any]], str, str | None]:
    """``(checked tools, mode, named function)`` of a request: ``mode`` one of ``"none"``,
    ``"auto"``, ``"required"``, ``"named"`` (an absent ``tool_choice``: ``"auto"`` with tools,
    else ``"none"``). Needs no server setting (the tool-call parser is ``plan_tools``' part);
    ``schemas`` as ``check_tools``.

    Raises:
        APIError: 400 naming the field: a bad tool, a ``tool_choice`` of another form, one
            naming a function that is not in ``tools``, a ``tool_choice`` without tools.
    """
    checked = check_tools(tools, schemas)
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
        return checked, mode, None
    if not checked:
        raise bad_request(f"{words.field}: {words.mode(mode)} needs tools", param=words.field)
    if mode == "named" and named not in {t["function"]["name"] for t in checked}:
        raise bad_request(
            f"tool_choice: function {str(named)[:80]!r} is not among the tools "
            f"({', '.join(sorted(t['function']['name'] for t in checked))})",
            param="tool_choice",
        )
    return checked, mode, named


def prompt_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The tools a chat's prompt declares, as ``plan_tools`` renders them: none under
    ``tool_choice`` ``"none"`` (the model is not to call one), else all of ``tools``. For a
    prompt counted elsewhere (proxy mode's ``/tokenize`` body), so it counts what local mode
    renders."""
    return [] if tool_choice == "none" else list(tools or [])


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser_name: str | None,
    words: ChoiceWords = OPENAI_CHOICE,
) -> ToolPlan:
    """Decide how the request's tools are used (see the module docstring); ``words``: the
    client's dialect's spelling of the tool choice, for the refusals' advice
    (``ANTHROPIC_CHOICE``, ``GEMINI_CHOICE``).

    Raises:
        APIError: 400 naming the field: a bad tool, a ``tool_choice`` naming a function that
            is not in ``tools``, ``tool_choice`` without tools, ``"auto"`` on a server without
            ``--tool-call-parser``, a strict tool under ``"auto"`` with a parser whose format
            has no trigger (``tools[i].function.strict``).
    """
    checked, mode, named = choose_tool(tools, tool_choice, words)
    if mode == "none":
        return ToolPlan()
    by_name = {t["function"]["name"]: t["function"] for t in checked}
    if mode == "named":
        spec = StructuredOutputsParams(json=by_name[named]["parameters"])
        return ToolPlan("named", checked, named, spec, shape="arguments")
    if mode == "required":
        if len(by_name) == 1:  # exactly the call by name: no wrapper spends the budget
            (only,) = by_name
            spec = StructuredOutputsParams(json=by_name[only]["parameters"])
            return ToolPlan("required", checked, only, spec, parallel=False, shape="arguments")
        call = {
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
        if parallel_tool_calls is False:  # one call: the object alone, no array around it
            spec = StructuredOutputsParams(json=call)
            return ToolPlan("required", checked, None, spec, parallel=False, shape="call")
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
        spec = StructuredOutputsParams(json=schema)
        return ToolPlan("required", checked, None, spec, shape="calls")
    if parser_name is None:
        raise bad_request(
            f"{words.field}: {words.auto} needs a server started with --tool-call-parser "
            f"(hermes, llama3_json, mistral); use {words.required} or {words.named} instead",
            param=words.field,
        )
    from prefixgate.gateway.wire.tool_parsers import get_parser  # noqa: PLC0415

    parser = get_parser(parser_name)
    parallel = parallel_tool_calls is not False
    strict = [i for i, t in enumerate(checked) if t["function"].get("strict") is True]
    structured = None
    if strict:
        tag = parser.structural_tag(checked, parallel)
        if tag is None:
            where = f"tools[{strict[0]}].function.strict"
            raise bad_request(
                f"{where}: strict tools cannot be honoured with {words.field} {words.auto} "
                f"on this server's tool-call parser {parser_name!r} (its format has no trigger before "
                "which free text may come, so the call cannot be constrained); use "
                f"{words.field} {words.required} or {words.named}, or strict: false",
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
    """The whole answer → ``(content or None, tool calls)``. A constrained plan
    (``"required"`` / ``"named"``) never has content; its calls are what a stream of the same
    text sends (``ConstrainedCalls``), complete or not."""
    if plan.shape is not None:
        stream = ConstrainedCalls(plan)
        stream.feed(text)
        stream.finish()
        return None, stream.calls
    if plan.mode == "auto":
        content, calls = plan.parser.split(text, True)
        if not plan.parallel:
            calls = calls[:1]
        return (content if content or not calls else None), calls
    return text, []


def tool_finish_reason(
    plan: ToolPlan, text: str, calls: list[ToolCall], finish: str | None
) -> str | None:
    """The finish reason of a whole answer with tools: ``"stop"`` becomes ``"tool_calls"``
    when it returned calls (for a constrained plan: when its JSON is complete, so an answer
    a stop string cut keeps ``"stop"``); other reasons pass through."""
    if finish != "stop" or not calls:
        return finish
    if plan.shape is not None:
        try:
            json.loads(text)
        except ValueError:
            return finish
    return "tool_calls"


class _Brackets:
    """The bracket depth of JSON text read one character at a time, strings skipped."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escape = False

    def step(self, ch: str) -> int:
        """Read ``ch``: +1 for an opening bracket outside a string (``depth`` already raised),
        -1 for a closing one (``depth`` already lowered), else 0."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return 0
        if ch == '"':
            self._in_string = True
        elif ch in "[{":
            self.depth += 1
            return 1
        elif ch in "]}":
            self.depth -= 1
            return -1
        return 0


class RequiredStream:
    """Complete ``{"name", "parameters"}`` elements of a streamed (constrained) array."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self._brackets = _Brackets()
        self.start = -1

    def feed(self, delta: str) -> list[ToolCall]:
        """Add text; return the calls whose object closed in it."""
        self.text += delta
        calls: list[ToolCall] = []
        text = self.text
        for i in range(self.pos, len(text)):
            ch = text[i]
            move = self._brackets.step(ch)
            if move > 0 and self._brackets.depth == 2 and ch == "{":
                self.start = i
            elif move < 0 and self._brackets.depth == 1 and ch == "}" and self.start >= 0:
                try:
                    obj = json.loads(text[self.start : i + 1])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    args = obj.get("parameters", {})
                    calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
                self.start = -1
        self.pos = len(text)
        return calls


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


class ConstrainedCalls:
    """The calls of a constrained answer (``ToolPlan.shape``), streamed: ``feed(delta)`` and
    ``finish()`` return fragments ``{"index", "name"?, "id"?, "arguments"}`` (a call's first
    fragment has its name and id); ``calls`` holds the calls so far with their arguments as
    sent. A whole answer is ``feed(text)`` then ``finish()``, so both agree by construction.

    - ``"arguments"``: call 0 (``plan.named``) opens at once; every piece of text is
      arguments.
    - ``"call"``: the call opens when ``{"name": "<name>", "parameters": `` is complete;
      then the parameters value is sent as it is written (an object or array up to its
      closing bracket; any other value at the end), never the wrapper's closing brace.
    - ``"calls"``: each array item is sent when it closes (``RequiredStream``); an item cut
      off is not sent.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.shape = plan.shape
        self.named = plan.named or ""
        self.text = ""
        self.calls: list[ToolCall] = []
        self._items = RequiredStream() if plan.shape == "calls" else None
        self._value_start = -1  # "call": where the parameters value starts in text
        self._value_end = -1  # ... and ends (exclusive) once closed
        self._scan = 0
        self._sent = 0  # "call": characters of text sent as arguments
        self._brackets = _Brackets()

    @property
    def complete(self) -> bool:
        """The constrained JSON is whole (then the finish reason may be ``"tool_calls"``)."""
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return bool(self.calls)

    def _open(self, name: str) -> dict[str, Any]:
        call = ToolCall(name, "")
        self.calls.append(call)
        return {"index": len(self.calls) - 1, "id": call.id, "name": name, "arguments": ""}

    def _args(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        self.calls[-1].arguments += piece
        return [{"index": len(self.calls) - 1, "arguments": piece}]

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Add text; the fragments it completes."""
        self.text += delta
        if self.shape == "arguments":
            out = [self._open(self.named)] if not self.calls else []
            return out + self._args(delta)
        if self._items is not None:
            out = []
            for call in self._items.feed(delta):
                self.calls.append(call)
                frag = {"index": len(self.calls) - 1, "id": call.id, "name": call.name}
                out.append({**frag, "arguments": call.arguments})
            return out
        return self._feed_call()

    def _feed_call(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self.text
        if self._value_start < 0:
            m = _CALL_HEAD.match(text)
            if m is None or m.end() == len(text):  # the value's first character decides
                return out
            try:
                name = json.loads(m.group(1))
            except ValueError:
                return out
            out.append(self._open(name))
            self._value_start = self._scan = self._sent = m.end()
        if text[self._value_start] not in "[{":  # a scalar: its end is known at the end
            return out
        i = self._scan
        while i < len(text) and self._value_end < 0:
            if self._brackets.step(text[i]) < 0 and self._brackets.depth == 0:
                self._value_end = i + 1
            i += 1
        self._scan = i
        upto = self._value_end if self._value_end >= 0 else len(text)
        out += self._args(text[self._sent : upto])
        self._sent = max(self._sent, upto)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The end of the answer: a named call that never opened, a scalar value's text."""
        if self.shape == "arguments" and not self.calls:
            return [self._open(self.named)]
        if self.shape == "call" and self._value_start < 0:
            m = _CALL_HEAD.match(self.text)
            if m is not None:  # the head only, cut before its value
                try:
                    return [self._open(json.loads(m.group(1)))]
                except ValueError:
                    return []
        if self.shape == "call" and self._value_start >= 0 and self._value_end < 0:
            if self.text[self._value_start] not in "[{":
                rest = self.text[self._sent :].rstrip()
                rest = rest[:-1].rstrip() if rest.endswith("}") else rest
                self._sent = len(self.text)
                return self._args(rest)
        return []


class ToolDeltas:
    """A streamed choice's ``delta`` objects under a ``ToolPlan``: ``feed(delta_text)`` and
    ``finish()`` return the deltas to send (``{"content": ...}`` and/or ``{"tool_calls":
    [...]}``), with each call's ``index`` as OpenAI streams them (name and id in its first
    fragment, ``arguments`` in pieces)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._constrained = ConstrainedCalls(plan) if plan.shape is not None else None
        self._auto = ToolStream(plan.parser) if plan.mode == "auto" else None

    @property
    def called(self) -> bool:
        """True once a tool call was sent and, for a constrained plan, its JSON is complete
        (then finish reason ``"stop"`` becomes ``"tool_calls"``)."""
        if self._constrained is not None:
            return self._constrained.complete
        return self.num_calls > 0

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if self._constrained is not None:
            return [self._fragment(f) for f in self._constrained.feed(delta_text)]
        if self._auto is not None:
            content, calls = self._auto.feed(delta_text)
            return self._auto_deltas(content, calls)
        return [{"content": delta_text}] if delta_text else []

    def finish(self) -> list[dict[str, Any]]:
        if self._auto is not None:
            content, calls = self._auto.finish()
            return self._auto_deltas(content, calls)
        if self._constrained is not None:
            return [self._fragment(f) for f in self._constrained.finish()]
        return []

    def _fragment(self, frag: dict[str, Any]) -> dict[str, Any]:
        """A ``ConstrainedCalls`` fragment as a delta (a call's first one with id and type)."""
        self.num_calls = max(self.num_calls, frag["index"] + 1)
        if "name" not in frag:
            fn = {"arguments": frag["arguments"]}
            return {"tool_calls": [{"index": frag["index"], "function": fn}]}
        fn = {"name": frag["name"], "arguments": frag["arguments"]}
        return {
            "tool_calls": [
                {"index": frag["index"], "id": frag["id"], "type": "function", "function": fn}
            ]
        }

    def _auto_deltas(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        out += [self._call_delta(c) for c in calls]
        return out

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        fn = {"name": call.name, "arguments": call.arguments}
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": fn}]}
