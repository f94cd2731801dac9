"""Every upstream answer is checked against the OpenAI shape before it is relayed
(``gateway/proxy/answers.py``, ``relay.py``, ``routes.py``): a non-stream 200 that is not a
valid body of its route is a 502, SSE to a non-stream request a 502, a stream ending
``[DONE]`` with no ``finish_reason`` (or with chunks that are not the route's) ends with an
explicit error event; health counts bad answers (``FAILURE_THRESHOLD`` in a row eject, within
``max_ejection_percent`` of the pool; a check brings the upstream back half-open), so a bad
answer never ejects the only upstream."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prefixgate.gateway.proxy.answers import shape_problem
from prefixgate.gateway.proxy.relay import EventChecker, StreamBroken
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.proxy.upstream import FAILURE_THRESHOLD
from prefixgate.gateway.wire.response_models import ChatCompletion, ChatCompletionChunk
from support.fault_proxy import FaultProxies
from support.http import assert_openai_error

BODY = {"model": "fault", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMPLETION = {"model": "fault", "prompt": "hi", "max_tokens": 8}


@pytest.fixture
def proxy() -> Iterator:
    """``proxy(mode, **settings) -> (gateway, upstream)``; both stopped after the test."""
    with FaultProxies() as proxies:

        def start(mode: str = "ok", **settings):
            return proxies.start(mode, 3, 0.005, {"upstream_timeout_s": 2.0, **settings})

        yield start


def _sse(url: str, path: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as r:
        return r.status_code, [x[6:] for x in r.iter_lines() if x.startswith("data: ")]


@pytest.mark.parametrize(
    "mode,says", [("nochoices", "choices"), ("sse", "event stream"), ("nofinish", "finish_reason")]
)
@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", BODY), ("/v1/completions", COMPLETION)]
)
def test_a_non_stream_200_that_is_not_its_routes_body_is_a_502(proxy, mode, says, path, body):
    gw, _ = proxy(mode)
    r = httpx.post(gw.url + path, json=body, timeout=10)
    err = assert_openai_error(r, 502, "upstream_unavailable")
    assert says in err["message"], err
    # openai-python raises an API error, never a TypeError or a half-parsed object
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError):
        if path == "/v1/chat/completions":
            oa.chat.completions.create(**body)
        else:
            oa.completions.create(**body)


@pytest.mark.parametrize("mode,says", [("nofinish", "finish_reason"), ("nochoices", "choices")])
def test_a_stream_without_a_finish_ends_with_an_error_event(proxy, mode, says):
    gw, _ = proxy(mode)
    status, data = _sse(gw.url, "/v1/chat/completions", BODY)
    assert status == 200
    assert "[DONE]" not in data
    last = json.loads(data[-1])
    assert last["error"]["code"] == "upstream_error" and says in last["error"]["message"], last
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in oa.chat.completions.create(**BODY, stream=True):
            pass


def test_a_well_formed_stream_and_body_still_pass(proxy):
    gw, up = proxy("ok")
    status, data = _sse(gw.url, "/v1/chat/completions", BODY)
    assert status == 200 and data[-1] == "[DONE]", data
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    router = gw.app[PROXY].router
    assert router.upstreams[0].strikes == 0 and router.upstreams[0].healthy


def test_one_bad_answer_does_not_eject_the_only_upstream(proxy):
    gw, up = proxy("nochoices", health_interval_s=0.2)
    router = gw.app[PROXY].router
    only = router.upstreams[0]
    for i in range(FAILURE_THRESHOLD - 1):
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
        assert r.status_code == 502, r.text
        assert only.healthy and only.strikes == i + 1
    up.mode = "ok"
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200, r.text  # still in rotation; a good answer clears the strikes
    assert only.strikes == 0
    # FAILURE_THRESHOLD bad answers in a row: the only upstream stays in rotation (ejecting
    # it would take the whole pool out, beyond max_ejection_percent); each fails its request
    up.mode = "nochoices"
    for _ in range(FAILURE_THRESHOLD + 2):
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
        assert r.status_code == 502, r.text
        assert only.healthy
    up.mode = "ok"
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200 and only.strikes == 0


def test_bad_answers_in_a_row_eject_then_a_check_brings_it_back_half_open(proxy):
    gw, up = proxy(
        "nochoices",
        health_interval_s=0.1,
        upstream_max_ejection_percent=100,
        upstream_base_ejection_s=0.5,
    )
    only = gw.app[PROXY].router.upstreams[0]
    for _ in range(FAILURE_THRESHOLD):
        r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
        assert r.status_code == 502, r.text
    assert not only.healthy and only.health.ejections == 1
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert_openai_error(r, 503, "upstream_unavailable")  # ejected: not even tried
    deadline = time.monotonic() + 10
    while not only.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert only.healthy  # its ejection over, a check (GET /health 200) brought it back
    assert only.strikes == FAILURE_THRESHOLD - 1  # half-open: one more bad answer ejects
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 502 and not only.healthy
    assert only.health.ejections == 2  # and for twice as long
    assert 0.6 < only.health.ejected_until - time.monotonic() <= 1.0


def test_checker_units():
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    opened = {**chunk, "choices": [{"index": 0, "delta": {"content": "a"}}]}
    ended = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {
        **chunk,
        "choices": [],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }

    def ev(obj: object) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    c = EventChecker(ChatCompletionChunk, require_finish=True)
    c.feed(ev(opened) + ev(ended) + ev(usage))
    assert c.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and c.done
    for stream in (ev(opened), b"", ev(usage)):
        with pytest.raises(StreamBroken, match="finish_reason"):
            EventChecker(ChatCompletionChunk, require_finish=True).feed(
                stream + b"data: [DONE]\n\n"
            )
    with pytest.raises(StreamBroken, match="choices"):
        EventChecker(ChatCompletionChunk).feed(ev(chunk))
    two = {**chunk, "choices": [{"index": 1, "delta": {}}]}
    with pytest.raises(StreamBroken, match="choice 1"):
        EventChecker(ChatCompletionChunk, require_finish=True).feed(
            ev(opened) + ev(two) + ev(ended) + b"data: [DONE]\n\n"
        )
    body = {
        **chunk,
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"}
        ],
    }
    assert shape_problem(body, ChatCompletion) is None  # logprobs, usage left out: tolerated
    assert "choices" in shape_problem(
        {k: v for k, v in body.items() if k != "choices"}, ChatCompletion
    )
    assert "not an object" in shape_problem([], ChatCompletion)


def test_a_huge_bad_answer_is_judged_on_its_first_fault_in_bounded_memory():
    """200,000 numbers where choices belong (400 KB of answer) were 200,000 validation errors,
    ~250 MB and seconds of the event loop (a 60 MB answer had the proxy killed for memory);
    the check stops at the first bad item. A choice leaving out a tolerated field does not
    stop it before a later choice's real fault, and a tolerated field of the wrong type is
    still one."""
    import tracemalloc

    from prefixgate.gateway.wire.anthropic_models import MessageAnswer

    tracemalloc.start()
    try:
        said = shape_problem({"choices": [1] * 200_000}, ChatCompletion)
        strict = shape_problem({"type": "message", "content": [1] * 200_000}, MessageAnswer)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said is not None and "choices.0" in said, said
    assert strict is not None and strict.startswith("not a MessageAnswer"), strict
    assert peak < 20 << 20, peak  # bytes traced while judging it
    ok = {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"}
    said = shape_problem({"choices": [ok, {"index": 1, "finish_reason": "stop"}]}, ChatCompletion)
    assert said is not None and "choices.1.message" in said, said
    said = shape_problem({"choices": [ok], "created": "yesterday"}, ChatCompletion)
    assert said is not None and "created" in said, said
