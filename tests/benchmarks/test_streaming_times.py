"""``examples.benchmarks.streaming.text_chunk_times``: one time per event carrying text."""

from __future__ import annotations

import httpx
import pytest

from examples.benchmarks.streaming import text_chunk_times


def _client(body: bytes, status: int = 200) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        return httpx.Response(status, content=body)

    return httpx.Client(base_url="http://peer", transport=httpx.MockTransport(answer))


def test_times_only_the_events_with_text() -> None:
    events = [
        b'data: {"choices": [{"text": "a"}]}',
        b'data: {"choices": [{"text": ""}]}',
        b'data: {"choices": [], "usage": {"completion_tokens": 2}}',
        b": keep-alive",
        b'data: {"choices": [{"text": "b"}]}',
        b"data: [DONE]",
    ]
    with _client(b"\n\n".join(events) + b"\n\n") as client:
        times = text_chunk_times(client, {"stream": True})
    assert len(times) == 2
    assert times == sorted(times)


def test_a_refusal_raises() -> None:
    with _client(b"{}", status=503) as client, pytest.raises(httpx.HTTPStatusError):
        text_chunk_times(client, {"stream": True})
