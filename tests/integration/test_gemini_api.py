"""Gemini's API (``/v1beta``) on the real gateway and the real aidreams-260k model, driven by
the official ``google-genai`` client: generate, stream == non-stream, countTokens == usage,
models, Gemini-shaped errors, the ``cachedContents`` lifecycle on the prefix pins, cached token
counts on repeats and through a named cache, another key refused a key's cache.

aidreams has a 128-token context: prompts are short and answers a few tokens.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

genai = pytest.importorskip("google.genai")
pytest.importorskip("prefixgate.engine.async_engine")

from google.genai import errors as genai_errors  # noqa: E402
from google.genai import types  # noqa: E402
from prefixgate.gateway.local.serving import LOCAL  # noqa: E402
from support.gateway import serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams"
KEY_A, KEY_B = "sk-gemini-a", "sk-gemini-b"


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(
        aidreams_path, model_name=MODEL, max_queued_requests=32, api_keys=[KEY_A, KEY_B]
    )


def _client(server, key: str = KEY_A):
    return genai.Client(
        api_key=key,
        http_options=types.HttpOptions(base_url=server.url, api_version="v1beta"),
    )


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def _system(tag: str) -> str:
    """A system instruction of ~70 tokens, unique per test (no test reads another's cache)."""
    return f"[{tag}] " + "You are a friendly storyteller who tells short tales about cats. " * 2


def _greedy(n: int = 4, **more) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(temperature=0, max_output_tokens=n, **more)


def test_generate_text_usage_and_finish(server, client, pool_whole):
    r = client.models.generate_content(model=MODEL, contents="Once upon a time", config=_greedy())
    assert isinstance(r.text, str) and r.text
    c = r.candidates[0]
    assert c.finish_reason == types.FinishReason.MAX_TOKENS
    u = r.usage_metadata
    assert u.candidates_token_count == 4
    assert u.total_token_count == u.prompt_token_count + 4
    assert u.cached_content_token_count == 0 or u.cached_content_token_count is not None
    counted = client.models.count_tokens(model=MODEL, contents="Once upon a time")
    assert counted.total_tokens == u.prompt_token_count
    wait_idle(server, pool_whole)


def test_stream_equals_generate(server, client, pool_whole):
    contents = "Tell me about a dog"
    whole = client.models.generate_content(model=MODEL, contents=contents, config=_greedy(6))
    chunks = list(
        client.models.generate_content_stream(model=MODEL, contents=contents, config=_greedy(6))
    )
    assert "".join(ch.text or "" for ch in chunks) == whole.text
    last = chunks[-1]
    assert last.candidates[0].finish_reason == whole.candidates[0].finish_reason
    assert last.usage_metadata.candidates_token_count == 6
    assert last.usage_metadata.prompt_token_count == whole.usage_metadata.prompt_token_count
    wait_idle(server, pool_whole)


def test_system_instruction_cached_on_repeat(server, client, pool_whole):
    """Implicit caching: the same systemInstruction again is served from the prefix cache."""
    system = _system(uuid.uuid4().hex[:8])
    cfg = _greedy(2, system_instruction=system)
    first = client.models.generate_content(model=MODEL, contents="A story.", config=cfg)
    assert first.usage_metadata.cached_content_token_count == 0
    again = client.models.generate_content(model=MODEL, contents="Another one.", config=cfg)
    assert again.usage_metadata.cached_content_token_count >= 48
    wait_idle(server, pool_whole)


def test_models_list_and_get(server, client):
    names = [m.name for m in client.models.list()]
    assert names == [f"models/{MODEL}"]
    m = client.models.get(model=MODEL)
    assert m.name == f"models/{MODEL}" and m.input_token_limit == 128
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.get(model="gemini-9")
    assert e.value.code == 404 and e.value.status == "NOT_FOUND"


def test_candidates_and_stop_sequences(server, client, pool_whole):
    r = client.models.generate_content(
        model=MODEL,
        contents="Once upon a time",
        config=types.GenerateContentConfig(candidate_count=2, max_output_tokens=3, seed=7),
    )
    assert [c.index for c in r.candidates] == [0, 1]
    assert r.usage_metadata.candidates_token_count <= 6
    wait_idle(server, pool_whole)


def test_errors_in_gemini_shape(server, client):
    url = f"{server.url}/v1beta/models/{MODEL}:generateContent"
    with httpx.Client() as h:
        # unknown field: named
        r = h.post(
            url,
            headers={"x-goog-api-key": KEY_A},
            json={"contents": [{"parts": [{"text": "hi"}]}], "cachedContentz": "x"},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["status"] == "INVALID_ARGUMENT" and err["code"] == 400
        assert "cachedContentz" in err["message"]
        # an image part: refused by name
        r = h.post(
            url,
            params={"key": KEY_A},
            json={"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]},
        )
        assert r.status_code == 400 and "inlineData" in r.json()["error"]["message"]
        # no key / wrong key
        r = h.post(url, json={"contents": [{"parts": [{"text": "hi"}]}]})
        assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED"
        r = h.post(url, params={"key": "nope"}, json={"contents": [{"parts": [{"text": "x"}]}]})
        assert r.status_code == 401
        # ?key= is taken only on Gemini's routes and /v1/models, where it is a Google
        # client's (Google's REST examples list the models so): Gemini's list
        r = h.get(f"{server.url}/v1/models", params={"key": KEY_A})
        assert r.status_code == 200 and r.json()["models"][0]["name"] == f"models/{MODEL}"
        r = h.post(f"{server.url}/v1/chat/completions", params={"key": KEY_A}, json={})
        assert r.status_code == 401
        # an unknown method, a bad alt
        r = h.post(f"{server.url}/v1beta/models/{MODEL}:embedContent", params={"key": KEY_A})
        assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
        r = h.post(
            f"{server.url}/v1beta/models/{MODEL}:streamGenerateContent",
            params={"key": KEY_A},
            json={"contents": [{"parts": [{"text": "hi"}]}]},
        )
        assert r.status_code == 400 and "alt" in r.json()["error"]["message"]
    # through the client: a too-long answer
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(
            model=MODEL, contents="hi", config=types.GenerateContentConfig(max_output_tokens=500)
        )
    assert e.value.code == 400 and "maxOutputTokens" in e.value.message
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(model="other", contents="hi")
    assert e.value.code == 404


def test_safety_settings_taken(server, client, pool_whole):
    cfg = _greedy(
        2,
        safety_settings=[
            types.SafetySetting(
                category=types.HarmCategory.HARM_CATEGORY_HATE_SPEECH,
                threshold=types.HarmBlockThreshold.BLOCK_NONE,
            )
        ],
    )
    r = client.models.generate_content(model=MODEL, contents="hello", config=cfg)
    assert r.usage_metadata.candidates_token_count == 2
    wait_idle(server, pool_whole)


def test_cache_lifecycle_and_reads(server, client, pool_whole):
    system = _system(uuid.uuid4().hex[:8])
    cache = client.caches.create(
        model=MODEL,
        config=types.CreateCachedContentConfig(
            system_instruction=system, ttl="120s", display_name="stories"
        ),
    )
    assert cache.name.startswith("cachedContents/pfx-")
    assert cache.display_name == "stories"
    assert cache.usage_metadata.total_token_count >= 48
    assert server.app[LOCAL].engine.stats()["pinned_blocks"] >= 3
    got = client.caches.get(name=cache.name)
    assert got.name == cache.name and got.expire_time == cache.expire_time
    assert cache.name in [c.name for c in client.caches.list()]
    # generate through the named cache: its pinned blocks are read
    r = client.models.generate_content(
        model=MODEL, contents="A story.", config=_greedy(2, cached_content=cache.name)
    )
    assert r.usage_metadata.cached_content_token_count >= 48
    # the same system prompt sent inline lands on the same cached blocks
    inline = client.models.generate_content(
        model=MODEL, contents="Another.", config=_greedy(2, system_instruction=system)
    )
    assert inline.usage_metadata.cached_content_token_count >= 48
    # the pin is the prefix API's too
    with httpx.Client() as h:
        pid = cache.name.removeprefix("cachedContents/")
        p = h.get(f"{server.url}/v1/prefixes/{pid}", headers={"Authorization": f"Bearer {KEY_A}"})
        assert p.status_code == 200 and p.json()["id"] == pid
    # a systemInstruction beside cachedContent is refused, as Gemini does
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(
            model=MODEL,
            contents="x",
            config=_greedy(2, cached_content=cache.name, system_instruction="other"),
        )
    assert e.value.code == 400
    # the TTL patched
    longer = client.caches.update(
        name=cache.name, config=types.UpdateCachedContentConfig(ttl="600s")
    )
    assert longer.expire_time > cache.expire_time
    # another key cannot see, use, change or delete it
    other = _client(server, KEY_B)
    assert cache.name not in [c.name for c in other.caches.list()]
    for call in (
        lambda: other.caches.get(name=cache.name),
        lambda: other.caches.delete(name=cache.name),
        lambda: other.caches.update(
            name=cache.name, config=types.UpdateCachedContentConfig(ttl="60s")
        ),
        lambda: other.models.generate_content(
            model=MODEL, contents="x", config=_greedy(2, cached_content=cache.name)
        ),
    ):
        with pytest.raises(genai_errors.ClientError) as e:
            call()
        assert e.value.code == 404 and e.value.status == "NOT_FOUND"
    client.caches.delete(name=cache.name)
    with pytest.raises(genai_errors.ClientError) as e:
        client.caches.get(name=cache.name)
    assert e.value.code == 404
    wait_idle(server, pool_whole)


WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="The weather in a city",
    parameters=types.Schema(
        type=types.Type.OBJECT,
        properties={"city": types.Schema(type=types.Type.STRING, max_length=8)},
        required=["city"],
    ),
)


def _forced(n: int = 40, **more) -> types.GenerateContentConfig:
    return _greedy(
        n,
        tools=[types.Tool(function_declarations=[WEATHER])],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(
                mode=types.FunctionCallingConfigMode.ANY
            )
        ),
        **more,
    )


def test_forced_function_call_and_its_response(server, client, pool_whole):
    ask = "Weather in Paris?"
    whole = client.models.generate_content(model=MODEL, contents=ask, config=_forced())
    (call,) = whole.function_calls
    assert call.name == "get_weather" and isinstance(call.args["city"], str)
    assert len(call.args["city"]) <= 8
    assert whole.candidates[0].finish_reason == types.FinishReason.STOP
    chunks = list(
        client.models.generate_content_stream(model=MODEL, contents=ask, config=_forced())
    )
    streamed = [fc for ch in chunks for fc in (ch.function_calls or [])]
    assert [(c.name, c.args) for c in streamed] == [(call.name, call.args)]
    # the answer goes back as a functionResponse turn
    history = [
        types.Content(role="user", parts=[types.Part(text=ask)]),
        whole.candidates[0].content,
        types.Content(
            role="user",
            parts=[types.Part.from_function_response(name="get_weather", response={"sky": "sun"})],
        ),
    ]
    none = types.ToolConfig(
        function_calling_config=types.FunctionCallingConfig(
            mode=types.FunctionCallingConfigMode.NONE
        )
    )
    reply = client.models.generate_content(
        model=MODEL,
        contents=history,
        config=_greedy(3, tools=[types.Tool(function_declarations=[WEATHER])], tool_config=none),
    )
    assert reply.usage_metadata.candidates_token_count <= 3 and not reply.function_calls
    # without a tool-call parser, AUTO (the default with tools) is a 400, not ignored
    with pytest.raises(genai_errors.ClientError) as e:
        client.models.generate_content(
            model=MODEL,
            contents=ask,
            config=_greedy(4, tools=[types.Tool(function_declarations=[WEATHER])]),
        )
    assert e.value.code == 400
    wait_idle(server, pool_whole)


def test_json_response_schema(server, client, pool_whole):
    schema = types.Schema(
        type=types.Type.OBJECT,
        properties={"name": types.Schema(type=types.Type.STRING, max_length=6)},
        required=["name"],
    )
    cfg = _greedy(30, response_mime_type="application/json", response_schema=schema)
    r = client.models.generate_content(model=MODEL, contents="A cat's name?", config=cfg)
    assert r.candidates[0].finish_reason == types.FinishReason.STOP, r
    value = json.loads(r.text)
    assert set(value) == {"name"} and len(value["name"]) <= 6
    js = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cfg = _greedy(20, response_mime_type="application/json", response_json_schema=js)
    r = client.models.generate_content(model=MODEL, contents="A number?", config=cfg)
    assert isinstance(json.loads(r.text)["n"], int)
    wait_idle(server, pool_whole)


def test_one_pin_under_every_dialect(server, client, pool_whole):
    """A system prompt cached through Gemini's cachedContents is read by the same key's
    Anthropic Messages (cache_control) and OpenAI chat requests: one pin, the same blocks."""
    anthropic = pytest.importorskip("anthropic")
    import openai

    system = _system(uuid.uuid4().hex[:8])
    cache = client.caches.create(
        model=MODEL, config=types.CreateCachedContentConfig(system_instruction=system, ttl="60s")
    )
    pinned = cache.usage_metadata.total_token_count // 16 * 16 - 16
    an = anthropic.Anthropic(base_url=server.url, api_key=KEY_A, max_retries=0)
    m = an.messages.create(
        model=MODEL,
        max_tokens=2,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "A story."}],
    )
    assert m.usage.cache_read_input_tokens >= pinned >= 48
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)
    c = oa.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi."}],
    )
    assert c.usage.prompt_tokens_details.cached_tokens >= pinned
    # another key's identical prompt does not read this key's blocks (tenant salts)
    second = _client(server, KEY_B)  # kept: a dropped Client closes its connection pool
    other = second.models.generate_content(
        model=MODEL, contents="A story.", config=_greedy(2, system_instruction=system)
    )
    assert other.usage_metadata.cached_content_token_count == 0
    client.caches.delete(name=cache.name)
    wait_idle(server, pool_whole, pinned_ok=True)


# --- proxy mode: a prefixgate proxy in front of the aidreams server ----------------------------
PROXY_A, PROXY_B = "pk-gemini-a", "pk-gemini-b"


@pytest.fixture(scope="module")
def proxy(server):
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings

    settings = GatewaySettings(api_keys=[PROXY_A, PROXY_B], upstream_api_key=KEY_A)
    with BackgroundServer(lambda: create_proxy_app([server.url], settings)) as gw:
        probe = _client(gw, PROXY_A)  # kept: a dropped Client closes its connection pool
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the upstream's models discovered
            if list(probe.models.list()):
                break
            time.sleep(0.1)
        yield gw


def test_proxy_generate_stream_count(server, proxy, pool_whole):
    pc = _client(proxy, PROXY_A)
    lc = _client(server, KEY_A)
    contents = "Once upon a time"
    via = pc.models.generate_content(model=MODEL, contents=contents, config=_greedy(5))
    direct = lc.models.generate_content(model=MODEL, contents=contents, config=_greedy(5))
    assert via.text == direct.text
    assert via.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    u = via.usage_metadata
    assert (u.prompt_token_count, u.candidates_token_count) == (
        direct.usage_metadata.prompt_token_count,
        5,
    )
    assert u.cached_content_token_count is not None  # a prefixgate upstream reports it
    chunks = list(
        pc.models.generate_content_stream(model=MODEL, contents=contents, config=_greedy(5))
    )
    assert "".join(c.text or "" for c in chunks) == via.text
    assert chunks[-1].usage_metadata.candidates_token_count == 5
    counted = pc.models.count_tokens(model=MODEL, contents=contents)
    assert counted.total_tokens == u.prompt_token_count
    assert [m.name for m in pc.models.list()] == [f"models/{MODEL}"]
    with pytest.raises(genai_errors.ClientError) as e:
        pc.models.generate_content(model="nope", contents="x")
    assert e.value.code == 404 and e.value.status == "NOT_FOUND"
    with pytest.raises(genai_errors.ClientError) as e:
        pc.models.generate_content(
            model=MODEL, contents="x", config=types.GenerateContentConfig(max_output_tokens=500)
        )
    assert e.value.code == 400
    bad = httpx.post(
        f"{proxy.url}/v1beta/models/{MODEL}:generateContent",
        headers={"x-goog-api-key": PROXY_A},
        json={"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]},
    )
    assert bad.status_code == 400 and "inlineData" in bad.json()["error"]["message"]
    wait_idle(server, pool_whole, pinned_ok=True)


def test_proxy_function_call_and_json(server, proxy, pool_whole):
    pc = _client(proxy, PROXY_A)
    r = pc.models.generate_content(model=MODEL, contents="Weather in Paris?", config=_forced())
    (call,) = r.function_calls
    assert call.name == "get_weather" and isinstance(call.args["city"], str)
    js = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cfg = _greedy(20, response_mime_type="application/json", response_json_schema=js)
    r = pc.models.generate_content(model=MODEL, contents="A number?", config=cfg)
    assert isinstance(json.loads(r.text)["n"], int)
    wait_idle(server, pool_whole, pinned_ok=True)


def test_proxy_caches_on_the_upstream_prefix_api(server, proxy, pool_whole):
    pc = _client(proxy, PROXY_A)
    system = _system(uuid.uuid4().hex[:8])
    cache = pc.caches.create(
        model=MODEL, config=types.CreateCachedContentConfig(system_instruction=system, ttl="120s")
    )
    assert cache.name.startswith("cachedContents/pfx-")
    assert cache.usage_metadata.total_token_count >= 48
    assert pc.caches.get(name=cache.name).expire_time == cache.expire_time
    assert cache.name in [c.name for c in pc.caches.list()]
    r = pc.models.generate_content(
        model=MODEL, contents="A story.", config=_greedy(2, cached_content=cache.name)
    )
    assert r.usage_metadata.cached_content_token_count >= 48
    # what the upstream prefix API cannot do: said plainly
    with pytest.raises(genai_errors.ClientError) as e:  # a field not implemented: a 400
        pc.caches.update(name=cache.name, config=types.UpdateCachedContentConfig(ttl="600s"))
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    assert e.value.details["error"]["details"][0]["fieldViolations"][0]["field"] == "ttl"
    other = _client(proxy, PROXY_B)
    assert cache.name not in [c.name for c in other.caches.list()]
    with pytest.raises(genai_errors.ClientError) as e:
        other.caches.get(name=cache.name)
    assert e.value.code == 404
    with pytest.raises(genai_errors.ClientError) as e:
        other.models.generate_content(
            model=MODEL, contents="x", config=_greedy(2, cached_content=cache.name)
        )
    assert e.value.code == 404
    pc.caches.delete(name=cache.name)
    with pytest.raises(genai_errors.ClientError) as e:
        pc.caches.get(name=cache.name)
    assert e.value.code == 404
    wait_idle(server, pool_whole, pinned_ok=True)
