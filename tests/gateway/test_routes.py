"""OpenAI routes against the fake engine: shapes, streaming, n, logprobs, usage, metrics."""

from __future__ import annotations

import json

import openai
import pytest
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.keys import effective_salt

HI = [{"role": "user", "content": "hi"}]


def _client(srv) -> openai.OpenAI:
    """The official client on ``srv``'s ``/v1``."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def test_chat_non_streaming_shape(serve_fake, gw):
    srv, engine = serve_fake()
    client = _client(srv)
    r = client.chat.completions.create(model="fake", messages=HI, max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.model == "fake"
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].message.content) == 5
    assert r.choices[0].finish_reason == "length"
    # "<s>hi" → BOS + 2 bytes; the template writes <s>, so no second BOS is added.
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    rid, ids, params, salt = engine.requests_seen[-1]
    assert ids == [1, ord("h") + 3, ord("i") + 3] and params.greedy and salt is None


def test_chat_streaming_and_include_usage(serve_fake):
    srv, _ = serve_fake()
    client = _client(srv)
    chunks = list(
        client.chat.completions.create(model="fake", messages=HI, max_tokens=4, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 4
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    chunks = list(
        client.chat.completions.create(
            model="fake",
            messages=HI,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_sse_framing_and_headers(serve_fake, gw):
    srv, _ = serve_fake()
    with (
        gw.client(srv) as http,
        http.stream(
            "POST", "/v1/chat/completions", json=gw.chat_body(max_tokens=3, stream=True)
        ) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert e.startswith("data: ")
        json.loads(e[6:])


def test_completions_text_tokens_and_batch(serve_fake):
    srv, engine = serve_fake()
    client = _client(srv)
    r = client.completions.create(model="fake", prompt="abc", max_tokens=3, temperature=0)
    assert r.object == "text_completion" and len(r.choices[0].text) == 3
    assert engine.requests_seen[-1][1] == [1, 100, 101, 102]  # text prompt: BOS added
    r2 = client.completions.create(
        model="fake", prompt=[1, 100, 101, 102], max_tokens=3, temperature=0
    )
    assert r2.choices[0].text == r.choices[0].text
    r3 = client.completions.create(model="fake", prompt=["abc", "xyz"], max_tokens=2, n=2)
    assert [c.index for c in r3.choices] == [0, 1, 2, 3]
    assert r3.usage.prompt_tokens == 8 and r3.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model="fake", prompt="abc", max_tokens=3, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_n_choices_are_distinct_engine_requests_with_seeds(serve_fake):
    srv, engine = serve_fake()
    client = _client(srv)
    r = client.chat.completions.create(
        model="fake", messages=HI, max_tokens=3, n=3, seed=10, temperature=0.7
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    seen = engine.requests_seen[-3:]
    assert len({s[0] for s in seen}) == 3
    assert sorted(s[2].seed for s in seen) == [10, 11, 12]
    assert r.usage.completion_tokens == 9


def test_logprobs_shapes(serve_fake):
    srv, _ = serve_fake()
    client = _client(srv)
    r = client.chat.completions.create(
        model="fake", messages=HI, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    assert "".join(t.token for t in content) == r.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="fake", messages=HI, max_tokens=3, logprobs=True, top_logprobs=1, stream=True
        )
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert len(streamed) == 3
    c = client.completions.create(model="fake", prompt="ab", max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.text_offset == [0, 1, 2] and len(lp.top_logprobs[0]) == 2


def test_stop_string_maps_to_stop(serve_fake):
    srv, _ = serve_fake()
    client = _client(srv)
    full = client.completions.create(model="fake", prompt="abc", max_tokens=6, temperature=0)
    text = full.choices[0].text
    r = client.completions.create(
        model="fake", prompt="abc", max_tokens=6, temperature=0, stop=[text[2]]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:2]


def test_models_health_ready_metrics(serve_fake, gw):
    srv, _ = serve_fake()
    with gw.client(srv) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").status_code == 200
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == "fake" and models["data"][0]["max_model_len"] == 128
        assert http.get("/v1/models/fake").status_code == 200
        assert http.get("/v1/models/nope").status_code == 404
        http.post("/v1/chat/completions", json=gw.chat_body(max_tokens=3))
        text = http.get("/metrics").text
    for name in (
        "prefixgate_time_to_first_token_seconds_count 1.0",
        "prefixgate_time_per_output_token_seconds_count 1.0",
        "prefixgate_e2e_request_latency_seconds_count 1.0",
        "prefixgate_queue_depth 0.0",
        "prefixgate_running_requests 0.0",
        "prefixgate_kv_blocks_used 0.0",
        "prefixgate_prefix_cache_hit_rate",
        "prefixgate_generation_tokens_per_second",
        "prefixgate_generation_tokens_total 3.0",
        # vLLM's pool metric names (an Inference Extension endpoint picker reads them)
        'vllm:num_requests_running{engine="0",model_name="fake"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.0',
        "vllm:cache_config_info{",
    ):
        assert name in text, name


def test_keepalive_comment_while_waiting(serve_fake, gw):
    srv, _ = serve_fake(
        GatewaySettings(model_name="fake", keepalive_s=0.05, poll_s=0.02), token_delay_s=0.3
    )
    with (
        gw.client(srv) as http,
        http.stream(
            "POST", "/v1/chat/completions", json=gw.chat_body(max_tokens=1, stream=True)
        ) as r,
    ):
        body = r.read().decode()
    assert body.startswith(": keep-alive\n\n") or ": keep-alive\n\n" in body
    assert body.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_cache_salt_from_key_and_shared_salt(serve_fake, gw, tmp_path, stream):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"key": "ka", "salt": "tenant-a"},
                    {"key": "ka2", "salt": "tenant-a"},
                    {"key": "kb"},
                ]
            }
        )
    )
    srv, engine = serve_fake(GatewaySettings(model_name="fake", keys_file=str(keys)))
    salts = []
    for key in ("ka", "ka2", "kb"):
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key)
        r = c.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "x" * 40}],
            max_tokens=2,
            stream=stream,
        )
        if stream:
            list(r)
        salts.append(engine.requests_seen[-1][3])
    assert salts[0] == salts[1] == "tenant-a"
    assert salts[2] not in (None, "tenant-a") and "kb" not in salts[2]
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="ka")
    c.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        extra_body={"cache_salt": "team-x"},
    )
    # nested inside the key's salt (hashed pair: see test_tenants for injectivity)
    assert engine.requests_seen[-1][3] == effective_salt("tenant-a", "team-x")
