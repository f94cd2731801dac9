"""The tests' one stub OpenAI-compatible upstream, on loopback (``gateway.server.BackgroundServer``).

``start()`` serves it from a background thread; ``app`` alone is the factory for a caller's own
``BackgroundServer`` (``server.app[STUB]`` is then the stub). Each chat (or completions) request
is recorded: its body in ``seen``, and ``{"body", "auth", "outcome"}`` in ``records``
(``outcome``: ``"complete"``, or ``"cut"`` while a stream is unfinished or after its client
left). With ``status`` other than 200 every answer is that status with an OpenAI error body. A
request without ``stream`` gets a ``chat.completion`` naming the stub (``"upstream": name``,
gzip when asked). A streamed one ``max_tokens`` content chunks ``token_delay_s`` apart after ``ttft_s``, ends with a
usage chunk when ``stream_options.include_usage`` is set (``cached_tokens`` = half the prompt
tokens from the second request on), and answers 429 (``Retry-After: retry_after``) to every
``fail_every``-th request.
A prompt's tokens are its messages' characters. ``GET /v1/models`` lists ``models`` (default:
``name`` alone; assign it to change what the stub serves). With ``max_model_len`` set, the model card
says it and ``POST /tokenize`` counts prompts (``tokenize=False``: no such route).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web
from prefixgate.gateway.http.server import BackgroundServer

STUB: web.AppKey[StubServer] = web.AppKey("stub_upstream")


@dataclass
class StubServer:
    name: str = "stub-model"
    models: tuple[str, ...] = ()
    status: int = 200
    ttft_s: float = 0.02
    headers_after_s: float = 0.0  # a stream's headers held back this long (a slow prefill
    # before the first byte: the proxy counts a request waiting until its answer's headers)
    token_delay_s: float = 0.002
    fail_every: int = 0
    retry_after: str = "1"
    max_model_len: int | None = None
    tokenize: bool = True
    seen: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    max_in_flight: int = 0
    port: int = 0
    _in_flight: int = 0
    _server: BackgroundServer | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        record = {"body": body, "auth": request.headers.get("Authorization")}
        self.records.append(record)
        n = len(self.seen)
        if self.status != 200:
            error = {"message": "nope", "type": "x", "param": None, "code": None}
            return web.json_response({"error": error}, status=self.status)
        if self.fail_every and n % self.fail_every == 0:
            return web.json_response(
                {
                    "error": {
                        "message": "overloaded",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=429,
                headers={"Retry-After": self.retry_after},
            )
        text_route = request.path == "/v1/completions"  # text_completion shapes there
        if not body.get("stream"):
            record["outcome"] = "complete"
            choice: dict = {"index": 0, "logprobs": None, "finish_reason": "stop"}
            if text_route:
                choice["text"] = "ok"
            else:
                choice["message"] = {"role": "assistant", "content": "ok"}
            resp = web.json_response(
                {
                    "id": f"c{n}",
                    "object": "text_completion" if text_route else "chat.completion",
                    "created": 0,
                    "model": body.get("model", self.name),
                    "upstream": self.name,
                    "choices": [choice],
                    "usage": None,
                }
            )
            resp.enable_compression()  # gzip when asked: a proxy must not garble it
            return resp
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            record["outcome"] = "cut"
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await asyncio.sleep(self.headers_after_s)
            await resp.prepare(request)
            base = {
                "id": f"c{n}",
                "object": "text_completion" if text_route else "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
            }

            def part(content: str | None, fin: str | None) -> dict:
                if text_route:
                    return {
                        "index": 0,
                        "text": content or "",
                        "logprobs": None,
                        "finish_reason": fin,
                    }
                delta = {"role": "assistant"} if content is None else {"content": content}
                return {"index": 0, "delta": delta, "finish_reason": fin}

            if not text_route:
                await resp.write(
                    f"data: {json.dumps({**base, 'choices': [part(None, None)]})}\n\n".encode()
                )
            await asyncio.sleep(self.ttft_s)
            k = int(body.get("max_tokens", 4))
            for i in range(k):
                if i:
                    await asyncio.sleep(self.token_delay_s)
                fin = "length" if i == k - 1 else None
                chunk = {**base, "choices": [part(f"t{i} ", fin)]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if (body.get("stream_options") or {}).get("include_usage"):
                prompt = sum(len(m["content"]) for m in body.get("messages", [])) + len(
                    str(body.get("prompt", ""))
                )
                cached = prompt // 2 if n > 1 else 0
                usage = {
                    "prompt_tokens": prompt,
                    "completion_tokens": k,
                    "total_tokens": prompt + k,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                await resp.write(
                    f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode()
                )
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            record["outcome"] = "complete"
            return resp
        finally:
            self._in_flight -= 1

    async def _models(self, request: web.Request) -> web.Response:
        cards = []
        for model in self.models or (self.name,):
            card: dict = {"id": model, "object": "model", "owned_by": "stub"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            cards.append(card)
        return web.json_response({"object": "list", "data": cards})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.tokenize:
            raise web.HTTPNotFound()
        body = await request.json()
        count = sum(len(m["content"]) for m in body["messages"])
        return web.json_response({"count": count, "max_model_len": self.max_model_len})

    def app(self) -> web.Application:
        """The stub's aiohttp application."""
        app = web.Application()
        app[STUB] = self
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True}))
        return app

    def start(self) -> StubServer:
        """Serve on a free loopback port from a background thread (``gateway.server``)."""
        self._server = BackgroundServer(self.app).__enter__()
        self.port = int(self._server.url.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
