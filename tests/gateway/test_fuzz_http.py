"""Fuzz of the HTTP API: whatever a client sends — body, headers, query, in
local and proxy mode — is answered with a 4xx OpenAI error (Anthropic's on ``/v1/messages``)
at worst, never a 5xx; afterwards
the server is healthy and the KV pool whole.

Hypothesis strategies of our own generate requests over every route: JSON bodies with the
OpenAI fields (and the Messages API's) holding values of every JSON type (NaN, huge integers, lone surrogates,
special-token strings, nesting), raw and invalid-UTF-8 bytes, truncated JSON, random headers
(keys, content types and encodings) and query strings; a quarter of the requests are
well-formed generations (the key, JSON, valid field values), each of which must be served,
so the fuzz reaches the engine at any ``FUZZ_EXAMPLES`` (a count of 200s also held those of
``/health``, and at 100 examples fell to 10). ``FUZZ_EXAMPLES`` requests per mode
(1,000 by default) against the fake engine (no per-token delay; proxy mode forwards to a real
prefixgate gateway serving it).
"""

from __future__ import annotations

import gzip
import json
import os
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.settings import GatewaySettings
from support.fuzz import live_server_settings

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))

ODD = ["\ud800", "\udfff", "\x00", "<s>", "</s>", "<|im_start|>system\n", "é", "🤖", "\n", " "]
odd_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(ODD),
    st.lists(st.sampled_from(ODD) | st.text(max_size=3), max_size=4).map("".join),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=6),
    st.floats(allow_nan=True, allow_infinity=True),
    odd_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
    max_leaves=6,
)
small_int = st.integers(min_value=-2, max_value=5)
text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])}).flatmap(
    lambda d: st.fixed_dictionaries({**{k: st.just(v) for k, v in d.items()}, "text": odd_text})
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", ""])
        | json_values,
        "content": odd_text | st.lists(text_part, max_size=2) | json_values,
        "name": odd_text,
    },
)
MODEL = st.sampled_from(["fake", "fake", "fake", "other"]) | json_values
COMMON = {
    "max_tokens": small_int | json_values,
    "max_completion_tokens": small_int,
    "n": st.integers(min_value=-1, max_value=3) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values})
    | json_values,
    "temperature": st.floats(allow_nan=True) | json_values,
    "top_p": st.floats(allow_nan=True),
    "top_k": small_int,
    "stop": odd_text | st.lists(odd_text, max_size=3) | json_values,
    "seed": st.integers(min_value=-(2**65), max_value=2**65),
    "logprobs": st.booleans() | small_int | json_values,
    "top_logprobs": small_int,
    "cache_salt": odd_text | json_values,
    "presence_penalty": st.floats(allow_nan=True),
    "repetition_penalty": st.floats(allow_nan=True),
    "stop_token_ids": st.lists(st.integers(min_value=-5, max_value=400), max_size=3),
    "ignore_eos": st.booleans(),
    "user": odd_text,
    "response_format": json_values,
    "tools": json_values,
}
chat_body = st.fixed_dictionaries(
    {"model": MODEL, "messages": st.lists(message, min_size=1, max_size=3)},
    optional={**COMMON, "prefix_id": odd_text | json_values, "extra": json_values},
)
completion_body = st.fixed_dictionaries(
    {"model": MODEL},
    optional={
        **COMMON,
        "prompt": odd_text
        | st.lists(st.integers(min_value=-3, max_value=300), max_size=5)
        | st.lists(odd_text | st.lists(st.integers(0, 300), max_size=3), max_size=3)
        | json_values,
        "echo": json_values,
        "suffix": json_values,
    },
)
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "tool_use", "tool_result", "image"]) | json_values},
    optional={
        "text": odd_text | json_values,
        "cache_control": st.just({"type": "ephemeral"}) | json_values,
        "id": odd_text,
        "name": odd_text,
        "input": json_values,
        "tool_use_id": odd_text,
        "content": odd_text | json_values,
    },
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "assistant"]) | json_values,
        "content": odd_text | st.lists(block, max_size=3) | json_values,
    }
)
messages_body = st.fixed_dictionaries(
    {"model": MODEL, "messages": st.lists(anthropic_message, min_size=1, max_size=3)},
    optional={
        "max_tokens": small_int | json_values,
        "system": odd_text | st.lists(block, max_size=2) | json_values,
        "stream": st.booleans() | json_values,
        "temperature": st.floats(allow_nan=True) | json_values,
        "top_k": small_int,
        "stop_sequences": st.lists(odd_text, max_size=3) | json_values,
        "cache_salt": odd_text | json_values,
        "tools": json_values,
        "cache_control": json_values,
    },
)
prefix_body = st.fixed_dictionaries(
    {"model": MODEL, "messages": st.lists(message, max_size=2)},
    optional={"ttl_seconds": st.floats(allow_nan=True) | json_values, "cache_salt": odd_text},
)
gemini_part = st.fixed_dictionaries(
    {},
    optional={
        "text": odd_text | json_values,
        "functionCall": st.fixed_dictionaries({"name": odd_text, "args": json_values})
        | json_values,
        "functionResponse": st.fixed_dictionaries({"name": odd_text, "response": json_values})
        | json_values,
        "inlineData": json_values,
    },
)
gemini_content = st.fixed_dictionaries(
    {"parts": st.lists(gemini_part, max_size=3) | json_values},
    optional={"role": st.sampled_from(["user", "model", "system", ""]) | json_values},
)
gemini_body = st.fixed_dictionaries(
    {"contents": st.lists(gemini_content, max_size=3) | json_values},
    optional={
        "systemInstruction": gemini_content | json_values,
        "generationConfig": st.fixed_dictionaries(
            {},
            optional={
                "maxOutputTokens": small_int | json_values,
                "temperature": st.floats(allow_nan=True) | json_values,
                "topK": small_int,
                "candidateCount": small_int,
                "stopSequences": st.lists(odd_text, max_size=3) | json_values,
                "responseMimeType": st.sampled_from(["application/json", "text/plain", "x"]),
                "responseSchema": json_values,
                "seed": st.integers(min_value=-(2**65), max_value=2**65),
            },
        )
        | json_values,
        "tools": json_values,
        "toolConfig": json_values,
        "safetySettings": json_values,
        "cachedContent": odd_text | json_values,
    },
)
cache_body = st.fixed_dictionaries(
    {"model": MODEL.map(lambda m: f"models/{m}" if isinstance(m, str) else m)},
    optional={
        "systemInstruction": gemini_content | json_values,
        "contents": st.lists(gemini_content, max_size=2) | json_values,
        "ttl": st.sampled_from(["60s", "0s", "5m", "1.5s", "99999999s"]) | odd_text,
        "expireTime": odd_text,
        "displayName": odd_text,
    },
)
ROUTES = [
    ("POST", "/v1/chat/completions", chat_body),
    ("POST", "/v1/completions", completion_body),
    ("POST", "/v1/prefixes", prefix_body),
    ("POST", "/v1/messages", messages_body),
    ("POST", "/v1/messages/count_tokens", messages_body),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/fake", None),
    ("GET", "/v1/models/%ff%zz", None),
    ("GET", "/v1/prefixes/pfx-0", None),
    ("DELETE", "/v1/prefixes/pfx-%00", None),
    ("PUT", "/v1/chat/completions", chat_body),
    ("GET", "/v1/chat/completions", None),
    ("POST", "/v1/nowhere", json_values),
    ("GET", "/health", None),
    ("GET", "/ready", None),
    ("POST", "/v1beta/models/fake:generateContent", gemini_body),
    ("POST", "/v1beta/models/fake:streamGenerateContent?alt=sse", gemini_body),
    ("POST", "/v1beta/models/fake:countTokens", gemini_body),
    ("POST", "/v1beta/models/other:generateContent", gemini_body),
    ("POST", "/v1beta/models/fake:nothing", gemini_body),
    ("GET", "/v1beta/models", None),
    ("GET", "/v1beta/models/fake", None),
    ("POST", "/v1beta/cachedContents", cache_body),
    ("GET", "/v1beta/cachedContents", None),
    ("GET", "/v1beta/cachedContents/pfx-0", None),
    ("PATCH", "/v1beta/cachedContents/pfx-0", cache_body),
    ("DELETE", "/v1beta/cachedContents/pfx-%00", None),
]
# A quarter of the requests are well-formed (the key, JSON, valid values of the fields): among
# so many fields with junk values, nearly no other request reaches the engine, and every one
# of these must be served (200).
plain_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12)
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": plain_text}
)
VALID_COMMON = {
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "stop": st.lists(plain_text.filter(bool), max_size=2),
    "user": plain_text,
}
valid_chat = st.fixed_dictionaries(
    {
        "model": st.just("fake"),
        "messages": st.tuples(
            valid_message, st.fixed_dictionaries({"role": st.just("user"), "content": plain_text})
        ).map(list),
    },
    optional={**VALID_COMMON, "logprobs": st.booleans(), "cache_salt": plain_text.filter(bool)},
)
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just("fake"),
        "prompt": plain_text.filter(bool) | st.lists(st.integers(0, 255), min_size=1, max_size=5),
    },
    optional=VALID_COMMON,
)
valid_messages = st.fixed_dictionaries(
    {
        "model": st.just("fake"),
        "max_tokens": st.integers(1, 4),
        "messages": st.just([]).map(lambda _: [{"role": "user", "content": "hi"}])
        | st.lists(
            # non-empty: Anthropic refuses an empty turn (anthropic_models.check_turns)
            st.fixed_dictionaries({"role": st.just("user"), "content": plain_text.filter(bool)}),
            min_size=1,
            max_size=1,
        ),
    },
    optional={"system": plain_text, "temperature": st.floats(0, 1), "stream": st.booleans()},
)
valid_gemini = st.fixed_dictionaries(
    {
        "contents": st.lists(
            st.fixed_dictionaries(
                {"role": st.just("user"), "parts": st.just([]).map(lambda _: [{"text": "hi"}])}
            ),
            min_size=1,
            max_size=1,
        )
    },
    optional={
        "systemInstruction": st.fixed_dictionaries(
            {"parts": st.lists(st.fixed_dictionaries({"text": plain_text}), min_size=1, max_size=2)}
        ),
        "generationConfig": st.fixed_dictionaries(
            {"maxOutputTokens": st.integers(1, 4)},
            optional={"temperature": st.floats(0, 2), "seed": st.integers(0, 2**63 - 1)},
        ),
    },
)
VALID_ROUTES = [
    ("POST", "/v1beta/models/fake:generateContent", valid_gemini),
    ("POST", "/v1/chat/completions", valid_chat),
    ("POST", "/v1/completions", valid_completion),
    ("POST", "/v1/messages", valid_messages),
]
GENERATING = {  # the routes whose 200 is an answer of the engine, not of the parser
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1beta/models/fake:generateContent"),
}
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=20
).map(str.strip)  # h11 (the client) refuses values with outer whitespace


@st.composite
def requests(draw) -> tuple[str, str, dict[str, bytes], bytes]:
    """(method, path with query, headers, body bytes)."""
    if draw(st.integers(0, 3)) == 0:
        method, path, body_strategy = draw(st.sampled_from(VALID_ROUTES))
        body = json.dumps(draw(body_strategy)).encode()
        valid = {"Authorization": b"Bearer k", "Content-Type": b"application/json"}
        return method, path, {**valid, "X-Fuzz-Valid": b"1"}, body
    method, path, body_strategy = draw(st.sampled_from(ROUTES))
    body = b""
    if body_strategy is not None:
        how = draw(st.sampled_from(["json", "json", "json", "utf8", "raw", "cut", "gzip"]))
        value = draw(body_strategy | json_values if how != "json" else body_strategy)
        text = json.dumps(value, ensure_ascii=how == "json", allow_nan=True)
        body = text.encode("utf-8", "surrogatepass")  # lone surrogates: invalid UTF-8 bytes
        if how == "raw":
            body = draw(st.binary(max_size=40))
        elif how == "cut":
            body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
        elif how == "gzip":
            body = gzip.compress(body)
    headers: dict[str, bytes] = {}
    auth = draw(
        st.sampled_from(
            [None, "Bearer k", "Bearer k", "Bearer wrong", "bearer  k", "Basic k", "Bearer k\xe9"]
        )
        | header_text
    )
    if auth is not None:
        headers["Authorization"] = auth.encode("latin-1")
    ctype = draw(st.sampled_from([None, "application/json", "text/plain", "x/y; charset=zz"]))
    if ctype:
        headers["Content-Type"] = ctype.encode()
    encoding = draw(st.sampled_from([None, None, "gzip", "deflate", "br", "zz"]))
    if encoding:
        headers["Content-Encoding"] = encoding.encode()
    for name, value in draw(
        st.dictionaries(
            st.sampled_from(["X-Junk", "Accept", "Accept-Encoding", "Cookie", "Expect", "Range"]),
            header_text,
            max_size=2,
        )
    ).items():
        headers[name] = value.encode("latin-1")
    query = draw(st.sampled_from(["", "", "?a=1", "?%zz=%ff", "?stream=true&&=", "?x=" + "y" * 50]))
    return method, path + query, headers, body


def _parser_refusal(r: httpx.Response) -> bool:
    """aiohttp's HTTP parser refuses some framing before any app code runs (an unsupported
    ``Content-Encoding`` such as ``br`` without Brotli, undecodable gzip in the headers' phase):
    a plain-text 400 — a 4xx, but not ours to shape."""
    return r.status_code == 400 and r.headers.get("Content-Type", "").startswith("text/plain")


def _fuzz(url: str) -> dict[int, int]:
    statuses: dict[int, int] = {}
    failures: list[str] = []
    previous: list = []
    served: list[str] = []
    with httpx.Client(base_url=url, timeout=30) as http:

        @live_server_settings(EXAMPLES)
        @given(requests())
        def one(req: tuple[str, str, dict[str, bytes], bytes]) -> None:
            method, path, headers, body = req
            try:
                r = http.request(method, path, headers=headers, content=body)
            except httpx.TransportError as exc:  # the server broke the connection: a fault
                failures.append(f"{exc!r} on {req}, after {previous[-1:]}")
                return
            finally:
                previous.append(req)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 200 and (method, path.split("?")[0]) in GENERATING:
                served.append(path)
            if headers.get("X-Fuzz-Valid") and r.status_code != 200:
                failures.append(f"valid request refused: {r.status_code} {path} {body!r}: {r.text}")
            if r.status_code >= 500:
                failures.append(
                    f"{r.status_code} {method} {path} {headers} {body[:200]!r}: {r.text}"
                )
            elif r.status_code >= 400 and not _parser_refusal(r):
                err = r.json()["error"]  # every refusal is its dialect's error object
                # aiohttp's parser may refuse a request before its path is known (headers it
                # cannot decode): then no route's dialect applies, the answer is OpenAI's
                pathless = err.get("code") == "invalid_http_request"
                if path.startswith("/v1beta/") and not pathless:  # Gemini's: code, message, status
                    assert err["code"] == r.status_code and err["status"], err
                    assert isinstance(err["message"], str), err
                else:
                    assert isinstance(err["message"], str) and err["type"], err

        one()
    assert not failures, "\n".join(failures[:10])
    assert sum(statuses.values()) >= EXAMPLES
    # The strategies reach the engine, not only the parser: a 200 of /health or /v1/models
    # does not count (at 1,000 examples not one generation was answered before the valid
    # share), one of a generating route does.
    assert len(served) >= max(1, EXAMPLES // 20), (len(served), statuses)
    print(f"{len(served)} generations answered 200")
    return statuses


def _keys(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "k", "salt": "s"}]}))
    return str(path)


def _healthy_and_whole(srv: BackgroundServer, engine, gw) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        assert http.get("/metrics").status_code == 200
    srv.call(srv.app[LOCAL].cache_pins.settle)  # Messages breakpoints pin in the background
    stats = gw.wait_idle(srv, engine)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["kv_blocks_used"] == stats["pinned_blocks"], stats


def test_fuzz_local_mode(serve_fake, gw, tmp_path):
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=_keys(tmp_path)), token_delay_s=0.0
    )
    t0 = time.monotonic()
    statuses = _fuzz(srv.url)
    print(f"local: {statuses} in {time.monotonic() - t0:.1f} s")
    assert statuses.get(200, 0) > 10  # the strategies reach the engine, not only the parser
    _healthy_and_whole(srv, engine, gw)


def test_fuzz_proxy_mode(serve_fake, gw, tmp_path):
    upstream, engine = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    settings_ = GatewaySettings(keys_file=_keys(tmp_path))
    with BackgroundServer(lambda: create_proxy_app([upstream.url], settings_)) as proxy:
        t0 = time.monotonic()
        statuses = _fuzz(proxy.url)
        print(f"proxy: {statuses} in {time.monotonic() - t0:.1f} s")
        assert statuses.get(200, 0) > 10
        with httpx.Client(base_url=proxy.url, timeout=10) as http:
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200
    _healthy_and_whole(upstream, engine, gw)


pytestmark = pytest.mark.timeout(600)
