"""Per-key accounting units: Charge (settle / refund) and the proxy's SSE usage tap."""

from __future__ import annotations

import json

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.http.request_account import RequestAccount
from prefixgate.gateway.proxy.usage import UsageTap, ask_usage, body_usage
from prefixgate.gateway.tenancy.keys import KeySpec, Principal


def _principal(**limits) -> Principal:
    return Principal(KeySpec(key="k", **limits))


def test_refund_gives_back_everything():
    p = _principal(requests_per_minute=2, tokens_per_minute=600, max_concurrent=1)
    for _ in range(5):  # refused / failed before any token: never counts
        c = p.acquire(500)
        assert p.concurrent == 1
        c.refund()
        c.refund()  # idempotent
        assert p.concurrent == 0
    assert p._rpm.level == pytest.approx(2, abs=0.01)
    assert p._tpm.level == pytest.approx(600, abs=1)
    p.acquire(1).settle(1, 0)
    p.acquire(1).settle(1, 0)
    with pytest.raises(APIError) as info:
        p.acquire(1)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"


def test_settle_charges_prompt_plus_completion_exactly():
    p = _principal(tokens_per_minute=6000)  # refills 100/s: tolerance for the test's time
    c = p.acquire(40)  # an estimate
    c.settle(25, 300)  # the usage: 325 in all
    assert p._tpm.level == pytest.approx(6000 - 325, abs=20)
    c.settle(1000, 1000)  # once only
    assert p._tpm.level == pytest.approx(6000 - 325, abs=20)
    c = p.acquire(10)
    c.settle(10, 9000)  # a long answer: a debt repaid by refill, not a cut
    assert p._tpm.level < 0
    with pytest.raises(APIError):
        p.acquire(1)


def test_refused_by_tokens_gives_the_request_back():
    p = _principal(requests_per_minute=1, tokens_per_minute=60)
    with pytest.raises(APIError):
        p.acquire(60).settle(60, 60)  # fine, then over
        p.acquire(1)
    p2 = _principal(requests_per_minute=1, tokens_per_minute=60)
    p2._tpm.level = 0
    with pytest.raises(APIError):
        p2.acquire(10)
    assert p2._rpm.level == pytest.approx(1, abs=0.01) and p2.concurrent == 0


def _sse(*objs) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"
    )


CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "a"}}]},
    {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]},
]
USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
@pytest.mark.parametrize("keep", [False, True])
def test_tap_reads_usage_and_drops_the_injected_chunk(split, keep):
    stream = _sse(*CHUNKS, USAGE)
    acct = RequestAccount()
    tap = UsageTap(acct, keep_usage_chunk=keep)
    out = b"".join(tap.feed(stream[i : i + split]) for i in range(0, len(stream), split))
    out += tap.flush()
    assert acct.usage_reported and acct.prompt_tokens == 7 and acct.completion_tokens == 2
    assert acct.charge(100) == (7, 2) and acct.cached_tokens is None  # not reported: not known
    assert acct.finish_reason == "length"
    expected = stream if keep else _sse(*CHUNKS)
    assert out == expected


def test_tap_without_usage_counts_content_chunks():
    acct = RequestAccount()
    tap = UsageTap(acct, keep_usage_chunk=False)
    stream = _sse(*CHUNKS) + b'data: {"cut'
    assert tap.feed(stream) + tap.flush() == stream
    assert not acct.usage_reported and acct.estimated_completion_tokens == 2
    # the usage stays not known; the key is charged the admission estimate + chunks
    assert acct.prompt_tokens is None and acct.completion_tokens is None
    assert acct.charge(40) == (40, 2)


def test_ask_usage_and_body_usage():
    body = {"stream": True}
    assert ask_usage(body) is False and body["stream_options"] == {"include_usage": True}
    body = {"stream": True, "stream_options": {"include_usage": True}}
    assert ask_usage(body) is True
    body = {"stream": False}
    assert ask_usage(body) is False and "stream_options" not in body
    acct = RequestAccount()
    assert body_usage(json.dumps(USAGE).encode(), acct) and acct.completion_tokens == 2
    for bad in (b"{", b'{"usage": {"prompt_tokens": -1}}', b"[1]"):
        acct = RequestAccount()
        assert not body_usage(bad, acct) and not acct.usage_reported
        assert acct.prompt_tokens is None and acct.completion_tokens is None


def test_account_reads_cached_tokens_and_anthropic_usage():
    acct = RequestAccount()
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert acct.read_usage(usage) and acct.cached_tokens == 4
    acct = RequestAccount()
    anth = {"input_tokens": 3, "cache_read_input_tokens": 5, "output_tokens": 2}
    assert acct.read_anthropic_usage(anth)
    assert (acct.prompt_tokens, acct.cached_tokens, acct.completion_tokens) == (8, 5, 2)
    acct = RequestAccount(estimated_completion_tokens=6)
    assert acct.read_anthropic_usage({"input_tokens": 3}) and acct.charge(0) == (3, 6)
    assert not RequestAccount().read_anthropic_usage({"output_tokens": 2})


def test_account_marks_served_once():
    acct = RequestAccount()
    assert not acct.served and acct.first_token is None
    acct.mark_served()
    assert acct.served and acct.first_token is None  # a first token is a content chunk's
    acct.mark_served()
    assert acct.charge(12) == (12, 0)  # nothing known: what admission took, no completion


def test_account_reads_a_streams_choices():
    acct = RequestAccount()
    acct.read_choices([{"index": 0, "delta": {"role": "assistant", "content": ""}}], True)
    assert acct.first_token is None and acct.tpot_s() is None  # no content yet
    acct.read_choices([{"index": 0, "delta": {"content": "a"}, "finish_reason": None}], True)
    first = acct.first_token
    assert first is not None and acct.last_token == first and acct.finish_reason is None
    acct.read_choices([{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}], True)
    acct.read_choices([{"index": 1, "delta": {}, "finish_reason": "stop"}], True)
    assert acct.finish_reason is None  # the first choice's only
    acct.read_choices([{"index": 0, "delta": {}, "finish_reason": "length"}], True)
    assert acct.first_token == first and acct.last_token is not None
    assert acct.last_token >= first and acct.finish_reason == "length"
    acct.completion_tokens = 3
    tpot = acct.tpot_s()
    assert tpot is None or tpot == (acct.last_token - first) / 2
    whole = RequestAccount()
    whole.read_choices([{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}], False)
    assert whole.finish_reason == "stop" and whole.first_token is None  # no token times


def test_a_streams_tpot_is_not_read_across_several_choices():
    """Proxy mode read one TPOT over a stream's chunks of every choice and the usage's
    completion tokens of them all (n = 2, 11 tokens each over 1 s: 0.048 s for 0.1); a
    choice's pace cannot be read so, so none is reported (local mode observes each choice)."""
    from prefixgate.gateway.http.request_account import RequestAccount

    one, two = RequestAccount(), RequestAccount()
    for acct, n in ((one, 1), (two, 2)):
        for i in range(n):
            acct.read_choices([{"index": i, "delta": {"content": "x"}}], streamed=True)
        acct.first_token, acct.last_token, acct.completion_tokens = 10.0, 11.0, 11 * n
    assert one.tpot_s() == pytest.approx(0.1)
    assert two.choices == 2 and two.tpot_s() is None
