"""prefixgate's proxy in front of a real vLLM 0.32 (``conftest.vllm_server``) and a prefixgate
upstream serving another model (aidreams-260k), on loopback.

One gateway (``--routing precise`` on vLLM's live KV events, two tenant keys with salts)
relays:

- chat, completions and their streams; a conversation with tools (a call and its result);
  Anthropic Messages (translated to chat for vLLM), non-streamed and streamed, with the
  cached tokens vLLM reports (``cache_read_input_tokens``); OpenAI's Responses API (translated
  to chat for vLLM) through the ``openai`` client, whole and streamed;
- by ``model``: ``smollm2`` goes to vLLM, ``aidreams-260k`` to the prefixgate upstream;
- ``/tokenize`` and ``/detokenize``: vLLM's own answers, relayed as they are;
- precise routing: after sequential traffic over shared system prompts the gateway's index
  equals the block set vLLM's own events give an independent consumer (a DEALER replaying
  from 0), and the predicted cached tokens equal vLLM's reported ``cached_tokens`` in at
  least 99 % of requests;
- tenancy: tenant A's salt is forwarded as vLLM's ``cache_salt``: A's second request reads
  its cached prefix, tenant B reads 0 cached tokens of A's prompt.

vLLM's weights are dummy (gibberish text): answers are checked for shape, not content. The
loads are tiny (sequential requests, a few tokens each): 2 cores.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator

import anthropic
import httpx
import pytest
import zmq
from prefixgate.engine.kv_events import parse_batch
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.kv_index import HASH_VLLM_INT, replay_frames
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.settings import GatewaySettings
from support.kv_replicas import random_text, serve_kv_replicas

from tests.interop.conftest import BLOCK_SIZE, SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

AIDREAMS = "aidreams-260k"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}
OPERATOR = "sk-operator"  # the upstreams' details on /ready are an operator's to read


@pytest.fixture(scope="module")
def aidreams_upstream(aidreams_path):
    yield from serve_kv_replicas(aidreams_path, AIDREAMS, 8, 64, [{}])


@pytest.fixture(scope="module")
def gateway(vllm_server, aidreams_upstream, tmp_path_factory) -> Iterator[BackgroundServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    specs = [{"key": k, "name": n, "salt": f"tenant-{n}"} for n, k in KEYS.items()]
    specs.append({"key": OPERATOR, "name": "ops", "role": "operator"})  # reads /ready's upstreams
    keys.write_text(json.dumps({"keys": specs}))
    settings = GatewaySettings(
        routing="precise",
        tokenizer=vllm_server.model_path,
        upstream_kv_events={vllm_server.url: (vllm_server.pub, vllm_server.replay)},
        keys_file=str(keys),
    )
    urls = [vllm_server.url, aidreams_upstream[0].url]
    with BackgroundServer(lambda: create_proxy_app(urls, settings)) as gw:
        yield gw


def _post(gw: BackgroundServer, path: str, body: dict, key: str = KEYS["a"]) -> dict:
    r = httpx.post(
        f"{gw.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def _stream(gw: BackgroundServer, path: str, body: dict, key: str = KEYS["a"]) -> list[dict]:
    """The SSE ``data:`` objects of a stream (asserting it ends with ``[DONE]``)."""
    out: list[dict] = []
    done = False
    with httpx.stream(
        "POST",
        f"{gw.url}{path}",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            out.append(json.loads(line[6:]))
    assert done and out
    return out


def test_chat_and_its_stream(gateway):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    a = _post(gateway, "/v1/chat/completions", body)
    assert a["model"] == SERVED_NAME and isinstance(a["choices"][0]["message"]["content"], str)
    assert a["choices"][0]["finish_reason"] in ("length", "stop")
    assert a["usage"]["prompt_tokens"] > 0 and a["usage"]["completion_tokens"] <= 4
    chunks = _stream(
        gateway, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["usage"]["completion_tokens"] <= 4
    assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)


def test_completions_and_its_stream(gateway):
    body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 3}
    a = _post(gateway, "/v1/completions", body)
    assert a["model"] == SERVED_NAME and isinstance(a["choices"][0]["text"], str)
    assert a["usage"]["completion_tokens"] <= 3
    chunks = _stream(gateway, "/v1/completions", body)
    assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)


def test_tools_relay(gateway):
    """A conversation with tools, an assistant's tool call and its result relays both ways
    (chat, and Messages' ``tool_use`` / ``tool_result`` blocks translated to chat). The dummy
    weights never make a valid call (vLLM 0.32 with the hermes parser does not constrain a
    named or required tool choice), so the answer is checked for shape only."""
    tool = {
        "type": "function",
        "function": {
            "name": "pick_city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "pick_city", "arguments": '{"city": "Rome"}'},
    }
    body = {
        "model": SERVED_NAME,
        "messages": [
            {"role": "user", "content": "Pick a city."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Rome it is."},
        ],
        "tools": [tool],
        "max_tokens": 3,
    }
    a = _post(gateway, "/v1/chat/completions", body)
    assert a["choices"][0]["message"]["role"] == "assistant"
    client = anthropic.Anthropic(base_url=gateway.url, api_key=KEYS["a"], max_retries=0)
    msg = client.messages.create(
        model=SERVED_NAME,
        max_tokens=3,
        tools=[
            {
                "name": "pick_city",
                "input_schema": tool["function"]["parameters"],
            }
        ],
        messages=[
            {"role": "user", "content": "Pick a city."},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "pick_city",
                        "input": {"city": "Rome"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rome."}],
            },
        ],
    )
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_anthropic_messages(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key=KEYS["a"], max_retries=0)
    msg = client.messages.create(
        model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
    )
    assert msg.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens <= 4
    with client.messages.stream(
        model=SERVED_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens <= 4
    system = random_text(random.Random(3), 80)  # the same long prompt twice: vLLM's cache
    for _ in range(2):
        msg = client.messages.create(
            model=SERVED_NAME,
            max_tokens=1,
            system=system,
            messages=[{"role": "user", "content": "Hello"}],
        )
    assert msg.usage.cache_read_input_tokens is not None
    assert msg.usage.cache_read_input_tokens >= BLOCK_SIZE
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > BLOCK_SIZE


def test_gemini_generate_and_stream_through_vllm(gateway):
    """Gemini's dialect through the proxy in front of the real vLLM: translated to chat
    completions and back, whole and streamed, usage and the system prompt's cached tokens
    as vLLM reports them."""
    genai = pytest.importorskip("google.genai")
    from google.genai import types

    client = genai.Client(
        api_key=KEYS["a"],
        http_options=types.HttpOptions(base_url=gateway.url, api_version="v1beta"),
    )
    config = types.GenerateContentConfig(max_output_tokens=4)
    r = client.models.generate_content(model=SERVED_NAME, contents="Hello", config=config)
    assert r.candidates[0].finish_reason in (types.FinishReason.MAX_TOKENS, types.FinishReason.STOP)
    assert r.usage_metadata.prompt_token_count > 0
    assert r.usage_metadata.candidates_token_count <= 4
    chunks = list(
        client.models.generate_content_stream(model=SERVED_NAME, contents="Hello", config=config)
    )
    assert chunks and chunks[-1].candidates[0].finish_reason is not None
    system = random_text(random.Random(5), 80)  # the same long system prompt twice
    cached = types.GenerateContentConfig(max_output_tokens=1, system_instruction=system)
    for _ in range(2):
        r = client.models.generate_content(model=SERVED_NAME, contents="Hello", config=cached)
    assert (r.usage_metadata.cached_content_token_count or 0) >= BLOCK_SIZE


def test_responses_through_vllm(gateway):
    """OpenAI's Responses API through the proxy in front of the real vLLM: translated to chat
    completions and back, whole and streamed (the ``openai`` client's typed events), usage and
    the system prompt's cached tokens as vLLM reports them."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEYS["a"], max_retries=0)
    r = client.responses.create(model=SERVED_NAME, input="Hello", max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.model == SERVED_NAME
    assert isinstance(r.output_text, str)
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens <= 4
    with client.responses.stream(model=SERVED_NAME, input="Hello", max_output_tokens=4) as stream:
        events = list(stream)  # (get_final_response wants response.completed; a cut one is
    kinds = [event.type for event in events]  # response.incomplete, as OpenAI's)
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens <= 4
    system = random_text(random.Random(7), 80)  # the same long instructions twice: vLLM's cache
    for _ in range(2):
        r = client.responses.create(
            model=SERVED_NAME, instructions=system, input="Hello", max_output_tokens=1
        )
    assert r.usage is not None
    assert (r.usage.input_tokens_details.cached_tokens or 0) >= BLOCK_SIZE


def test_a_request_s_own_cache_salt_reaches_vllm(gateway):
    """A request's ``cache_salt`` nested in its key's (``keys.effective_salt``) is one vLLM
    takes (no NUL, ``/`` or ``@``; vLLM 0.32 refuses the request otherwise) and splits the
    key's partition there: the same salt reads the cache, another salt or key does not."""
    system = random_text(random.Random(13), 80)
    body = {"model": SERVED_NAME, "instructions": system, "input": "Hi", "max_output_tokens": 1}

    def cached(salt: str, key: str = KEYS["a"]) -> int:
        usage = _post(gateway, "/v1/responses", {**body, "cache_salt": salt}, key)["usage"]
        return usage["input_tokens_details"]["cached_tokens"]

    assert cached("run/1") == 0
    assert cached("run/1") >= BLOCK_SIZE
    assert cached("run/2") == 0
    assert cached("run/1", KEYS["b"]) == 0


def test_routing_by_model(gateway):
    """Each model's requests reach the upstream that serves it."""
    ids = {
        m["id"]
        for m in httpx.get(
            f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {KEYS['a']}"}
        ).json()["data"]
    }
    assert {SERVED_NAME, AIDREAMS} <= ids
    for model in (AIDREAMS, SERVED_NAME, AIDREAMS):
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert _post(gateway, "/v1/chat/completions", body)["model"] == model


def _vllm_blocks(vllm_server) -> Counter:
    """vLLM's block multiset from its own events, read by an independent consumer: a DEALER
    replaying from batch 0 (vLLM's buffer keeps 10,000 batches: the whole run)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(vllm_server.replay)
    held: Counter = Counter()
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert sock.poll(10_000), "vLLM's replay socket did not answer"
            seq, payload = replay_frames(sock.recv_multipart())
            if seq == (-1).to_bytes(8, "big", signed=True):
                return +held
            for ev in parse_batch(payload)[1]:
                if ev.kind == "stored":
                    held.update(ev.block_hashes)
                elif ev.kind == "removed":
                    held.subtract(ev.block_hashes)
                else:
                    held.clear()
    finally:
        sock.close()
        ctx.term()


def _wait_applied(gateway, vllm_server, timeout_s: float = 30.0) -> None:
    """Until the gateway's index holds what vLLM's replay says (a deadline, not a timing)."""
    index = gateway.app[PROXY].router.policy.exact.index
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if +index.blocks(vllm_server.url) == _vllm_blocks(vllm_server):
            return
        time.sleep(0.2)


def test_precise_routing_follows_vllm(gateway, vllm_server):
    """Sequential chat and completions requests over four shared system prompts: the index
    equals vLLM's blocks and predicted cached tokens equal vLLM's reported ones."""
    precise = gateway.app[PROXY].router.policy.exact
    deadline = time.monotonic() + 30  # the index's first sync (else requests fall back)
    while not precise.index.stats()["replicas"][vllm_server.url]["synced"]:
        assert time.monotonic() < deadline, precise.index.stats()
        time.sleep(0.1)
    rng = random.Random(7)
    systems = [random_text(rng, 60) for _ in range(4)]
    before = Counter(precise.predictions)
    n = 0
    for i in range(24):
        system = systems[rng.randrange(4)]
        user = random_text(rng, 5 + rng.randrange(20))
        if i % 2:
            body = {
                "model": SERVED_NAME,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
                "max_tokens": 2,
            }
            a = _post(gateway, "/v1/chat/completions", body, KEYS["a" if i % 4 == 1 else "b"])
        else:
            body = {"model": SERVED_NAME, "prompt": system + " " + user, "max_tokens": 2}
            a = _post(gateway, "/v1/completions", body, KEYS["a"])
        assert a["usage"]["prompt_tokens_details"] is not None
        n += 1
    _wait_applied(gateway, vllm_server)
    index = precise.index
    url = vllm_server.url
    assert index.hash_scheme(url) == HASH_VLLM_INT
    assert index.block_size(url) == BLOCK_SIZE
    st = index.stats()["replicas"][url]
    assert st["synced"] and st["bad_batches"] == 0 and st["unknown_removals"] == 0
    held = +index.blocks(url)
    assert held and held == _vllm_blocks(vllm_server)
    got = Counter(precise.predictions) - before
    results = {r: got[(url, r)] for r in ("exact", "over", "under")}
    assert sum(results.values()) == n, (results, dict(precise.decisions))
    assert results["exact"] >= 0.99 * n, results
    print(
        f"\nprecise on vLLM: {n} requests, predictions {results}, index {sum(held.values())} blocks"
    )
    assert sum(precise.reported_tokens.values()) > 0  # the prompts did share cached blocks
    pool = httpx.get(f"{gateway.url}/ready", headers={"Authorization": f"Bearer {OPERATOR}"})
    ups = {u["url"]: u for u in pool.json()["upstreams"]}
    assert ups[url]["reports_cached_tokens"] is True
    feed = ups[url]["kv_events"]
    assert feed["synced"] and feed["hash_scheme"] == "vllm" and feed["load_reports"] == 0
    assert [u["kv_events"] for u in ups.values() if u["url"] != url] == [None]


def test_tenant_salt_reaches_vllm_as_cache_salt(gateway):
    rng = random.Random(11)
    prompt = random_text(rng, 120)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1}
    first = _post(gateway, "/v1/completions", body, KEYS["a"])
    again = _post(gateway, "/v1/completions", body, KEYS["a"])
    other = _post(gateway, "/v1/completions", body, KEYS["b"])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_tokenize_and_detokenize_through_the_proxy_equal_vllms_own(gateway, vllm_server):
    """``/tokenize`` and ``/detokenize`` relayed by model (``proxy/token_relay.py``): vLLM's
    own answer, byte for byte as JSON, for its model; the prefixgate upstream's for its own;
    a body without a model is a 400 naming it (two models served)."""
    chat = [{"role": "user", "content": "Hi there"}]
    bodies = [
        {"model": SERVED_NAME, "prompt": "Once upon a time"},
        {"model": SERVED_NAME, "prompt": "Once upon a time", "add_special_tokens": False},
        {"model": SERVED_NAME, "messages": chat},
        {"model": SERVED_NAME, "messages": chat, "add_generation_prompt": False},
        {"model": SERVED_NAME, "prompt": "tide", "return_token_strs": True},
    ]
    for body in bodies:
        own = httpx.post(f"{vllm_server.url}/tokenize", json=body, timeout=60)
        assert own.status_code == 200, own.text
        assert _post(gateway, "/tokenize", body) == own.json()
        back = {"model": SERVED_NAME, "tokens": own.json()["tokens"]}
        own_text = httpx.post(f"{vllm_server.url}/detokenize", json=back, timeout=60)
        assert own_text.status_code == 200, own_text.text
        assert _post(gateway, "/detokenize", back) == own_text.json()
    body = {"model": AIDREAMS, "prompt": "Once upon a time"}
    r = httpx.post(f"{gateway.url}/tokenize", json=body, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    assert _post(gateway, "/tokenize", body)["count"] > 0
    r = httpx.post(
        f"{gateway.url}/tokenize",
        json={"prompt": "no model"},
        headers={"Authorization": f"Bearer {KEYS['a']}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
