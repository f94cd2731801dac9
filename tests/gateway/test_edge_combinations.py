"""A property test over combinations at the gateway's edge: every dialect × stream on/off ×
prefix-cache controls × sampling fields (implemented or not) × tool and structured-output
fields × malformed pieces × the key (unlimited, rate-limited, concurrency-bound, wrong) and a
TTFT budget, in local mode and through a proxy in front of a prefixgate upstream.

Drawn per example: the dialect's route (OpenAI chat, Responses, Anthropic Messages and
``count_tokens``, Gemini ``generateContent`` / ``streamGenerateContent`` / ``countTokens``),
``stream`` (a third of streams left by the client after their first bytes), a cache control
(OpenAI ``prompt_cache_key`` / ``prompt_cache_retention`` / ``prompt_cache_options`` / a part's
breakpoint / ``prefix_id``, the key's own, another key's or unknown; Anthropic ``cache_control``
on system, a message block, a tool or the top level; Gemini ``cachedContent``), sampling fields,
tools or a structured output, an empty top-level field (empty is absent), and at most one defect
(a wrong type, an empty conversation, an unknown role, ``max_tokens`` over the context, a field
not implemented or unknown, a bad cache control). Each draw is sent with a key (unlimited; 1 in
flight and a 2-block pin share; 2 requests a minute; unknown) and, sometimes, a TTFT budget the
fake engine's prediction (3 s) exceeds, one within it, or a malformed one.

Invariants, for every draw (``check_answer``):

- the answer is a success in the dialect's shape or the dialect's own error object, whose
  status (and Anthropic's error type, Gemini's ``code`` and ``status``) matches the HTTP status;
- never a 5xx; an unknown key is a 401; a draw with no defect, an unlimited key and no budget
  is a 200; a defect is a 400 naming its field; a 404 only for a prefix / cache not the key's;
  a 429 only for a limited key or a budget below the prediction;
- a stream ends with the dialect's terminator or an explicit error event, never cut silently;
- a 429 has ``Retry-After`` in [1, 600] and >= ceil(``retry-after-ms`` / 1000), and a
  ``x-prefixgate-promise-ms`` (when sent) that is a positive whole number;
- after each example the engines are idle with their KV pools whole (no block used but live
  pins), the admission queue, the in-flight counts and the keys' concurrency are 0, and no
  client connection is left open (``check_quiet``).

Across modes (``test_proxy_answers_as_local``): the proxy in front of a prefixgate upstream gives
the same status and the same error shape as local mode for the same request (the unlimited key,
no budget), Responses included (``proxy/responses_relay.py``). ``EDGE_EXAMPLES`` examples per test (derandomized; 60 by
default, about 5 s each). What it found is in docs/request-guards.md.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefixgate.gateway.app import create_app, create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.ttft_budget import BUDGET_HEADER
from support.fake_engine import FakeEngine, wait_idle
from support.fuzz import live_server_settings

EXAMPLES = int(os.environ.get("EDGE_EXAMPLES", "60"))
MODEL = "fake"
MAX_MODEL_LEN = 256
PREDICTED_TTFT_S = 3.0  # what the engines predict: a budget below it is refused
OPEN_KEY, TIGHT_KEY, SLOW_KEY, WRONG_KEY = "k-open", "k-tight", "k-slow", "k-wrong"
KEYS = {
    "keys": [
        {"key": OPEN_KEY, "name": "open"},
        {
            "key": TIGHT_KEY,
            "name": "tight",
            "requests_per_minute": 6000,
            "tokens_per_minute": 200_000,
            "max_concurrent": 1,
            "max_prefixes": 1,
            "max_pinned_blocks": 2,
        },
        {"key": SLOW_KEY, "name": "slow", "requests_per_minute": 2, "tokens_per_minute": 400},
    ]
}
SYSTEM = "You are a helpful assistant who answers in short sentences. " * 2  # > one KV block
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
GEMINI = "/v1beta/models/fake:generateContent"
GEMINI_STREAM = "/v1beta/models/fake:streamGenerateContent?alt=sse"
MESSAGES_COUNT, GEMINI_COUNT = "/v1/messages/count_tokens", "/v1beta/models/fake:countTokens"
DIALECT = {CHAT: "openai", RESPONSES: "openai", MESSAGES: "anthropic", MESSAGES_COUNT: "anthropic"}
# what a count route does not take of a generation's body (Anthropic's count_tokens)
NOT_COUNTED = ("max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences")
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
GEMINI_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
}
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OUT_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
EXISTING = "<existing>"  # replaced by the server's own prefix id / cache name
UNKNOWN = "pfx-unknown"  # a prefix id / cache name no key made


@dataclass
class Draw:
    """One request: route, body, headers, and what its answer must be."""

    path: str
    body: Any
    stream: bool
    key: str = OPEN_KEY
    budget_ms: int | str | None = None
    defect: str | None = None  # the field a defect names (the 400 must name it)
    unsure: bool = False  # a combination whose status is not predicted (only the invariants)
    hangup: bool = False  # the client closes a stream after its first bytes

    @property
    def dialect(self) -> str:
        return DIALECT.get(self.path, "gemini")

    def headers(self) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.key}"}
        if self.dialect == "gemini":
            h = {"x-goog-api-key": self.key}
        elif self.dialect == "anthropic":
            h = {"x-api-key": self.key, "anthropic-version": "2023-06-01"}
        if self.budget_ms is not None:
            h[BUDGET_HEADER] = str(self.budget_ms)
        return h

    def for_server(self, prefix_id: str, cache_name: str) -> Any:
        """The body with ``EXISTING`` replaced by this server's prefix id or cache name."""
        text = json.dumps(self.body)
        if self.dialect == "gemini":
            return json.loads(text.replace(json.dumps(EXISTING), json.dumps(cache_name)))
        return json.loads(text.replace(json.dumps(EXISTING), json.dumps(prefix_id)))

    @property
    def others_pin(self) -> bool:
        """The body names a prefix / cache of another key (the open key made them) or one
        nobody made: a 404, as right as a 400 for another defect drawn beside it (a prefix's
        messages count towards the context: the context is checked after the lookup)."""
        text = json.dumps(self.body)
        return (self.key != OPEN_KEY and EXISTING in text) or UNKNOWN in text

    @property
    def expect_ok(self) -> bool:
        return (
            not self.defect
            and not self.unsure
            and not self.others_pin
            and self.key == OPEN_KEY
            and not self.budget_ms
        )


# --- the draw, one dialect at a time ----------------------------------------------------------
small_text = st.sampled_from(["hi", "Tell me a story", "What is 2+2?", "é🤖", "a\nb"])
max_tokens = st.integers(1, 4)
DEFECTS = ["type", "empty", "role", "too_long", "unimplemented", "unknown_field", "cache"]
# top-level fields whose empty value is answered as their absence (docs/request-guards.md)
EMPTY_NOISE = {
    CHAT: [("top_k", None), ("stop", []), ("user", ""), ("logit_bias", {}), ("metadata", None)],
    RESPONSES: [("include", []), ("reasoning", None), ("previous_response_id", None)],
    MESSAGES: [("stop_sequences", []), ("metadata", {}), ("thinking", {}), ("top_k", None)],
    "gemini": [("safetySettings", []), ("labels", {}), ("cachedContent", "")],
}


def _noise(draw: st.DrawFn, d: Draw) -> None:
    """Maybe one top-level field holding an empty value (``null``, ``[]``, ``{}``, ``""``)."""
    if draw(st.booleans()):
        name, value = draw(
            st.sampled_from(EMPTY_NOISE[d.path if d.dialect != "gemini" else "gemini"])
        )
        if name not in d.body:
            d.body[name] = value


def _defect(draw: st.DrawFn) -> str | None:
    return draw(st.sampled_from([None, None, None, *DEFECTS]))


@st.composite
def chat_draw(draw: st.DrawFn) -> Draw:
    stream = draw(st.booleans())
    part: dict[str, Any] = {"type": "text", "text": draw(small_text)}
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [part]}],
        "max_tokens": draw(max_tokens),
    }
    d = Draw(CHAT, body, stream)
    if stream:
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    cache = draw(
        st.sampled_from(["none", "key", "retention", "options", "breakpoint", "prefix", "unknown"])
    )
    if cache == "key":
        body["prompt_cache_key"] = draw(st.sampled_from(["session-1", "s" * 64]))
    elif cache == "retention":
        body["prompt_cache_retention"] = draw(st.sampled_from(["in_memory", "24h"]))
    elif cache == "options":
        body["prompt_cache_options"] = {"mode": draw(st.sampled_from(["implicit", "explicit"]))}
    elif cache == "breakpoint":
        body["messages"][0] = {
            "role": "system",
            "content": [
                {"type": "text", "text": SYSTEM, "prompt_cache_breakpoint": {"mode": "explicit"}}
            ],
        }
    elif cache in ("prefix", "unknown"):
        body["prefix_id"] = EXISTING if cache == "prefix" else UNKNOWN
        body["messages"] = body["messages"][1:]
    for name in draw(
        st.sets(
            st.sampled_from(["temperature", "top_p", "seed", "presence_penalty", "stop", "n"]),
            max_size=3,
        )
    ):
        body[name] = draw(
            {
                "temperature": st.sampled_from([0, 0.7, 2]),
                "top_p": st.sampled_from([0.1, 1]),
                "seed": st.integers(0, 2**31),
                "presence_penalty": st.sampled_from([-2, 0.5]),
                "stop": st.sampled_from(["\n", ["x", "yy"]]),
                "n": st.integers(1, 2),
            }[name]
        )
    extra = draw(st.sampled_from(["none", "tools", "tool_named", "json_schema", "json_object"]))
    tool = {"type": "function", "function": {"name": "weather", "parameters": TOOL_SCHEMA}}
    if extra == "tools":
        body["tools"] = [tool]
        body["tool_choice"] = draw(st.sampled_from(["required", "none"]))
    elif extra == "tool_named":
        body["tools"] = [tool]
        body["tool_choice"] = {"type": "function", "function": {"name": "weather"}}
    elif extra == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": OUT_SCHEMA, "strict": True},
        }
    elif extra == "json_object":
        body["response_format"] = {"type": "json_object"}
    if extra != "none" and "stop" in body:
        d.unsure = True  # stop strings beside a whole-output constraint: a documented 400
    defect = _defect(draw)
    if defect == "type":
        name = draw(st.sampled_from(["temperature", "max_tokens", "stream", "messages"]))
        body[name] = {"temperature": "hot", "max_tokens": "5", "stream": "yes", "messages": "x"}[
            name
        ]
        d.defect = name
    elif defect == "empty":
        body["messages"] = []
        body.pop("prefix_id", None)
        d.defect = "messages"
    elif defect == "role":
        body["messages"][-1]["role"] = "bogus"
        d.defect = "messages"
    elif defect == "too_long":
        body["max_tokens"] = 100_000
        d.defect = "max_tokens"
    elif defect == "unimplemented":
        name, value = draw(
            st.sampled_from(
                [
                    ("reasoning_effort", "high"),
                    ("prediction", {"type": "content", "content": "x"}),
                    ("audio", {"voice": "alloy", "format": "wav"}),
                    ("verbosity", "low"),
                ]
            )
        )
        body[name] = value
        d.defect = name
    elif defect == "unknown_field":
        body["mirostat_tau"] = 5.0
        d.defect = "mirostat_tau"
    elif defect == "cache":
        name, value = draw(
            st.sampled_from(
                [
                    ("prompt_cache_retention", "forever"),
                    ("prompt_cache_key", 7),
                    ("prompt_cache_options", {"mode": "sometimes"}),
                    ("prompt_cache_breakpoint", None),
                ]
            )
        )
        if name == "prompt_cache_breakpoint":  # five marks: one over the four allowed
            mark = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}
            body["messages"][-1]["content"] = [dict(mark) for _ in range(5)]
        else:
            body[name] = value
        d.defect = name
    _noise(draw, d)
    return d


@st.composite
def responses_draw(draw: st.DrawFn) -> Draw:
    stream = draw(st.booleans())
    body: dict[str, Any] = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": draw(small_text),
        "max_output_tokens": draw(max_tokens),
    }
    d = Draw(RESPONSES, body, stream)
    if stream:
        body["stream"] = True
    cache = draw(st.sampled_from(["none", "key", "retention", "options"]))
    if cache == "key":
        body["prompt_cache_key"] = "session-1"
    elif cache == "retention":
        body["prompt_cache_retention"] = draw(st.sampled_from(["in_memory", "24h"]))
    elif cache == "options":
        body["prompt_cache_options"] = {"mode": "implicit"}
    if draw(st.booleans()):
        body["temperature"] = draw(st.sampled_from([0, 1.5]))
    if draw(st.booleans()):
        body["top_p"] = draw(st.sampled_from([0.5, 1]))
    if draw(st.booleans()):
        body["text"] = {"format": {"type": "text"}}
    defect = _defect(draw)
    if defect == "type":
        name = draw(st.sampled_from(["temperature", "max_output_tokens", "input"]))
        body[name] = {"temperature": "hot", "max_output_tokens": "5", "input": 7}[name]
        d.defect = name
    elif defect == "empty":
        body["input"] = []
        d.defect = "input"
    elif defect == "role":
        body["input"] = [{"role": "bogus", "content": "hi"}]
        d.defect = "input"
    elif defect == "too_long":
        body["max_output_tokens"] = 100_000
        d.defect = "max_output_tokens"
    elif defect == "unimplemented":
        name, value = draw(
            st.sampled_from(
                [
                    ("reasoning", {"effort": "high"}),
                    ("top_logprobs", 3),
                    ("background", True),
                    ("text", {"format": {"type": "grammar", "name": "o"}}),
                ]
            )
        )
        body[name] = value
        d.defect = name
    elif defect == "unknown_field":
        body["mirostat_tau"] = 5.0
        d.defect = "mirostat_tau"
    elif defect == "cache":
        name, value = draw(
            st.sampled_from([("prompt_cache_retention", "forever"), ("prompt_cache_key", 7)])
        )
        body[name] = value
        d.defect = name
    _noise(draw, d)
    return d


@st.composite
def messages_draw(draw: st.DrawFn) -> Draw:
    stream = draw(st.booleans())
    system: list[dict[str, Any]] = [{"type": "text", "text": SYSTEM}]
    block: dict[str, Any] = {"type": "text", "text": draw(small_text)}
    body: dict[str, Any] = {
        "model": MODEL,
        "system": system,
        "messages": [{"role": "user", "content": [block]}],
        "max_tokens": draw(max_tokens),
    }
    d = Draw(MESSAGES, body, stream)
    if stream:
        body["stream"] = True
    tool = {"name": "weather", "input_schema": TOOL_SCHEMA}
    extra = draw(st.sampled_from(["none", "tools", "format"]))
    if extra == "tools":
        body["tools"] = [tool]
        body["tool_choice"] = draw(
            st.sampled_from(
                [{"type": "any"}, {"type": "none"}, {"type": "tool", "name": "weather"}]
            )
        )
    elif extra == "format":
        body["output_config"] = {"format": {"type": "json_schema", "schema": OUT_SCHEMA}}
    mark: dict[str, Any] = {"type": "ephemeral"}
    if draw(st.booleans()):
        mark["ttl"] = draw(st.sampled_from(["5m", "1h"]))
    where = draw(st.sampled_from(["none", "system", "message", "tool", "top"]))
    if where == "system":
        system[0]["cache_control"] = mark
    elif where == "message":
        block["cache_control"] = mark
    elif where == "tool":
        if "tools" not in body:
            body["tools"], body["tool_choice"] = [tool], {"type": "none"}
        body["tools"][0]["cache_control"] = mark
    elif where == "top":
        body["cache_control"] = mark
    for name in draw(st.sets(st.sampled_from(["temperature", "top_p", "top_k", "stop"]))):
        if name == "stop":
            if extra == "none":  # stop sequences beside a forced tool or a format: a 400
                body["stop_sequences"] = ["\n\n"]
        else:
            body[name] = {"temperature": 0.5, "top_p": 0.9, "top_k": 5}[name]
    defect = _defect(draw)
    if defect == "type":
        name = draw(st.sampled_from(["temperature", "max_tokens", "stream", "messages"]))
        body[name] = {"temperature": "hot", "max_tokens": "5", "stream": "yes", "messages": "x"}[
            name
        ]
        d.defect = name
    elif defect == "empty":
        body["messages"] = []
        d.defect = "messages"
    elif defect == "role":
        body["messages"][0]["role"] = "bogus"
        d.defect = "messages"
    elif defect == "too_long":
        body["max_tokens"] = 100_000
        d.defect = "max_tokens"
    elif defect == "unimplemented":
        name, value = draw(
            st.sampled_from(
                [
                    ("thinking", {"type": "enabled", "budget_tokens": 1024}),
                    ("container", "c-1"),
                    ("mcp_servers", [{"type": "url", "url": "http://x", "name": "x"}]),
                ]
            )
        )
        body[name] = value
        d.defect = name
    elif defect == "unknown_field":
        body["mirostat_tau"] = 5.0
        d.defect = "mirostat_tau"
    elif defect == "cache":
        bad = draw(
            st.sampled_from([{"type": "ephemeral", "ttl": "10m"}, {"type": "forever"}, "yes"])
        )
        target = draw(st.sampled_from(["system", "message", "top"]))
        if target == "system":
            system[0]["cache_control"] = bad
        elif target == "message":
            block["cache_control"] = bad
        else:
            body["cache_control"] = bad
        d.defect = "cache_control"
    _noise(draw, d)
    return d


@st.composite
def gemini_draw(draw: st.DrawFn) -> Draw:
    stream = draw(st.booleans())
    config: dict[str, Any] = {"maxOutputTokens": draw(max_tokens)}
    body: dict[str, Any] = {
        "contents": [{"role": "user", "parts": [{"text": draw(small_text)}]}],
        "generationConfig": config,
    }
    d = Draw(GEMINI_STREAM if stream else GEMINI, body, stream)
    cached = draw(st.sampled_from(["none", "none", "cache", "unknown"]))
    if cached != "none":
        body["cachedContent"] = EXISTING if cached == "cache" else f"cachedContents/{UNKNOWN}"
    else:
        body["systemInstruction"] = {"parts": [{"text": SYSTEM}]}
    for name in draw(
        st.sets(st.sampled_from(["temperature", "topP", "topK", "seed", "stop", "candidateCount"]))
    ):
        config[name if name != "stop" else "stopSequences"] = {
            "temperature": 1.5,
            "topP": 0.5,
            "topK": 4,
            "seed": 7,
            "stop": ["\n"],
            "candidateCount": 2,
        }[name]
    extra = draw(st.sampled_from(["none", "tools", "json"]))
    if extra == "tools" and cached == "none":
        body["tools"] = [{"functionDeclarations": [{"name": "weather", "parameters": TOOL_SCHEMA}]}]
        body["toolConfig"] = {
            "functionCallingConfig": {"mode": draw(st.sampled_from(["ANY", "NONE"]))}
        }
        if config.get("stopSequences"):
            d.unsure = True  # stop sequences beside a forced call: a documented 400
    elif extra == "json":
        config["responseMimeType"] = "application/json"
        config["responseJsonSchema"] = OUT_SCHEMA
        config.pop("stopSequences", None)  # beside a JSON schema: a documented 400
    defect = _defect(draw)
    if defect == "type":
        name = draw(st.sampled_from(["temperature", "maxOutputTokens", "contents"]))
        if name == "contents":
            body["contents"] = "x"
        else:
            config[name] = {"temperature": "hot", "maxOutputTokens": "many"}[name]
        d.defect = name
    elif defect == "empty":
        body["contents"] = []
        d.defect = "contents"
    elif defect == "role":
        body["contents"][0]["role"] = "bogus"
        d.defect = "role"
    elif defect == "too_long":
        config["maxOutputTokens"] = 100_000
        d.defect = "maxOutputTokens"
    elif defect == "unimplemented":
        name, value = draw(
            st.sampled_from(
                [
                    ("responseLogprobs", True),
                    ("thinkingConfig", {"thinkingBudget": 128}),
                    ("responseModalities", ["AUDIO"]),
                ]
            )
        )
        config[name] = value
        d.defect = name
    elif defect == "unknown_field":
        config["mirostatTau"] = 5.0
        d.defect = "mirostatTau"
    elif defect == "cache":
        how = draw(st.sampled_from(["type", "unknown_beside_system", "system_beside"]))
        if how == "type":
            body["cachedContent"] = 7
            d.defect = "cachedContent"
        else:
            body["cachedContent"] = EXISTING
            body["systemInstruction"] = {"parts": [{"text": "other"}]}
            d.defect = "systemInstruction"
    _noise(draw, d)
    return d


def to_count(d: Draw) -> None:
    """``d`` sent to its dialect's token count instead: Anthropic's ``count_tokens`` (the body
    less the generation's fields), Gemini's ``countTokens`` (``generateContentRequest``)."""
    d.stream = False
    if d.dialect == "anthropic":
        d.path = MESSAGES_COUNT
        for name in NOT_COUNTED:
            d.body.pop(name, None)
            if d.defect == name:
                d.defect = None
        if "output_config" in d.body:
            d.unsure = True
    else:
        d.path = GEMINI_COUNT
        d.body = {"generateContentRequest": {"model": f"models/{MODEL}", **d.body}}
        if d.defect == "maxOutputTokens":  # over the context: a count generates nothing
            d.unsure = True


@st.composite
def draws(
    draw: st.DrawFn, routes: tuple[str, ...] = ("chat", "responses", "messages", "gemini")
) -> Draw:
    route = draw(st.sampled_from(routes))
    d = draw(
        {
            "chat": chat_draw(),
            "responses": responses_draw(),
            "messages": messages_draw(),
            "gemini": gemini_draw(),
        }[route]
    )
    if route in ("messages", "gemini") and draw(st.integers(0, 4)) == 0:
        to_count(d)
    if d.stream and draw(st.integers(0, 2)) == 0:  # a long answer the client leaves
        d.hangup = True
        limit = {CHAT: "max_tokens", RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}
        if d.dialect == "gemini":
            config = d.body.setdefault("generationConfig", {})
            if isinstance(config, dict) and isinstance(config.get("maxOutputTokens"), int):
                config["maxOutputTokens"] = max(config["maxOutputTokens"], 100)
        elif isinstance(d.body.get(limit[d.path]), int):
            d.body[limit[d.path]] = max(d.body[limit[d.path]], 100)
    d.key = draw(st.sampled_from([OPEN_KEY, OPEN_KEY, OPEN_KEY, TIGHT_KEY, SLOW_KEY, WRONG_KEY]))
    d.budget_ms = draw(st.sampled_from([None, None, None, 100, 60_000, "soon"]))
    return d


# --- the answer's invariants ------------------------------------------------------------------
def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each SSE event of ``text``."""
    out = []
    for chunk in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in chunk.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data or name:
            out.append((name, "\n".join(data)))
    return out


def check_error(dialect: str, status: int, body: Any) -> dict[str, Any]:
    """The dialect's error object for ``status``; returns its inner ``error``."""
    assert isinstance(body, dict), body
    if dialect == "anthropic":
        assert body.get("type") == "error" and set(body) <= {"type", "error", "request_id"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], body
        assert err["type"] == ANTHROPIC_TYPES.get(status, err["type"]), (status, body)
    elif dialect == "gemini":
        assert set(body) == {"error"}, body
        err = body["error"]
        assert err["code"] == status, (status, body)
        assert err["status"] == GEMINI_STATUS.get(status, err["status"]), (status, body)
        assert isinstance(err["message"], str) and err["message"], body
    else:
        assert set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], body
        assert {"message", "type", "param", "code"} <= set(err), body
    return err


def names_field(err: dict[str, Any], name: str) -> bool:
    text = json.dumps(err)
    return name in text


def check_429(r: httpx.Response) -> None:
    ra = r.headers.get("Retry-After")
    assert ra is not None and ra.isdigit(), dict(r.headers)
    assert 1 <= int(ra) <= 600, ra
    ms = r.headers.get("retry-after-ms")
    if ms is not None:
        assert ms.isdigit() and int(ms) >= 1, ms
        assert int(ra) >= math.ceil(int(ms) / 1000), (ra, ms)
    promise = r.headers.get("x-prefixgate-promise-ms")
    if promise is not None:
        assert promise.isdigit() and int(promise) >= 1, promise


def check_stream(d: Draw, text: str) -> str:
    """The stream ends with the dialect's terminator or an error event; returns which."""
    events = sse_events(text)
    assert events, f"an empty stream: {text!r}"
    name, data = events[-1]
    if d.path == CHAT:
        if data == "[DONE]":
            assert all("error" not in json.loads(x) for _, x in events[:-1]), text
            return "done"
        assert "error" in json.loads(data), f"cut silently: {text[-300:]!r}"
        return "error"
    if d.path == RESPONSES:
        assert name in ("response.completed", "response.incomplete", "response.failed"), text[-300:]
        return "done" if name != "response.failed" else "error"
    if d.path == MESSAGES:
        assert name in ("message_stop", "error"), f"cut silently: {text[-300:]!r}"
        if name == "error":
            check_error("anthropic", 500, json.loads(data))  # any type: a cut stream
            return "error"
        return "done"
    last = json.loads(data)
    if "error" in last:
        return "error"
    assert any(c.get("finishReason") for c in last.get("candidates", [])), text[-300:]
    return "done"


def check_success(d: Draw, r: httpx.Response) -> None:
    if d.stream:
        assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers
        if d.hangup:
            return  # cut by the client: the engine and the gauges are checked after
        assert check_stream(d, r.text) == "done", r.text[-300:]
        return
    body = r.json()
    if d.path == MESSAGES_COUNT:
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0, body
    elif d.path == GEMINI_COUNT:
        assert isinstance(body["totalTokens"], int) and body["totalTokens"] > 0, body
    elif d.path == CHAT:
        assert body["object"] == "chat.completion" and body["choices"], body
    elif d.path == RESPONSES:
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete"), body
    elif d.path == MESSAGES:
        assert body["type"] == "message" and body["role"] == "assistant", body
    else:
        assert body["candidates"] and "usageMetadata" in body, body


def check_answer(d: Draw, r: httpx.Response) -> None:
    """The invariants of one answer (module docstring)."""
    why = f"{d}\n-> {r.status_code} {'' if d.hangup and r.status_code == 200 else r.text[:600]}"
    assert r.status_code < 500, why
    if r.status_code == 200:
        check_success(d, r)
    else:
        assert 400 <= r.status_code < 500, why
        err = check_error(d.dialect, r.status_code, r.json())
        if r.status_code == 429:
            check_429(r)
    if d.key == WRONG_KEY:
        assert r.status_code == 401, why
        return
    assert r.status_code != 401, why
    if d.expect_ok:
        assert r.status_code == 200, why
    counting = d.path in (MESSAGES_COUNT, GEMINI_COUNT)  # admits nothing: no budget read
    soon = d.budget_ms == "soon" and not counting
    named = [n for n in (d.defect, BUDGET_HEADER if soon else None) if n]
    if r.status_code == 404:  # only a prefix / cache of another key is not found
        assert d.others_pin, why
        assert names_field(err, "prefix_id" if d.dialect != "gemini" else "cachedContent"), why
    elif r.status_code == 429:  # only a limited key or a budget below the prediction
        assert d.key in (TIGHT_KEY, SLOW_KEY) or d.budget_ms == 100, why
    elif d.unsure:
        pass
    elif named:  # a defect: a 400 naming it (or the other one drawn)
        assert r.status_code == 400, why
        assert any(names_field(err, n) for n in named), why
    else:
        assert r.status_code == (404 if d.others_pin else 200), why


# --- the servers ------------------------------------------------------------------------------
class Served:
    """A gateway under test, its engine (None for a proxy), and the ids made on it."""

    def __init__(self, srv: BackgroundServer, engine: FakeEngine | None) -> None:
        self.srv, self.engine = srv, engine
        self.client_facing = True
        self.prefix_id = ""
        self.cache_name = ""

    def setup_pins(self, key: str) -> None:
        with httpx.Client(base_url=self.srv.url, timeout=30) as c:
            r = c.post(
                "/v1/prefixes",
                json={"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}]},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
            self.prefix_id = r.json()["id"]
            r = c.post(
                "/v1beta/cachedContents",
                json={
                    "model": f"models/{MODEL}",
                    "systemInstruction": {"parts": [{"text": SYSTEM}]},
                },
                headers={"x-goog-api-key": key},
            )
            assert r.status_code == 200, r.text
            self.cache_name = r.json()["name"]

    def send(self, d: Draw) -> httpx.Response:
        body, headers = d.for_server(self.prefix_id, self.cache_name), d.headers()
        with httpx.Client(base_url=self.srv.url, timeout=30) as c:
            if not d.hangup:
                return c.post(d.path, json=body, headers=headers)
            with c.stream("POST", d.path, json=body, headers=headers) as r:
                if r.status_code == 200:  # the client goes after the first bytes
                    next(r.iter_raw(), b"")
                    return r
                r.read()
                return r


def check_quiet(served: list[Served]) -> None:
    """Every engine idle and whole, every gateway's gauges at 0, no client connection open."""
    deadline = time.monotonic() + 5
    for s in served:
        if s.engine is not None:
            stats = wait_idle(s.srv, s.engine)
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
            assert stats["kv_blocks_used"] == stats["pinned_blocks"], stats
        state = s.srv.app[STATE]
        while True:
            adm = state.admission
            principals = list(state.keys._by_digest.values()) + [state.keys._anonymous]
            # an upstream keeps the proxy's pooled connections: only a client's count
            conns = len(s.srv.server.runner.server.connections) if s.client_facing else 0
            quiet = (
                adm.queued_requests == 0
                and adm.in_flight == 0
                and adm.queued_tokens == 0
                and all(p.concurrent == 0 for p in principals)
                and conns == 0
            )
            if quiet or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert adm.queued_requests == 0 and adm.in_flight == 0 and adm.queued_tokens == 0, vars(adm)
        assert [p.concurrent for p in principals if p.concurrent] == []
        assert conns == 0, f"{conns} client connections left open"


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[Served, Served, Served]]:
    """(local, proxy, the proxy's upstream): local and the proxy take the same keys; the
    upstream (open) is a prefixgate gateway over its own fake engine."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    engines: dict[str, FakeEngine] = {}

    def local(name: str, keyed: bool):
        def make():
            engines[name] = FakeEngine(
                max_model_len=MAX_MODEL_LEN, token_delay_s=0.005, num_blocks=1024
            )
            engines[name].predicted_ttft = PREDICTED_TTFT_S
            settings = GatewaySettings(model_name=MODEL, keys_file=str(keys) if keyed else None)
            return create_app(engines[name], settings)

        return make

    with (
        BackgroundServer(local("local", True)) as lsrv,
        BackgroundServer(local("up", False)) as usrv,
    ):
        settings = GatewaySettings(keys_file=str(keys), health_check_timeout_s=60.0)
        with BackgroundServer(lambda: create_proxy_app([usrv.url], settings)) as psrv:
            loc = Served(lsrv, engines["local"])
            up = Served(usrv, engines["up"])
            up.client_facing = False
            prx = Served(psrv, None)
            loc.setup_pins(OPEN_KEY)
            prx.setup_pins(OPEN_KEY)
            yield loc, prx, up
            for s in (lsrv, usrv):
                s.call(s.app[LOCAL].engine.shutdown)


def test_every_combination_answers_in_its_dialect_local(servers):
    loc, _, _ = servers

    @live_server_settings(EXAMPLES)
    @given(draws())
    def one(d: Draw) -> None:
        r = loc.send(d)
        check_answer(d, r)
        check_quiet([loc])

    one()


def test_every_combination_answers_in_its_dialect_proxy(servers):
    _, prx, up = servers

    @live_server_settings(EXAMPLES)
    @given(draws())
    def one(d: Draw) -> None:
        r = prx.send(d)
        check_answer(d, r)
        check_quiet([prx, up])

    one()


def test_proxy_answers_as_local(servers):
    loc, prx, up = servers

    @live_server_settings(EXAMPLES)
    @given(draws())
    def one(d: Draw) -> None:
        d.key, d.budget_ms, d.hangup = OPEN_KEY, None, False
        a, b = loc.send(d), prx.send(d)
        why = f"{d}\nlocal {a.status_code} {a.text[:400]}\nproxy {b.status_code} {b.text[:400]}"
        assert a.status_code == b.status_code, why
        if a.status_code != 200:
            ea = check_error(d.dialect, a.status_code, a.json())
            eb = check_error(d.dialect, b.status_code, b.json())
            assert set(ea) == set(eb), why
        check_quiet([loc, prx, up])

    one()
