"""One verifier of upstream answers (``proxy/answers.shape_problem``) serves the chat relay and
the Messages relay alike: the same non-conforming answer of an OpenAI-compatible upstream is
refused on ``/v1/chat/completions`` and on a translated ``/v1/messages`` (a 502, or an error
event in a stream — never a success), and a Messages upstream's answer must be a whole
Anthropic ``message`` (``anthropic_models.MessageAnswer``)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from aiohttp import web
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.proxy.answers import answer_model, shape_problem
from prefixgate.gateway.settings import GatewaySettings

ASK = [{"role": "user", "content": "hi"}]
GOOD_CHOICE = {"index": 0, "message": {"role": "assistant", "content": "ok"},
               "finish_reason": "stop"}  # fmt: skip
COMPLETION = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [GOOD_CHOICE], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                  "total_tokens": 2}}  # fmt: skip

# non-stream answers no route may pass on as a success
BAD_BODIES = [
    {**COMPLETION, "choices": [{**GOOD_CHOICE, "finish_reason": None}]},  # truncated
    {**COMPLETION, "choices": "x"},
    {k: v for k, v in COMPLETION.items() if k != "choices"},
    {**COMPLETION, "choices": [{"index": 0, "message": 5, "finish_reason": "stop"}]},
]
CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
BAD_STREAMS = [
    [{**CHUNK, "choices": [{"index": 0, "delta": 5, "finish_reason": None}]}],
    [{**CHUNK, "choices": "x"}],
    [{"hello": "world"}],
]


def _openai_upstream(body: dict | None, chunks: list[dict] | None) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        req = await request.json()
        if not req.get("stream"):
            return web.json_response(body if body is not None else COMPLETION)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        good = {**CHUNK, "choices": [{"index": 0, "delta": {"content": "o"}}]}
        for c in [good, *(chunks or [])]:
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _both_refuse(body: dict | None, chunks: list[dict] | None) -> None:
    with BackgroundServer(lambda: _openai_upstream(body, chunks)) as up:
        with BackgroundServer(lambda: create_proxy_app([up.url], GatewaySettings())) as gw:
            oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            an = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
            stream = chunks is not None
            with pytest.raises(openai.APIError) as chat_err:
                r = oa.chat.completions.create(model="m", messages=ASK, stream=stream)
                if stream:
                    list(r)
            with pytest.raises(anthropic.APIError) as msg_err:
                r = an.messages.create(model="m", max_tokens=8, messages=ASK, stream=stream)
                if stream:
                    list(r)
    if not stream:
        assert chat_err.value.status_code == msg_err.value.status_code == 502
    # the same sentence of the one verifier on both routes
    assert "not a chat.completion" in str(chat_err.value) or "finish_reason" in str(chat_err.value)
    assert "not a chat.completion" in str(msg_err.value) or "finish_reason" in str(msg_err.value)


@pytest.mark.parametrize("body", BAD_BODIES)
def test_a_bad_whole_answer_is_refused_on_both_routes(body):
    _both_refuse(body, None)


@pytest.mark.parametrize("chunks", BAD_STREAMS)
def test_a_bad_chunk_ends_both_streams_with_an_error(chunks):
    _both_refuse(None, chunks)


MESSAGE = {"type": "message", "id": "msg_1", "role": "assistant", "model": "pg",
           "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}  # fmt: skip


@pytest.mark.parametrize(
    ("broken", "why"),
    [
        ({"type": "completion"}, "type"),
        ({"id": None}, "id"),
        ({"role": "user"}, "role"),
        ({"content": "not blocks"}, "content"),
        ({"content": [{"text": "no type"}]}, "content.0.type"),
        ({"usage": {"input_tokens": 3}}, "usage.output_tokens"),
        ({"usage": {"input_tokens": -1, "output_tokens": 1}}, "usage.input_tokens"),
        ({"usage": {"input_tokens": True, "output_tokens": 1}}, "usage.input_tokens"),
    ],
)
def test_a_messages_answer_must_be_a_whole_message(broken, why):
    """What the relay's own checks refused before, the verifier refuses (naming the field)."""
    model = answer_model("/v1/messages", False)
    assert model is not None and shape_problem(MESSAGE, model) is None
    obj = {**MESSAGE, **broken}
    if broken.get("id", "") is None:
        del obj["id"]  # missing, not only null: a Messages answer tolerates nothing missing
    problem = shape_problem(obj, model)
    assert problem is not None and why in problem, problem
