"""/v1/responses, /tokenize + /detokenize and x-request-id on the real gateway serving
aidreams-260k, driven by the official openai client (plain and streaming Responses)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytest.importorskip("prefixgate.engine.async_engine")

from support.gateway import openai_client, serve_aidreams, wait_idle  # noqa: E402

MODEL = "aidreams-260k"
INSTRUCTIONS = "You are a storyteller. Tell short tales about a fox, a bird and an old oak tree."


@pytest.fixture(scope="module")
def server(aidreams_path):
    yield from serve_aidreams(aidreams_path, model_name=MODEL)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def test_responses_plain_matches_chat_and_reports_cached_tokens(server, client, pool_whole):
    kw = dict(model=MODEL, temperature=0, max_output_tokens=12)
    first = client.responses.create(instructions=INSTRUCTIONS, input="Once upon a time", **kw)
    again = client.responses.create(instructions=INSTRUCTIONS, input="Once upon a time", **kw)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.output_text and first.output_text == again.output_text
    assert first.usage.output_tokens == 12 and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    # instructions are the system prompt: the second request rides the prefix cache
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert again.usage.total_tokens == again.usage.input_tokens + again.usage.output_tokens
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "Once upon a time"},
        ],
        temperature=0,
        max_tokens=12,
    )
    assert chat.choices[0].message.content == first.output_text
    msgs = client.responses.create(
        input=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]},
        ],
        **kw,
    )
    assert msgs.output_text == first.output_text
    wait_idle(server, pool_whole, 10, pinned_ok=True)


def test_responses_stream_events(server, client, pool_whole):
    kw = dict(model=MODEL, temperature=0, max_output_tokens=10, instructions=INSTRUCTIONS)
    plain = client.responses.create(input="The fox", **kw)
    events = list(client.responses.create(input="The fox", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10
    wait_idle(server, pool_whole, 10, pinned_ok=True)


def test_responses_stream_helper(server, client, pool_whole):
    """openai-python's ``responses.stream`` helper accumulates the text; the stream ends with
    ``response.completed`` (EOS) or ``response.incomplete`` (the context's end), as OpenAI's."""
    with client.responses.stream(model=MODEL, input="A bird", temperature=0) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and last.response.output_text == text
    assert last.response.usage.output_tokens > 0
    if last.type == "response.completed":
        assert stream.get_final_response().output_text == text
    wait_idle(server, pool_whole, 10, pinned_ok=True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),  # over the context length
        ({"input": []}, "input"),
    ],
)
def test_responses_refuses_what_it_does_not_implement(server, body, param, pool_whole):
    req = {"model": MODEL, "input": "hi", **body}
    r = httpx.post(server.url + "/v1/responses", json=req)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert r.headers["x-request-id"]
    wait_idle(server, pool_whole, 10, pinned_ok=True)


def test_x_request_id_on_every_answer(server):
    base = server.url
    mine = httpx.get(base + "/health", headers={"x-request-id": "abc-123.X:9"})
    assert mine.headers["x-request-id"] == "abc-123.X:9"
    bad = httpx.get(base + "/health", headers={"x-request-id": "a b\tc"})
    assert bad.headers["x-request-id"] != "a b\tc" and len(bad.headers["x-request-id"]) == 32
    ids = {
        httpx.get(base + "/v1/models").headers["x-request-id"],
        httpx.get(base + "/nope").headers["x-request-id"],
        httpx.post(base + "/v1/chat/completions", content=b"{").headers["x-request-id"],
    }
    assert len(ids) == 3
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "stream": True,
        },
        headers={"x-request-id": "stream-1"},
    ) as r:
        r.read()
        assert r.headers["x-request-id"] == "stream-1"


def test_tokenize_detokenize_round_trip(server):
    base = server.url
    text = "The old oak tree whispered to the fox: café, naïve, 東京"
    tok = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]})
    assert back.status_code == 200
    assert back.json()["prompt"].removeprefix("<s>").lstrip() == text
    r = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": [1, -1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.1"
    r = httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.0"
