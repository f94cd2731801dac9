"""SSE parsing and stream behaviour: events, [DONE], errors, early exit, idle timeout, no retry."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
import respx
from prefixgate.sdk import APIConnectionError, APIError, APITimeoutError, SSEDecoder
from prefixgate.sdk.types import ChatCompletionChunk

from .conftest import BASE, MSG

pytestmark = pytest.mark.anyio

URL = f"{BASE}/chat/completions"


def chunk(text: str, finish: str | None = None) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }


def sse(*payloads: dict | str) -> bytes:
    out = []
    for p in payloads:
        out.append(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n")
    return "".join(out).encode()


def decode_all(data: bytes, split: int | None = None) -> list:
    d = SSEDecoder()
    parts = [data] if split is None else [data[i : i + split] for i in range(0, len(data), split)]
    events = []
    for p in parts:
        events += d.feed(p)
    return events


def test_decoder_multiline_data_comments_and_fields() -> None:
    raw = (
        b": keep-alive comment\n"
        b"event: message\n"
        b"id: 7\n"
        b"retry: 1500\n"
        b"data: line one\n"
        b"data:line two\n"
        b"data\n"  # a field name alone: empty value
        b"\n"
    )
    (e,) = decode_all(raw)
    assert e.data == "line one\nline two\n" and e.event == "message"
    assert e.id == "7" and e.retry == 1500


def test_decoder_line_endings_and_any_split() -> None:
    raw = b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"
    for split in (None, 1, 2, 3, 5):
        assert [e.data for e in decode_all(raw, split)] == ["a", "b", "c"], split


def test_decoder_events_without_data_are_dropped() -> None:
    raw = b"event: ping\n\n: only a comment\n\ndata: x\n\n\n\n"
    events = decode_all(raw)
    assert [(e.event, e.data) for e in events] == [(None, "x")]  # event name reset after drop


def test_decoder_keeps_unicode_line_separators_and_split_utf8() -> None:
    text = "a\u2028b\x0cc é"
    raw = f"data: {json.dumps({'t': text}, ensure_ascii=False)}\n\n".encode()
    for split in (None, 1, 7):
        (e,) = decode_all(raw, split)
        assert json.loads(e.data)["t"] == text


def test_decoder_incomplete_event_at_end_is_dropped() -> None:
    d = SSEDecoder()
    assert d.feed(b"data: partial") == [] and d.flush() == []


def test_decoder_drops_a_leading_byte_order_mark_however_split() -> None:
    """HTML standard: one UTF-8 BOM at the start of the stream is skipped (it used to turn the
    first field name into "\ufeffdata" and lose the first event)."""
    raw = b"\xef\xbb\xbfdata: first\n\ndata: second\n\n"
    for split in (None, 1, 2, 4):
        assert [e.data for e in decode_all(raw, split)] == ["first", "second"], split
    # only at the start: a later BOM is content, and a second leading one is not skipped
    assert [e.data for e in decode_all(b"data: a\xef\xbb\xbfb\n\n")] == ["a\ufeffb"]
    assert decode_all(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []
    # bytes that merely start like a BOM are not eaten
    assert [e.data for e in decode_all(b"\xefdata: y\n\ndata: z\n\n", 1)] == ["z"]


def test_decoder_field_rules_of_the_standard() -> None:
    raw = (
        b"data:no space\n\n"  # no space after the colon
        b"data:  two spaces\n\n"  # only one space is removed
        b"data:\n\n"  # a data line with an empty value: an event with empty data
        b"event:\ndata: default type\n\n"  # empty event type: the default
        b"id: 1\ndata: a\n\n"
        b"data: b\n\n"  # the last event id carries over
        b"id: bad\x00id\ndata: c\n\n"  # an id with NUL is ignored
        b"retry: soon\nretry: 20\nfoo: bar\ndata: d\n\n"  # non-digit retry, unknown field
    )
    for split in (None, 1, 3):
        events = decode_all(raw, split)
        assert [e.data for e in events] == [
            "no space",
            " two spaces",
            "",
            "default type",
            "a",
            "b",
            "c",
            "d",
        ]
        assert events[3].event is None
        assert [e.id for e in events[4:]] == ["1", "1", "1", "1"]
        assert events[-1].retry == 20


@respx.mock
async def test_stream_with_a_byte_order_mark_keeps_its_first_chunk(make_client) -> None:
    body = b"\xef\xbb\xbf" + sse(chunk("first"), chunk("second")) + b"data: [DONE]\n\n"
    respx.post(URL).mock(return_value=httpx.Response(200, content=body))
    async with make_client() as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        assert [c.choices[0].delta.content async for c in stream] == ["first", "second"]


@respx.mock
async def test_stream_ending_before_done_raises(make_client) -> None:
    """A body that closes before ``data: [DONE]`` was cut short: an error, never a success."""
    respx.post(URL).mock(
        return_value=httpx.Response(200, content=sse(chunk("partial"), chunk(" answ")))
    )
    async with make_client() as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        got = []
        with pytest.raises(APIConnectionError, match="DONE"):
            async for c in stream:
                got.append(c.choices[0].delta.content)
        assert got == ["partial", " answ"] and client.limiter.in_flight == 0


@respx.mock
async def test_stream_yields_typed_chunks_until_done(make_client) -> None:
    body = (
        b": hello\n\n"
        + sse(chunk("Hel"), chunk("lo", "stop"))
        + b"data: [DONE]\n\n"
        + sse(chunk("NOT"))
    )
    route = respx.post(URL).mock(return_value=httpx.Response(200, content=body))
    async with make_client() as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        async with stream:
            got = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in got)
    assert "".join(c.choices[0].delta.content for c in got) == "Hello"
    assert got[-1].choices[0].finish_reason == "stop"
    assert json.loads(route.calls[0].request.content)["stream"] is True
    assert client.limiter.in_flight == 0 and stream.response.is_closed


@respx.mock
async def test_stream_error_event_raises(make_client) -> None:
    body = sse(chunk("a"), {"error": {"message": "engine died", "type": "internal_server_error"}})
    respx.post(URL).mock(return_value=httpx.Response(200, content=body))
    async with make_client() as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        got = []
        with pytest.raises(APIError, match="engine died"):
            async for c in stream:
                got.append(c)
    assert len(got) == 1 and client.limiter.in_flight == 0


class Dropping(httpx.AsyncByteStream):
    """Yields one chunk event, then the connection breaks."""

    async def __aiter__(self):
        yield sse(chunk("first"))
        raise httpx.RemoteProtocolError("peer closed connection")


@respx.mock
async def test_stream_never_retried_once_yielded(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(return_value=httpx.Response(200, stream=Dropping()))
    async with make_client(max_retries=5) as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        got = []
        with pytest.raises(APIConnectionError):
            async for c in stream:
                got.append(c)
    assert len(got) == 1 and route.call_count == 1 and fake_sleep.waits == []
    assert client.limiter.in_flight == 0


@respx.mock
async def test_stream_status_errors_before_first_chunk_are_retried(make_client, fake_sleep) -> None:
    route = respx.post(URL).mock(
        side_effect=[
            httpx.Response(
                429, headers={"retry-after-ms": "5"}, json={"error": {"message": "busy"}}
            ),
            httpx.Response(200, content=sse(chunk("ok")) + b"data: [DONE]\n\n"),
        ]
    )
    async with make_client() as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        got = [c.choices[0].delta.content async for c in stream]
    assert got == ["ok"] and route.call_count == 2 and fake_sleep.waits == [0.005]


class Slow(httpx.AsyncByteStream):
    """One chunk, then silence (keep-alive comments only) for ``seconds``; records closing."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.closed = False

    async def __aiter__(self):
        yield sse(chunk("a"))
        for _ in range(int(self.seconds / 0.01)):
            await anyio.sleep(0.01)
            yield b": ping\n\n"
        yield sse(chunk("b"))

    async def aclose(self) -> None:
        self.closed = True


@respx.mock
async def test_stream_idle_timeout_between_chunks(make_client) -> None:
    # Keep-alive comments arrive every 10 ms, yet no chunk for 1 s: the idle timeout fires.
    slow = Slow(1.0)
    respx.post(URL).mock(return_value=httpx.Response(200, stream=slow))
    async with make_client() as client:
        stream = await client.chat.completions.create(
            model="m", messages=MSG, stream=True, idle_timeout=0.1
        )
        got = []
        with anyio.fail_after(5), pytest.raises(APITimeoutError, match="No stream chunk"):
            async for c in stream:
                got.append(c)
    assert len(got) == 1 and slow.closed and client.limiter.in_flight == 0


@respx.mock
async def test_breaking_out_of_the_loop_closes_the_response(make_client) -> None:
    slow = Slow(10.0)
    respx.post(URL).mock(return_value=httpx.Response(200, stream=slow))
    async with make_client(max_concurrency=1) as client:
        stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
        async for _ in stream:
            break
        del _
        for _ in range(20):  # the loop's generator is finalized by the event loop
            await anyio.sleep(0.01)
            if slow.closed:
                break
        assert slow.closed and client.limiter.in_flight == 0
        # context-manager form: leaving the block closes it as well
        slow2 = Slow(10.0)
        respx.post(URL).mock(return_value=httpx.Response(200, stream=slow2))
        async with await client.chat.completions.create(model="m", messages=MSG, stream=True) as s:
            await s.__anext__()
        assert slow2.closed and client.limiter.in_flight == 0


@respx.mock
async def test_completions_stream(make_client) -> None:
    body = sse({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ab"}]})
    respx.post(f"{BASE}/completions").mock(
        return_value=httpx.Response(200, content=body + b"data: [DONE]\n\n")
    )
    async with make_client() as client:
        stream = await client.completions.create(model="m", prompt="p", stream=True)
        assert [c.choices[0].text async for c in stream] == ["ab"]
