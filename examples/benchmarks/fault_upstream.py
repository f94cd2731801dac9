"""A misbehaving OpenAI-compatible upstream on loopback (raw asyncio, its own thread), for the
proxy fault matrix of ``faults`` and the gateway's tests.

``FaultUpstream(mode)``: ``GET /health`` is always 200, ``GET /v1/models`` lists ``fault``;
``POST /v1/chat/completions`` and
``/v1/completions`` answer by ``mode`` (changeable between requests):

* ``ok`` — a well-formed answer: ``chunks`` content chunks ``delay_s`` apart, a chunk with
  ``finish_reason`` and ``data: [DONE]`` (stream), or a JSON completion (after
  ``chunks * delay_s`` seconds);
* ``html200`` — status 200 with an HTML page;
* ``garbage`` — status 200 with bytes that are neither JSON nor server-sent events;
* ``eof`` — two content chunks, then a clean end of the response: no finish_reason, no
  ``[DONE]`` (non-stream: half of the declared JSON body, then the connection closes);
* ``stall`` — two content chunks, then nothing (the connection stays open);
* ``kill`` — two content chunks (non-stream: half the body), then the connection is reset;
* ``nochoices`` — a JSON completion without ``choices`` (stream: chunks without it);
* ``sse`` — a well-formed stream, even to a non-stream request;
* ``nofinish`` — chunks, then ``data: [DONE]`` with no ``finish_reason`` (non-stream: a
  completion whose choice has ``finish_reason`` null);
* ``auth401`` / ``auth403`` — that status with an OpenAI error body quoting the
  ``Authorization`` it got ("Incorrect API key provided: Bearer sk-..."), as some servers do.

``auth`` holds the last ``Authorization`` header received. ``freeze()`` makes it a frozen
server (as under ``kill -STOP``): connections are accepted and requests read, ``GET /health``
included, but nothing is answered until ``thaw()``, which answers what waited.
"""

from __future__ import annotations

import asyncio
import json
import threading

CHUNK = {
    "id": "chatcmpl-fault",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "fault",
}


def _chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {"content": content} if content is not None else {}
    obj = {**CHUNK, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _completion(text: str, finish: str | None = "stop", choices: bool = True) -> bytes:
    body = json.loads(_completion_body(text))
    body["choices"][0]["finish_reason"] = finish
    if not choices:
        del body["choices"]
    return json.dumps(body).encode()


def _completion_body(text: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-fault",
            "object": "chat.completion",
            "created": 0,
            "model": "fault",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


def _text_completion(obj: dict) -> dict:
    """A chat answer (body or chunk) as ``/v1/completions`` answers it (``text_completion``)."""
    out = {**obj, "object": "text_completion"}
    if "choices" in obj:
        out["choices"] = [
            {
                "index": c["index"],
                "text": (c.get("message") or c.get("delta") or {}).get("content") or "",
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
            for c in obj["choices"]
        ]
    return out


def _for_path(data: bytes, path: str) -> bytes:
    """``data`` (a JSON body, or one ``data:`` event) for ``path``: chat shapes as they are,
    ``text_completion`` ones for ``/v1/completions``."""
    if not path.startswith("/v1/completions"):
        return data
    if data.startswith(b"data: {"):
        obj = _text_completion(json.loads(data[6:]))
        return b"data: " + json.dumps(obj).encode() + b"\n\n"
    if data.startswith(b"{"):
        return json.dumps(_text_completion(json.loads(data))).encode()
    return data


class FaultUpstream:
    """The server; ``url`` once entered (context manager); ``requests`` counts answers."""

    def __init__(self, mode: str = "ok", chunks: int = 4, delay_s: float = 0.01) -> None:
        self.mode = mode
        self.chunks = chunks
        self.delay_s = delay_s
        self.requests = 0
        self.auth: str | None = None
        self._path = ""
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._thawed = asyncio.Event()
        self._thawed.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultUpstream:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def freeze(self) -> None:
        """Answer nothing from now on (requests are read and wait) until ``thaw``."""
        self._call(self._thawed.clear)

    def thaw(self) -> None:
        """Answer again, the waiting requests first."""
        self._call(self._thawed.set)

    def _call(self, fn: object) -> None:
        async def run() -> None:
            fn()  # type: ignore[operator]

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                    if line.lower().startswith("authorization:") and path != "/health":
                        self.auth = line.split(":", 1)[1].strip()
                body = await reader.readexactly(length) if length else b""
                await self._thawed.wait()  # frozen: read, never answered
                if path == "/health":
                    await self._send(writer, 200, "application/json", b'{"status":"ok"}')
                    continue
                if path == "/v1/models":  # well-formed always: the faults are the answers'
                    self._path = path
                    card = {"id": "fault", "object": "model", "owned_by": "fault"}
                    models = json.dumps({"object": "list", "data": [card]}).encode()
                    await self._send(writer, 200, "application/json", models)
                    continue
                self.requests += 1
                stream = bool(body and json.loads(body).get("stream"))
                self._path = path
                if not await self._answer(writer, stream):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _send(
        self, writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes
    ) -> None:
        if status == 200:
            body = _for_path(body, self._path)
        writer.write(
            f"HTTP/1.1 {status} OK\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _answer(self, writer: asyncio.StreamWriter, stream: bool) -> bool:
        """Answer one request by ``mode``; False when the connection must end."""
        mode = self.mode
        if mode in ("auth401", "auth403"):
            status = int(mode[4:])
            err = {
                "error": {
                    "message": f"Incorrect API key provided: {self.auth}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
            await self._send(writer, status, "application/json", json.dumps(err).encode())
            return True
        if mode == "nochoices" and not stream:
            await self._send(writer, 200, "application/json", _completion("ok", choices=False))
            return True
        if mode == "nofinish" and not stream:
            await self._send(writer, 200, "application/json", _completion("ok", finish=None))
            return True
        if mode == "sse":
            stream, mode = True, "ok"
        if mode == "html200":
            page = b"<html><body><h1>Welcome to nginx!</h1></body></html>"
            await self._send(writer, 200, "text/html", page)
            return True
        if mode == "garbage":
            ctype = "text/event-stream" if stream else "application/json"
            await self._send(writer, 200, ctype, b"\x00\x17garbage <<<>>> not json\n\n")
            return True
        if not stream:
            if mode == "stall":
                await asyncio.sleep(3600)
            if mode in ("eof", "kill"):  # half of the declared body, then an end or a reset
                body = _completion("ok " * self.chunks)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body[: len(body) // 2])
                )
                await writer.drain()
                if mode == "kill":
                    writer.transport.abort()
                return False
            await asyncio.sleep(self.chunks * self.delay_s)
            await self._send(writer, 200, "application/json", _completion("ok " * self.chunks))
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

        async def chunk(data: bytes) -> None:
            data = _for_path(data, self._path)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        n = self.chunks if mode in ("ok", "nofinish", "nochoices") else 2
        for i in range(n):
            if mode == "nochoices":
                await chunk(b"data: " + json.dumps(CHUNK).encode() + b"\n\n")
            else:
                await chunk(_chunk(f"t{i} "))
            await asyncio.sleep(self.delay_s)
        if mode in ("nofinish", "nochoices"):
            await chunk(b"data: [DONE]\n\n")
        if mode == "ok":
            await chunk(_chunk(None, "stop"))
            await chunk(b"data: [DONE]\n\n")
        elif mode == "stall":
            await asyncio.sleep(3600)
        elif mode == "kill":
            transport = writer.transport
            transport.abort()  # reset, mid-body
            return False
        writer.write(b"0\r\n\r\n")  # a clean end of the body (eof mode: without [DONE])
        await writer.drain()
        return True
