"""Proxy mode names the field of a semantic 400 as local mode does: the same bad requests
through a local gateway and through a proxy in front of it give the same error object
(status, message, type, param, code); an upstream whose 400 comes in another server's shape
(vLLM's flat error, FastAPI's ``detail``, a message starting with the field) is reworded
into an OpenAI error object naming the field (``proxy/redact.reworded_error``)."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings
from support.chat_upstream import chat_app

M = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
BAD = [
    (CHAT, {"messages": M, "temperature": 5}, "temperature"),
    (CHAT, {"messages": M, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": M, "frobnicate": 1}, "frobnicate"),
    (CHAT, {"messages": "x"}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": M, "n": 0}, "n"),
    (CHAT, {"messages": M, "logit_bias": {"x": 1}}, "logit_bias"),
    (CHAT, {"messages": M, "max_tokens": 100000}, "max_tokens"),
    (CHAT, {"messages": M, "stop": ["a"] * 5}, "stop"),
    (CHAT, {"messages": M, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": M, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": M, "priority": "x"}, "priority"),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]}, "messages.0.role"),
    # a role that is no string beside null content: the proxy's content check took it for a
    # set member (TypeError: unhashable type: 'list', a 500; a new user's fuzzing)
    (CHAT, {"messages": [{"role": [], "content": None}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": {"a": 1}, "content": None}]}, "messages.0.role"),
    (CHAT, {"messages": M, "tools": [TOOL], "tool_choice": "required", "stop": "{"}, "stop"),
    (CHAT, {"messages": M, "stream": True, "temperature": -1}, "temperature"),
    (CHAT, {"messages": M, "stream_options": {"include_usage": 1}}, "stream_options"),
    # vLLM's request extras, honoured in local mode: their bad values are the same 400s
    (CHAT, {"messages": M, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    (
        CHAT,
        {"messages": M, "chat_template_kwargs": {"messages": []}},
        "chat_template_kwargs.messages",
    ),
    (CHAT, {"messages": M, "continue_final_message": True}, "continue_final_message"),
    (CHAT, {"messages": M, "add_generation_prompt": 1}, "add_generation_prompt"),
    (CHAT, {"messages": M, "skip_special_tokens": "no"}, "skip_special_tokens"),
    (COMP, {"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    (COMP, {"prompt": "x", "bad_words": "x"}, "bad_words"),
    (COMP, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (
        CHAT,
        {
            "messages": M,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": False},
        },
        "stream_options.continuous_usage_stats",
    ),
    (CHAT, {"messages": M, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    (COMP, {"prompt": "x", "echo": True}, "echo"),
    (COMP, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMP, {}, "prompt"),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "stop": "a"}, "stop"),
]
# two defects, one of them ``stop`` beside a whole-output constraint (the proxy's own
# refusal): named by the first in local mode's order in both modes, not by ``stop`` in the
# proxy where local mode names the other (the proxy ran its stop check before the form)
FORCED = {"tools": [TOOL], "tool_choice": "required", "stop": "{"}
TWO_DEFECTS = [
    (CHAT, {"messages": M, **FORCED, "temperature": 5}, "temperature"),
    (CHAT, {"messages": M, **FORCED, "n": 0}, "n"),
    (CHAT, {"messages": M, **FORCED, "priority": "x"}, "priority"),
    (CHAT, {"messages": M, **FORCED, "response_format": {"type": "json_object"}},
     "response_format"),
    (CHAT, {"messages": M, "tools": [TOOL], "stop": "{",
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"messages": M, "guided_regex": "a+", "stop": "a", "logit_bias": {"x": 1}}, "stop"),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "stop": "a", "echo": True}, "echo"),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "stop": "a", "top_p": 0}, "top_p"),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "stop": "a", "best_of": 2}, "best_of"),
]  # fmt: skip


@pytest.fixture
def both(serve_fake):
    local, _ = serve_fake(GatewaySettings(model_name="fake"))
    # the local server's first tool request imports xgrammar in its loop: seconds without a
    # /health answer, which the default checks (2 s) would rightly call down
    slow = GatewaySettings(health_check_timeout_s=60.0)
    with BackgroundServer(lambda: create_proxy_app([local.url], slow)) as proxy:
        yield local.url, proxy.url


def test_the_same_bad_requests_give_the_same_error_object_in_both_modes(both):
    local, proxy = both
    with httpx.Client(timeout=120) as http:  # the first tool request imports xgrammar
        for path, extra, param in BAD + TWO_DEFECTS:
            body = {"model": "fake", **extra}
            a = http.post(local + path, json=body)
            b = http.post(proxy + path, json=body)
            assert a.status_code == 400, (extra, a.text)
            assert a.json()["error"]["param"].startswith(param), (extra, a.json())
            assert (b.status_code, b.json()) == (a.status_code, a.json()), (extra, b.text)


# what other servers answer a bad ``temperature`` with (status 400 unless said)
SHAPES = [
    ({"object": "error", "message": "temperature: must be in [0, 2]", "type": "BadRequestError",
      "param": None, "code": 400}, 400, "temperature"),  # vLLM's flat ErrorResponse
    ({"detail": [{"loc": ["body", "temperature"], "msg": "Input should be <= 2",
                  "type": "less_than_equal"}]}, 422, "temperature"),  # FastAPI validation
    ({"detail": [{"loc": ["body", "messages", 0, "role"], "msg": "bad role"}]}, 422,
     "messages.0.role"),
    ({"error": {"message": "temperature: out of range", "type": "invalid_request_error",
                "param": None, "code": None}}, 400, "temperature"),
    ({"error": {"message": "bad value", "type": "invalid_request_error", "param": "top_p",
                "code": "invalid_value"}}, 400, "top_p"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "status", "param"), SHAPES)
def test_an_upstream_400_in_another_shape_still_names_the_field(body, status, param):
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(body, status=status)

    with BackgroundServer(chat_app(chat, ["m"])) as up:
        with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
            r = httpx.post(
                gw.url + CHAT, json={"model": "m", "messages": M, "temperature": 9}, timeout=10
            )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param) or body["error"]["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}


# defects beside a prefix_id besides ``BAD``'s: what the body says on its own (checked before the
# prefix is looked up in both modes) and what needs the served model or its engine (the
# vocabulary, the tool-call parser, a schema's grammar: after the lookup in both modes)
SCHEMA_BAD = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
PREFIX_BAD = [
    {"messages": M, "logit_bias": {"-1": 1}},
    {"messages": M, "logit_bias": {"05": 1}},
    {"messages": M, "stop_token_ids": [-3]},
    {"messages": M, "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"messages": M, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"messages": M, "tools": [TOOL], "tool_choice": "sometimes"},
    {"messages": M, "tools": [{"type": "retrieval"}], "tool_choice": "required"},
    {"messages": M, "tools": [TOOL, TOOL], "tool_choice": "required"},
    {"messages": M, "tools": [TOOL], "tool_choice": "required",
     "response_format": {"type": "json_object"}},
    {"messages": M, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
     "stop": "x"},
    {"messages": M, "response_format": {"type": "json_object"}, "stop": ["}"]},
    # the served model's: after the lookup (an unknown prefix is the 404 in both modes)
    {"messages": M, "logit_bias": {"100000": 1}},
    {"messages": M, "stop_token_ids": [100000]},
    {"messages": M, "tools": [TOOL]},  # tool_choice 'auto' on a server without a parser
    {"messages": M, "tools": [{**TOOL, "function": {"name": "f", "parameters": SCHEMA_BAD}}],
     "tool_choice": "required"},
    {"messages": M, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "o", "schema": SCHEMA_BAD}}},
    {"messages": M, "logit_bias": {"x": 1}, "model": "other"},  # 404 model_not_found first
]  # fmt: skip


def test_a_bad_request_naming_a_prefix_gets_the_same_answer_in_both_modes(both):
    """Proxy mode looked up a chat's ``prefix_id`` before checking the body: a bad field beside
    an unknown prefix was a 404 there and the 400 naming the field locally (found by
    ``test_edge_combinations.py``); then still for a ``logit_bias`` key or a ``tool_choice``
    without tools, which local mode checked before the lookup and the proxy left to its
    upstream. Both modes now run the one check of what the body says on its own
    (``request_models.check_chat_body``) before the lookup, and what needs the served model
    after it."""
    local, proxy = both
    with httpx.Client(timeout=120) as http:
        extras = [extra for path, extra, _ in BAD if path == CHAT] + PREFIX_BAD
        for extra in extras:
            body = {"model": "fake", **extra, "prefix_id": "pfx-unknown"}
            a = http.post(local + CHAT, json=body)
            b = http.post(proxy + CHAT, json=body)
            why = (extra, a.text, b.text)
            if extra.get("model") == "other":  # each mode's own words for an unknown model
                ea, eb = a.json()["error"], b.json()["error"]
                assert a.status_code == b.status_code == 404, why
                assert (
                    (ea["param"], ea["code"])
                    == (eb["param"], eb["code"])
                    == ("model", "model_not_found")
                ), why
                continue
            assert (b.status_code, b.json()) == (a.status_code, a.json()), why
        for extra in [{"reasoning_effort": "high"}, {"logit_bias": {"x": 1}},
                      {"tool_choice": "required"}]:  # fmt: skip
            body = {"model": "fake", "messages": M, **extra, "prefix_id": "pfx-x"}
            a, b = http.post(local + CHAT, json=body), http.post(proxy + CHAT, json=body)
            (name,) = extra
            assert a.status_code == 400 and a.json()["error"]["param"] == name, a.text
            assert (b.status_code, b.json()) == (a.status_code, a.json()), b.text


AFTER_LOOKUP = [  # what needs the served model: a 400 naming it once the prefix is found
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"tools": [TOOL]}, "tool_choice"),  # 'auto' on a server without --tool-call-parser
    ({"tools": [{**TOOL, "function": {"name": "f", "parameters": SCHEMA_BAD}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA_BAD}}},
     "response_format"),
]  # fmt: skip


def test_what_needs_the_model_is_still_checked_beside_a_live_prefix(both):
    """The checks that moved after the lookup still refuse a bad body with a live prefix, in
    both modes alike (the proxy's upstream answers them)."""
    local, proxy = both
    with httpx.Client(timeout=120) as http:
        ids = {}
        for url in (local, proxy):
            r = http.post(url + "/v1/prefixes", json={"model": "fake", "messages": M})
            assert r.status_code == 200, r.text
            ids[url] = r.json()["id"]
        for extra, param in AFTER_LOOKUP:
            a, b = (
                http.post(url + CHAT, json={"model": "fake", **extra, "prefix_id": ids[url]})
                for url in (local, proxy)
            )
            assert a.status_code == 400 and a.json()["error"]["param"] == param, (extra, a.text)
            assert (b.status_code, b.json()) == (a.status_code, a.json()), (extra, b.text)


AM = [{"role": "user", "content": "hi"}]
GC = [{"role": "user", "parts": [{"text": "hi"}]}]
SCHEMA = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
GEN, GSTREAM = (
    "/v1beta/models/{}:generateContent",
    "/v1beta/models/{}:streamGenerateContent?alt=sse",
)
GCOUNT = "/v1beta/models/{}:countTokens"
BEYOND_FORM = [  # the bodies of BAD whose fault is not in their form (local mode's wire model)
    (CHAT, {}),  # no message: checked when the chat is rendered
    (CHAT, {"messages": M, "logit_bias": {"x": 1}}),
    (CHAT, {"messages": M, "max_tokens": 100000}),
    (CHAT, {"messages": M, "tool_choice": "required"}),
    (CHAT, {"messages": M, "response_format": {"type": "xml"}}),
    (CHAT, {"messages": M, "tools": [TOOL], "tool_choice": "required", "stop": "{"}),
    (COMP, {"prompt": "x", "echo": True}),
    (COMP, {"prompt": "x", "guided_choice": ["a"], "stop": "a"}),
    (CHAT, {"messages": M, "chat_template_kwargs": {"messages": []}}),
    (CHAT, {"messages": M, "truncate_prompt_tokens": 10**6}),
]
# (path, body, status): a body beside a model nobody serves, in local mode's order, which is
# OpenAI's: the body's form first (400: a wrong type, an unknown field, a bad role), then the
# model's name (404), then what the body says beyond its form (a tool_choice without tools,
# stop beside a constraint, a tool turn without its call: only for a served model)
UNKNOWN_MODEL = [
    *[(p, {**b, "model": "nope"}, 404 if (p, b) in BEYOND_FORM else 400) for p, b, _ in BAD],
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": 2}, 404),
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": 2, "stream": True}, 404),
    ("/v1/messages", {"model": "nope", "messages": AM}, 400),  # max_tokens is required
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": "x"}, 400),
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": 2, "frob": 1}, 400),
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": 2,
                      "tool_choice": {"type": "any"}}, 404),
    ("/v1/messages", {"model": "nope", "messages": AM, "max_tokens": 2, "stop_sequences": ["a"],
                      "output_config": SCHEMA}, 404),
    ("/v1/messages", {"model": "nope", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                      "content": "r"}]}]}, 404),
    ("/v1/messages/count_tokens", {"model": "nope", "messages": AM,
                                   "tool_choice": {"type": "any"}}, 404),
    (GEN.format("nope"), {"contents": GC}, 404),
    (GSTREAM.format("nope"), {"contents": GC}, 404),
    (GEN.format("nope"), {"contents": GC, "generationConfig": {"temperature": "x"}}, 400),
    (GEN.format("nope"), {"contents": GC, "frob": 1}, 400),
    (GEN.format("nope"), {"contents": GC, "toolConfig": {
        "functionCallingConfig": {"mode": "ANY"}}}, 404),
    # the path's model before the body's: an unknown path is the 404 whatever the body names
    (GEN.format("nope"), {"contents": GC, "model": "models/other"}, 404),
    (GSTREAM.format("nope"), {"contents": GC, "model": "models/other"}, 404),
    (GEN.format("fake"), {"contents": GC, "model": "models/other"}, 400),
    (GCOUNT.format("nope"), {"generateContentRequest": {"model": "models/fake",
                                                        "contents": GC}}, 404),
    (GCOUNT.format("nope"), {"generateContentRequest": {"model": "models/other",
                                                        "contents": GC}}, 404),
    (GCOUNT.format("fake"), {"generateContentRequest": {"model": "models/other",
                                                        "contents": GC}}, 404),
    (GCOUNT.format("nope"), {"contents": GC, "frob": 1}, 400),
]  # fmt: skip


def test_an_unknown_model_beside_a_bad_body_gets_the_same_answer_in_both_modes(both):
    """Was: for a chat without a prefix, the proxy resolved the model before the body's form
    on the OpenAI routes (an unknown model with a wrong type: 404, local mode's 400), and
    after what the body says on the Messages route (a tool_choice without tools: 400, local
    mode's 404); on Gemini's routes it checked the body's model against the path before the
    path's model, and (countTokens) the body's model before the path's. Both modes now keep
    local mode's order on every dialect's generating routes: the body's form, the model (the
    path's, then the body's), then the rest; the same error object, Gemini's 404 in Gemini's
    words."""
    local, proxy = both
    with httpx.Client(timeout=120) as http:
        for path, body, status in UNKNOWN_MODEL:
            a = http.post(local + path, json=body)
            b = http.post(proxy + path, json=body)
            assert a.status_code == status, (path, body, a.text)
            assert (b.status_code, b.json()) == (a.status_code, a.json()), (path, body, b.text)


TOOL_RESULT = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                             "content": "r"}]}]  # fmt: skip
FN_RESPONSE = [{"role": "user", "parts": [{"functionResponse": {"name": "f",
                                                               "response": {}}}]}]  # fmt: skip
JSON_STOP = {"responseMimeType": "application/json", "stopSequences": ["a"]}
# (path, body, param): a served model's body with stop strings beside a whole-output
# constraint (refused in both modes) and a defect local mode names first
TWO_DEFECTS_DIALECTS = [
    ("/v1/messages", {"model": "fake", "messages": AM, "max_tokens": 2, "stop_sequences": ["a"],
                      "tool_choice": {"type": "any"}}, "tool_choice"),
    ("/v1/messages", {"model": "fake", "messages": TOOL_RESULT, "max_tokens": 2,
                      "stop_sequences": ["a"], "output_config": SCHEMA}, "messages"),
    ("/v1/messages", {"model": "fake", "messages": AM, "max_tokens": "x",
                      "stop_sequences": ["a"], "output_config": SCHEMA}, "max_tokens"),
    (GEN.format("fake"), {"contents": FN_RESPONSE, "generationConfig": JSON_STOP}, "contents"),
    (GEN.format("fake"), {"contents": GC, "generationConfig": {**JSON_STOP, "topK": "x"}},
     "generationConfig.topK"),
]  # fmt: skip


def test_a_body_with_two_defects_is_named_by_the_same_one_in_both_modes(both):
    """Stop strings beside a whole-output constraint are refused by the proxy itself (the
    upstream may take them); it refused them before the Messages chat's and format's checks,
    so a body with a second defect (a tool_choice without tools, a tool result without its
    call) was named by ``stop_sequences`` there and by the other field locally. The same
    error object in both modes now, as for the OpenAI routes (``TWO_DEFECTS``)."""
    local, proxy = both
    with httpx.Client(timeout=120) as http:
        for path, body, param in TWO_DEFECTS_DIALECTS:
            a = http.post(local + path, json=body)
            b = http.post(proxy + path, json=body)
            assert a.status_code == 400, (path, body, a.text)
            err = a.json()["error"]
            named = err.get("param") or err.get("message", "")
            assert param in named, (path, body, a.text)
            assert (b.status_code, b.json()) == (a.status_code, a.json()), (path, body, b.text)


GEMINI_MISSES = [
    ("POST", "/v1beta/models/fake:frobnicate", {"contents": [{"parts": [{"text": "hi"}]}]}),
    ("POST", "/v1/models/fake:frobnicate", {"contents": [{"parts": [{"text": "hi"}]}]}),
    ("POST", "/v1beta/models/fake", {"contents": [{"parts": [{"text": "hi"}]}]}),
    ("GET", "/v1beta/cachedContents/nope", None),
    ("PATCH", "/v1beta/cachedContents/nope", {"ttl": "60s"}),
    ("DELETE", "/v1beta/cachedContents/nope", None),
    (
        "POST",
        "/v1beta/models/fake:generateContent",
        {"contents": [{"parts": [{"text": "hi"}]}], "cachedContent": "cachedContents/nope"},
    ),
]


@pytest.mark.parametrize(("method", "path", "body"), GEMINI_MISSES)
def test_a_gemini_miss_is_worded_alike_in_both_modes(both, method, path, body):
    """An unknown model method and a missing cache: one error object in both modes (the
    shared ``gemini_routes.split_model_method`` / ``cache_miss``); the cache routes name
    ``name`` (get, patch and delete alike), a body's ``cachedContent`` field names that."""
    local, proxy = both
    with httpx.Client(timeout=60) as http:
        a = http.request(method, local + path, json=body)
        b = http.request(method, proxy + path, json=body)
    assert a.status_code == b.status_code == 404, (a.text, b.text)
    assert a.json() == b.json(), (a.text, b.text)
    said = a.json()["error"]
    if "frobnicate" in path:
        assert "method 'frobnicate' is not served" in said["message"], said
    if "cachedContents/" in path:
        fields = [v["field"] for d in said["details"] for v in d.get("fieldViolations", [])]
        assert fields == ["name"], said
