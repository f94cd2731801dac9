"""Where request features meet, in the other dialects: hypothesis draws Anthropic Messages
(``/v1/messages``), Gemini (``generateContent`` / ``streamGenerateContent``) and OpenAI
Responses (``/v1/responses``) requests over the real tiny model (aidreams-260k) through the
real gateway and holds each dialect's version of ``test_cross_features.py``'s invariants.

Drawn, at temperature 0 (so the stream must equal the whole answer):

* Messages: ``max_tokens`` × ``stop_sequences`` × ``system`` (absent, a string, or text blocks)
  × tools with ``tool_choice`` auto / any / tool / none × ``output_config.format``
  json_schema × ``cache_control`` on a block (the system's, the user's, the request's top
  level) × ``cache_salt``.
* Gemini: ``maxOutputTokens`` × ``stopSequences`` × ``candidateCount`` × ``responseMimeType``
  ``application/json`` with or without ``responseSchema`` × tools with every
  ``functionCallingConfig.mode`` (and ``allowedFunctionNames``) × ``systemInstruction``.
* Responses: ``max_output_tokens`` × ``instructions`` × ``text.format`` json_schema /
  json_object × tools with ``tool_choice`` × ``previous_response_id`` of an earlier answer.
* Every dialect: the server (256 KV blocks, or 8: one full context, candidates preempt) and a
  system prompt long enough that the bound is the context's end (or a 400 naming the limit).

Each case is sent twice, whole and streamed. Invariants (``check_*``): never a 5xx; a 400
only for a documented refusal (``ALLOWED_400``), in the dialect's error object and naming the
field (Gemini's ``fieldViolations``, the OpenAI ``param``, Anthropic's message, which has no
``param``, starting with it), the same for both; the stop reason truthful (``max_tokens`` /
``MAX_TOKENS`` / ``incomplete`` exactly when the output reached ``max_tokens`` or the
context's end, ``tool_use`` only with calls, ``stop_sequence`` naming one asked); usage adds up
(Messages: input + cache read + cache creation = the prompt ``count_tokens`` counts; Gemini:
``totalTokenCount`` = prompt + candidates, cached <= prompt; Responses: total = input +
output); no stop sequence in the text; constrained output that finished parses (and
validates), a forced call's input validates; the streamed answer assembled equals the whole
one (text, tool calls, stop reason, output tokens, prompt tokens); the engine idle and its
block pool whole after (blocks pinned by ``cache_control`` breakpoints may stay used).

Profiles per dialect: ``*_fast`` (CI: ``FAST_EXAMPLES``, derandomized) and ``*_long`` (slow
marker, ``LONG_EXAMPLES``). What they found is in ``test_cross_dialects_regressions.py``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import jiter
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import big_and_small_servers, wait_idle  # noqa: E402
from support.schemas import FLAT_SCHEMA as SCHEMA  # noqa: E402
from support.schemas import TIME_PARAMS

MODEL = "aidreams-260k"
MAX_MODEL_LEN = 128  # aidreams' max_position_embeddings
FAST_EXAMPLES = 60  # per dialect
LONG_EXAMPLES = 2000

PROMPTS = ["Tell me", "Once upon a time there was", "A pet, please"]
# the last leaves less than max_tokens of the 128-token context: the bound is its end, or a 400
LONG = "You are a friendly storyteller who tells short tales about cats and dogs. " * 2
SYSTEMS = ["You tell short tales.", "Answer in JSON when asked.", LONG]
STOPS = ["e", "the", ".", "}", '"', "\n", "a "]
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
# Gemini's Schema of SCHEMA (its own type names, no additionalProperties) and what it means
GEMINI_SCHEMA = {
    "type": "OBJECT",
    "properties": {
        "c": {"type": "STRING", "enum": ["red", "green"]},
        "n": {"type": "INTEGER", "minimum": 0, "maximum": 9},
        "ok": {"type": "BOOLEAN"},
    },
    "required": ["c", "n", "ok"],
}
# the tools' parameters in Gemini's Schema
GEMINI_PARAMS = {
    "get_weather": {
        "type": "OBJECT",
        "properties": {
            "city": {"type": "STRING", "maxLength": 6},
            "unit": {"type": "STRING", "enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
    },
    "get_time": {
        "type": "OBJECT",
        "properties": {"tz": {"type": "STRING", "enum": ["UTC", "CET"]}},
        "required": ["tz"],
    },
}
GEMINI_JSON_SCHEMA = {k: v for k, v in SCHEMA.items() if k != "additionalProperties"}


@dataclass
class Case:
    """One drawn request of ``dialect`` (messages | gemini | responses): its JSON body and what
    it constrains."""

    dialect: str
    body: dict[str, Any]
    server: str = "big"  # "big" (256 KV blocks) | "small" (8: one full context; n > 1 preempts)
    constraint: str | None = None  # json_schema | json_object
    tool_mode: str | None = None  # messages: auto/any/tool/none, gemini: AUTO/ANY/NONE, ...
    tools: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    refused: str | None = None  # the field a documented refusal names (None: must be a 200)
    previous: bool = False  # responses: previous_response_id of an earlier answer

    @property
    def forced(self) -> bool:
        """The tool choice makes the answer a call."""
        return self.tool_mode in ("any", "tool", "ANY", "required", "function")


# ---- drawing ------------------------------------------------------------------------------


def _rarely(one_in: int) -> st.SearchStrategy[bool]:
    """True once in ``one_in`` draws (hypothesis draws ``integers(...) == 0`` far more often:
    it favours 0)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


def _tool_names(draw: st.DrawFn) -> list[str]:
    return draw(st.sampled_from([["get_weather"], ["get_time"], ["get_weather", "get_time"]]))


@st.composite
def messages_cases(draw: st.DrawFn) -> Case:
    prompt = draw(st.sampled_from(PROMPTS))
    user: Any = prompt
    cache_at = draw(st.sampled_from([None, "user", "system", "top"]))
    if cache_at == "user":
        user = [{"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": draw(st.integers(1, 60)),
        "temperature": 0,
        "messages": [{"role": "user", "content": user}],
    }
    case = Case("messages", body, draw(st.sampled_from(["big", "small"])))
    system = draw(st.sampled_from([None, "string", "blocks"]))
    if system == "string":
        body["system"] = draw(st.sampled_from(SYSTEMS))
    elif system == "blocks" or cache_at == "system":
        blocks = [{"type": "text", "text": s} for s in SYSTEMS[: draw(st.integers(1, 2))]]
        if cache_at == "system":
            blocks[-1]["cache_control"] = {"type": "ephemeral"}
        body["system"] = blocks
    if cache_at == "top":
        body["cache_control"] = {"type": "ephemeral"}
    if draw(st.integers(0, 3)) == 0:
        case.constraint = "json_schema"
        body["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    # beside a constraint stop sequences are refused: drawn there less, to keep the 200s
    if draw(_rarely(8 if case.constraint else 3)):
        case.stops = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=2, unique=True))
        body["stop_sequences"] = case.stops
    if draw(st.booleans()):
        case.tools = _tool_names(draw)
        body["tools"] = [
            {"name": n, "description": f"{n} tool", "input_schema": PARAMS[n]} for n in case.tools
        ]
        case.tool_mode = draw(st.sampled_from([None, "auto", "any", "tool", "none"]))
        if case.tool_mode == "tool":
            body["tool_choice"] = {"type": "tool", "name": draw(st.sampled_from(case.tools))}
        elif case.tool_mode is not None:
            body["tool_choice"] = {"type": case.tool_mode}
    if draw(st.booleans()):
        body["cache_salt"] = uuid.uuid4().hex
    return case


@st.composite
def gemini_cases(draw: st.DrawFn) -> Case:
    prompt = draw(st.sampled_from(PROMPTS))
    config: dict[str, Any] = {"temperature": 0, "maxOutputTokens": draw(st.integers(1, 60))}
    body: dict[str, Any] = {
        "contents": [{"role": "user", "parts": [{"text": prompt}]}],
        "generationConfig": config,
    }
    case = Case("gemini", body, draw(st.sampled_from(["big", "small"])))
    if draw(st.booleans()):
        config["candidateCount"] = draw(st.integers(1, 3))
    if draw(st.integers(0, 2)) == 0:
        case.stops = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=2, unique=True))
        config["stopSequences"] = case.stops
    fmt = draw(st.sampled_from([None, None, "json_object", "json_schema"]))
    if fmt is not None:
        case.constraint = fmt
        config["responseMimeType"] = "application/json"
        if fmt == "json_schema":
            config["responseSchema"] = GEMINI_SCHEMA
    if draw(st.booleans()):
        body["systemInstruction"] = {"parts": [{"text": draw(st.sampled_from(SYSTEMS))}]}
    if draw(st.booleans()):
        case.tools = _tool_names(draw)
        body["tools"] = [
            {
                "functionDeclarations": [
                    {"name": n, "description": f"{n} tool", "parameters": GEMINI_PARAMS[n]}
                    for n in case.tools
                ]
            }
        ]
        case.tool_mode = draw(st.sampled_from([None, "AUTO", "ANY", "NONE"]))
        if case.tool_mode is not None:
            fc: dict[str, Any] = {"mode": case.tool_mode}
            if case.tool_mode == "ANY" and draw(st.booleans()):
                fc["allowedFunctionNames"] = [draw(st.sampled_from(case.tools))]
            body["toolConfig"] = {"functionCallingConfig": fc}
    return case


@st.composite
def responses_cases(draw: st.DrawFn) -> Case:
    body: dict[str, Any] = {
        "model": MODEL,
        "input": draw(st.sampled_from(PROMPTS)),
        "max_output_tokens": draw(st.integers(1, 60)),
        "temperature": 0,
    }
    case = Case("responses", body, draw(st.sampled_from(["big", "small"])))
    if draw(st.booleans()):
        body["instructions"] = draw(st.sampled_from(SYSTEMS))
    fmt = draw(st.sampled_from([None, None, "json_object", "json_schema"]))
    if fmt == "json_schema":
        case.constraint = fmt
        body["text"] = {
            "format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}
        }
    elif fmt == "json_object":
        case.constraint = fmt
        body["text"] = {"format": {"type": "json_object"}}
    if draw(_rarely(4)):  # refused
        case.tools = _tool_names(draw)
        body["tools"] = [
            {"type": "function", "name": n, "parameters": PARAMS[n], "strict": False}
            for n in case.tools
        ]
        mode = draw(st.sampled_from([None, "auto", "required", "none", "function"]))
        case.tool_mode = mode
        if mode == "function":
            body["tool_choice"] = {"type": "function", "name": case.tools[0]}
        elif mode is not None:
            body["tool_choice"] = mode
    case.previous = draw(_rarely(8))  # refused: rarely, to keep the 200s
    return case


# ---- sending ------------------------------------------------------------------------------


@dataclass
class Answer:
    """One answer, whole or assembled from its stream, in dialect-neutral terms (per
    candidate: text, calls ``(name, arguments object)``, stop reason)."""

    status: int
    error: Any = None  # the dialect's whole error body
    texts: list[str] = field(default_factory=list)
    calls: list[list[tuple[str, Any]]] = field(default_factory=list)
    stops: list[str | None] = field(default_factory=list)
    stop_sequence: str | None = None  # messages
    usage: dict[str, Any] = field(default_factory=dict)
    rid: str | None = None


def _sse(r: httpx.Response) -> list[tuple[str | None, dict[str, Any]]]:
    """``(event name, data)`` of each server-sent event of ``r``."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    name = None
    for line in r.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = line[len("data: ") :]
            if data != "[DONE]":
                out.append((name, json.loads(data)))
            name = None
    return out


def _messages_whole(data: dict[str, Any]) -> Answer:
    text = "".join(b["text"] for b in data["content"] if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in data["content"] if b["type"] == "tool_use"]
    ans = Answer(200, texts=[text], calls=[calls], stops=[data["stop_reason"]])
    ans.stop_sequence, ans.usage = data["stop_sequence"], data["usage"]
    return ans


def _messages_stream(events: list[tuple[str | None, dict[str, Any]]]) -> Answer:
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "error" not in kinds, events
    blocks: dict[int, dict[str, Any]] = {}
    ans = Answer(200, texts=[""], calls=[[]], stops=[None])
    for name, e in events:
        assert name == e["type"], (name, e)
        if e["type"] == "message_start":
            ans.usage = dict(e["message"]["usage"])
        elif e["type"] == "content_block_start":
            block = dict(e["content_block"])
            block["json"] = ""
            blocks[e["index"]] = block
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            else:
                b["json"] += d["partial_json"]
        elif e["type"] == "message_delta":
            ans.stops = [e["delta"]["stop_reason"]]
            ans.stop_sequence = e["delta"]["stop_sequence"]
            ans.usage.update(e["usage"])
    assert sorted(blocks) == list(range(len(blocks))), blocks
    for i in sorted(blocks):
        b = blocks[i]
        if b["type"] == "text":
            ans.texts[0] += b["text"]
        else:
            # as the ``anthropic`` package assembles it: a call cut by max_tokens parses partly
            ans.calls[0].append((b["name"], jiter.from_json(b["json"].encode(), partial_mode=True)))
    return ans


def _gemini_candidates(data: dict[str, Any], ans: Answer, n: int) -> None:
    for c in data.get("candidates") or []:
        i = c.get("index", 0)
        assert 0 <= i < n, data
        for p in (c.get("content") or {}).get("parts") or []:
            if "text" in p:
                ans.texts[i] += p["text"]
            if "functionCall" in p:
                ans.calls[i].append((p["functionCall"]["name"], p["functionCall"].get("args")))
        if c.get("finishReason"):
            assert ans.stops[i] is None, f"candidate {i} finished twice: {data}"
            ans.stops[i] = c["finishReason"]
    if data.get("usageMetadata"):
        ans.usage = data["usageMetadata"]


def _responses_whole(data: dict[str, Any]) -> Answer:
    text, calls = "", []
    for item in data["output"]:
        if item["type"] == "message":
            text += "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
        elif item["type"] == "function_call":
            calls.append((item["name"], json.loads(item["arguments"])))
    ans = Answer(200, texts=[text], calls=[calls], stops=[data["status"]], usage=data["usage"])
    ans.rid = data["id"]
    return ans


def _responses_stream(events: list[tuple[str | None, dict[str, Any]]]) -> Answer:
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    seq = [e["sequence_number"] for _, e in events]
    assert seq == list(range(seq[0], seq[0] + len(seq))), seq
    text = "".join(e["delta"] for _, e in events if e["type"] == "response.output_text.delta")
    final = _responses_whole(events[-1][1]["response"])
    assert final.texts[0] == text, (final, text)
    assert events[-1][1]["response"]["status"] == kinds[-1].split(".")[1]
    return final


class Client:
    """Sends a case whole or streamed to one server; the count of its prompt."""

    def __init__(self, http: httpx.Client, url: str) -> None:
        self.http, self.url = http, url
        self.last_response_id: str | None = None

    def _gemini_url(self, stream: bool) -> str:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return f"{self.url}/v1beta/models/{MODEL}:{method}"

    def send(self, case: Case, stream: bool) -> Answer:
        body = dict(case.body)
        if case.dialect == "gemini":
            url = self._gemini_url(stream)
        else:
            url = f"{self.url}/v1/{case.dialect}"
            if stream:
                body["stream"] = True
        if case.previous:
            body["previous_response_id"] = self.earlier_response_id()
        with self.http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                r.read()
                return Answer(r.status_code, r.json())
            if not stream:
                r.read()
                data = r.json()
                if case.dialect == "messages":
                    return _messages_whole(data)
                if case.dialect == "responses":
                    ans = _responses_whole(data)
                    self.last_response_id = ans.rid
                    return ans
                n = case.body["generationConfig"].get("candidateCount", 1)
                ans = Answer(200, texts=[""] * n, calls=[[] for _ in range(n)], stops=[None] * n)
                _gemini_candidates(data, ans, n)
                return ans
            events = _sse(r)
        for _, e in events:  # a stream cut short by the server
            assert "error" not in e and e.get("type") not in ("error", "response.failed"), e
        if case.dialect == "messages":
            return _messages_stream(events)
        if case.dialect == "responses":
            return _responses_stream(events)
        n = case.body["generationConfig"].get("candidateCount", 1)
        ans = Answer(200, texts=[""] * n, calls=[[] for _ in range(n)], stops=[None] * n)
        for _, e in events:
            _gemini_candidates(e, ans, n)
        return ans

    def earlier_response_id(self) -> str:
        """The id of an earlier Responses answer of this server (one asked for if none yet)."""
        if self.last_response_id is None:
            body = {"model": MODEL, "input": PROMPTS[0], "max_output_tokens": 2}
            r = self.http.post(f"{self.url}/v1/responses", json=body)
            assert r.status_code == 200, r.text
            self.last_response_id = r.json()["id"]
        return self.last_response_id

    def gemini_prompt_tokens(self, case: Case) -> int:
        inner = {**case.body, "model": f"models/{MODEL}"}
        r = self.http.post(
            f"{self.url}/v1beta/models/{MODEL}:countTokens", json={"generateContentRequest": inner}
        )
        assert r.status_code == 200, r.text
        return r.json()["totalTokens"]

    def messages_prompt_tokens(self, case: Case) -> int:
        body = {k: v for k, v in case.body.items() if k not in ("max_tokens", "temperature")}
        body.pop("stop_sequences", None)
        r = self.http.post(f"{self.url}/v1/messages/count_tokens", json=body)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]


# ---- the invariants -----------------------------------------------------------------------


def _names(case: Case, ans: Answer, fields: set[str]) -> bool:
    """The dialect's error object (its shape asserted) names one of ``fields``: Gemini's
    ``fieldViolations``, the OpenAI ``param``; Anthropic's has no ``param``, its message
    names the field (first, ``"field: ..."``, or inside, as the context-length one does)."""
    if case.dialect == "messages":
        err = ans.error
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        message = err["error"]["message"]
        return message.split(":")[0] in fields or any(f in message for f in fields)
    return _error_field(case, ans) in fields


def _error_field(case: Case, ans: Answer) -> str:
    """The field the dialect's error object names (asserting its shape): Gemini, Responses."""
    err = ans.error
    if case.dialect == "gemini":
        e = err["error"]
        assert e["code"] == 400 and e["status"] == "INVALID_ARGUMENT", err
        details = e.get("details") or []
        fields = [v["field"] for d in details for v in d.get("fieldViolations", [])]
        assert fields, f"a Gemini 400 naming no field: {err}"
        return fields[0]
    assert err["error"]["type"] == "invalid_request_error", err
    return err["error"]["param"]


def expected_400(case: Case) -> set[str] | None:
    """The fields one of which a documented refusal of ``case`` names, or None: must be 200.

    Responses: ``tools`` and ``previous_response_id`` are not implemented (refused by name,
    docs of ``local/responses_api.py``). Gemini: stop sequences beside a JSON constraint
    (``wire/stop_strings.py``, as on chat); a JSON response beside tools (docs/gemini.md). Messages
    and Gemini: stop sequences beside a forced call (and Messages' ``output_config.format``)."""
    if case.dialect == "responses":
        refused = set()
        if case.tools:
            refused.add("tools")
        if case.previous:
            refused.add("previous_response_id")
        return refused or None
    if case.dialect == "gemini":
        refused = set()
        if case.stops and case.constraint:
            refused.add("generationConfig.stopSequences")
        if case.constraint and case.tools and case.tool_mode != "NONE":
            refused.add("generationConfig.responseMimeType")
        if case.stops and case.forced:
            refused.add("generationConfig.stopSequences")
        return refused or None
    refused = set()
    if case.stops and (case.forced or case.constraint):
        refused.add("stop_sequences")
    if case.constraint and case.forced:  # one output constraint per request
        refused.add("output_config.format")
    return refused or None


def _limit(case: Case) -> int:
    if case.dialect == "gemini":
        return case.body["generationConfig"]["maxOutputTokens"]
    return case.body["max_tokens" if case.dialect == "messages" else "max_output_tokens"]


def _over_context(case: Case, ans: Answer) -> bool:
    """The 400 says the prompt + the output limit do not fit the context."""
    return "maximum context length" in json.dumps(ans.error)


def _room(prompt_tokens: int, max_tokens: int) -> int:
    return min(max_tokens, MAX_MODEL_LEN - prompt_tokens)


def check_answer(case: Case, ans: Answer, prompt_tokens: int | None, how: str) -> None:
    where = f"{how}: {ans}"
    assert ans.status < 500, where
    refused = expected_400(case)
    limit = {"messages": "max_tokens", "gemini": "generationConfig.maxOutputTokens"}
    limit_field = limit.get(case.dialect, "max_output_tokens")
    if ans.status == 400 and not refused and _over_context(case, ans):
        # prompt + the output limit over the context: 400 context_length_exceeded
        assert prompt_tokens is None or prompt_tokens + _limit(case) > MAX_MODEL_LEN, where
        assert _names(case, ans, {limit_field}), where
        return
    if ans.status != 200 or refused:
        assert ans.status == 400, f"expected a 400 naming one of {refused}: {where}"
        assert refused and _names(case, ans, refused), f"a 400 naming none of {refused}: {where}"
        return
    u = ans.usage
    if case.dialect == "messages":
        max_tokens = case.body["max_tokens"]
        parts = [u["input_tokens"], u["cache_read_input_tokens"], u["cache_creation_input_tokens"]]
        assert min(parts) >= 0 and sum(parts) == prompt_tokens, (prompt_tokens, where)
        outs = [u["output_tokens"]]
        stop_words = {"max_tokens": "max", "end_turn": "end", "stop_sequence": "seq"}
        stop_words["tool_use"] = "tool"
    elif case.dialect == "gemini":
        max_tokens = case.body["generationConfig"]["maxOutputTokens"]
        assert u["promptTokenCount"] == prompt_tokens, (prompt_tokens, where)  # countTokens
        assert u["totalTokenCount"] == prompt_tokens + u["candidatesTokenCount"], where
        assert 0 <= u.get("cachedContentTokenCount", 0) <= prompt_tokens, where
        outs = [u["candidatesTokenCount"]] if len(ans.texts) == 1 else []
        stop_words = {"MAX_TOKENS": "max", "STOP": "end"}
        room = _room(prompt_tokens, max_tokens)
        assert u["candidatesTokenCount"] <= room * len(ans.texts), where
        if all(s == "MAX_TOKENS" for s in ans.stops):
            assert u["candidatesTokenCount"] == room * len(ans.texts), where
    else:
        max_tokens = case.body["max_output_tokens"]
        prompt_tokens = u["input_tokens"]
        assert u["total_tokens"] == prompt_tokens + u["output_tokens"], where
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        assert 0 <= cached <= prompt_tokens, where
        outs = [u["output_tokens"]]
        stop_words = {"incomplete": "max", "completed": "end"}
    room = _room(prompt_tokens, max_tokens)
    for i, (text, calls, stop) in enumerate(zip(ans.texts, ans.calls, ans.stops, strict=True)):
        assert stop in stop_words, f"candidate {i}'s stop reason {stop!r}: {where}"
        kind = stop_words[stop]
        if outs:
            assert 1 <= outs[i] <= room, (room, where)
            if kind == "max":
                assert outs[i] == room, f"{stop} short of {room} tokens: {where}"
            else:
                assert outs[i] <= room, where
        if kind == "tool":
            assert calls, where
        if calls:
            assert case.tools and case.tool_mode not in ("none", "NONE"), where
            assert case.dialect != "messages" or kind in ("tool", "max"), where
            for name, args in calls:
                assert name in case.tools, where
                if kind != "max":
                    jsonschema.validate(args, PARAMS[name])
        if case.forced and kind != "max":
            assert calls and not text.strip(), f"a forced call answered otherwise: {where}"
        if case.dialect == "messages" and stop == "stop_sequence":
            assert ans.stop_sequence in case.stops, where
        for s in case.stops:
            assert s not in text, f"stop sequence {s!r} in the text: {where}"
        if case.constraint and kind == "end":
            try:
                value = json.loads(text)
                assert isinstance(value, dict), text
                if case.constraint == "json_schema":
                    schema = GEMINI_JSON_SCHEMA if case.dialect == "gemini" else SCHEMA
                    jsonschema.validate(value, schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(
                    f"finished constrained answer invalid ({exc}): {where}"
                ) from None


def check_case(case: Case, server, client: Client, pool_whole) -> None:
    """Send ``case`` whole and streamed; every invariant of the module docstring."""
    prompt = None
    if case.dialect == "messages" and expected_400(case) is None:
        prompt = client.messages_prompt_tokens(case)
    elif case.dialect == "gemini" and expected_400(case) is None:
        prompt = client.gemini_prompt_tokens(case)
    whole = client.send(case, stream=False)
    check_answer(case, whole, prompt, "whole")
    streamed = client.send(case, stream=True)
    check_answer(case, streamed, prompt, "stream")
    assert whole.status == streamed.status, (whole, streamed)
    if whole.status == 200:
        assert (streamed.texts, streamed.calls, streamed.stops, streamed.stop_sequence) == (
            whole.texts,
            whole.calls,
            whole.stops,
            whole.stop_sequence,
        ), f"stream != whole:\n{whole}\n{streamed}"
        keys = {
            "messages": ["output_tokens"],
            "gemini": ["promptTokenCount", "candidatesTokenCount", "totalTokenCount"],
            "responses": ["input_tokens", "output_tokens", "total_tokens"],
        }[case.dialect]
        assert [streamed.usage[k] for k in keys] == [whole.usage[k] for k in keys], (
            whole.usage,
            streamed.usage,
        )
    # cache_control breakpoints pin their blocks (for the TTL): those may stay used
    wait_idle(server, pool_whole, pinned_ok=True)


servers = big_and_small_servers(MODEL)


@pytest.fixture(scope="module")
def clients(servers):
    with httpx.Client(timeout=60) as http:
        yield {name: Client(http, srv.url) for name, srv in servers.items()}


_COMMON = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(case=messages_cases())
def test_cross_messages_fast(servers, clients, pool_whole, case):
    check_case(case, servers[case.server], clients[case.server], pool_whole)


@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(case=gemini_cases())
def test_cross_gemini_fast(servers, clients, pool_whole, case):
    check_case(case, servers[case.server], clients[case.server], pool_whole)


@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
@given(case=responses_cases())
def test_cross_responses_fast(servers, clients, pool_whole, case):
    check_case(case, servers[case.server], clients[case.server], pool_whole)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # thousands of cases: past the suite's per-test limit
@settings(max_examples=LONG_EXAMPLES, **_COMMON)
@given(case=st.one_of(messages_cases(), gemini_cases(), responses_cases()))
def test_cross_dialects_long(servers, clients, pool_whole, case):
    check_case(case, servers[case.server], clients[case.server], pool_whole)
