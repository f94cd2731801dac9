"""A scripted OpenAI-compatible chat upstream (vLLM's wire shapes, as the ``openai`` package
types them) for the Messages API in upstream mode: every chat request is recorded (``seen``:
body; ``headers``), and answered with ``reply`` as content or, when ``calls`` is set, those
tool calls (``[(name, arguments JSON)]``, ids ``call_0``...). Streams send a role chunk, the
content in two pieces or each call as its id + name then its arguments in two pieces, a finish
chunk (``finish_reason``, vLLM's ``stop_reason``), the usage chunk when asked and ``[DONE]``;
``cut=True`` ends the stream after the first content piece (``after_first``: these bytes,
then the end; ``pause_s``: that many seconds of silence there, then the rest). ``status`` other than 200
answers an OpenAI error whose message is ``SECRET``. Usage: ``prompt_tokens`` = the
messages' characters, ``cached_tokens`` = ``cached`` (``None``: ``prompt_tokens_details: null``,
as vLLM without ``--enable-prompt-tokens-details``). ``POST /tokenize`` (vLLM's chat form)
counts the messages' characters (that many ``tokens``) unless ``tokenize`` is False. ``GET /v1/models`` lists
``name`` owned by ``vllm``.

``kind`` names the server whose fields the answer carries (``upstream_fields``): ``vllm``
(``stop_reason``), ``sglang`` (``matched_stop`` instead; owned by ``sglang``), ``llamacpp``
(no matched stop, a ``timings`` object; owned by ``llamacpp``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

SECRET = "gpu-7 OOM at /srv/secret/path"


@dataclass
class ChatStub:
    name: str = "llama"
    reply: str = "hello there"
    calls: list[tuple[str, str]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    status: int = 200
    cut: bool = False
    after_first: bytes = b""  # written after the first content piece, then the stream ends
    pause_s: float = 0.0  # silence after the first content piece of a stream
    cached: int | None = 8
    tokenize: bool = True
    kind: str = "vllm"
    seen: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)

    @staticmethod
    def _prompt(body: dict) -> int:
        return sum(len(m.get("content") or "") for m in body["messages"])

    def _finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.calls else "stop")

    def _usage(self, body: dict) -> dict:
        prompt = self._prompt(body)
        details = None if self.cached is None else {"cached_tokens": min(self.cached, prompt)}
        return {
            "prompt_tokens": prompt,
            "completion_tokens": 5,
            "total_tokens": prompt + 5,
            "prompt_tokens_details": details,
        }

    def _stop_fields(self) -> dict:
        """The matched stop as this kind of server names it."""
        if self.kind == "sglang":
            return {"matched_stop": self.stop_reason}
        if self.kind == "llamacpp":
            return {}
        return {"stop_reason": self.stop_reason}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            error = {"message": SECRET, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=self.status)
        calls = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(self.calls)
        ]
        if not body.get("stream"):
            message: dict = {"role": "assistant", "content": None if calls else self.reply}
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": self._finish(),
                **self._stop_fields(),
            }
            answer = {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [choice],
                "usage": self._usage(body),
            }
            if self.kind == "llamacpp":
                answer["timings"] = {"prompt_n": 1, "prompt_ms": 1.0, "predicted_n": 5}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0}
        base["model"] = body["model"]

        async def send(delta: dict, finish: str | None = None, **extra) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            chunk = {**base, "choices": [{**choice, **extra}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        if calls:
            for i, c in enumerate(calls):
                fn = c["function"]
                head = {"index": i, "id": c["id"], "type": "function"}
                await send({"tool_calls": [{**head, "function": {"name": fn["name"]}}]})
                half = len(fn["arguments"]) // 2
                for part in (fn["arguments"][:half], fn["arguments"][half:]):
                    await send({"tool_calls": [{"index": i, "function": {"arguments": part}}]})
        else:
            half = len(self.reply) // 2
            await send({"content": self.reply[:half]})
            await asyncio.sleep(self.pause_s)
            if self.cut or self.after_first:
                await resp.write(self.after_first)
                await resp.write_eof()
                return resp
            await send({"content": self.reply[half:]})
        await send({}, self._finish(), **self._stop_fields())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**base, "choices": [], "usage": self._usage(body)}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize_route(self, request: web.Request) -> web.Response:
        if not self.tokenize:
            raise web.HTTPNotFound()
        body = await request.json()
        self.seen.append(body)
        count = self._prompt(body)
        return web.json_response(
            {"count": count, "max_model_len": 4096, "tokens": list(range(3, count + 3))}
        )

    async def models(self, request: web.Request) -> web.Response:
        owner = {"sglang": "sglang", "llamacpp": "llamacpp"}.get(self.kind, "vllm")
        card = {"id": self.name, "object": "model", "created": 0, "owned_by": owner}
        return web.json_response({"object": "list", "data": [card]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize_route)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", lambda r: web.json_response({"ok": True}))
        return app
