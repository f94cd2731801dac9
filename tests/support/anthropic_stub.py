"""A stub of Anthropic's Messages API (``POST /v1/messages``) after its documented wire
format: each request is recorded (``seen``: body, ``headers``); the prompt cache is modelled —
a block with ``cache_control`` makes the prompt up to it a cache entry (written the first
time, read after), tokens counted as 4 characters each. ``status`` other than 200 answers an
Anthropic error object (its message a secret the gateway must not show). A tool is called
when ``tool_choice`` is ``any`` or ``tool``."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prefixgate.gateway.proxy.config import ProxyConfig, load_config

SECRET = "internal shard 7 overloaded"


def claude_config(path: Path, url: str, more: str = "") -> ProxyConfig:
    """The proxy config written to ``path`` and loaded: model ``claude`` on one Anthropic
    deployment at ``url`` (upstream model ``claude-sonnet-4-5``, key ``sk-ant-test`` read from
    ``ANTHROPIC_KEY``), then the TOML text ``more`` (further models)."""
    path.write_text(
        f"""
[[models]]
name = "claude"
[[models.deployments]]
url = "{url}"
dialect = "anthropic"
model = "claude-sonnet-4-5"
api_key_env = "ANTHROPIC_KEY"
"""
        + more
    )
    return load_config(path, env={"ANTHROPIC_KEY": "sk-ant-test"})


@dataclass
class AnthropicStub:
    status: int = 200
    seen: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    cache: set[str] = field(default_factory=set)
    stall_s: float = 0.0  # a stream goes silent this long after message_start

    def _usage(self, body: dict) -> dict:
        parts: list[dict] = [*(body.get("system") or [])]
        for m in body["messages"]:
            parts += m["content"]
        total = read = write = 0
        prefix = ""
        for block in parts:
            prefix += json.dumps({k: v for k, v in block.items() if k != "cache_control"})
            if "cache_control" in block:
                tokens = len(prefix) // 4 - read - write
                if prefix in self.cache:
                    read += tokens
                else:
                    write += tokens
                    self.cache.add(prefix)
        total = len(prefix) // 4
        return {
            "input_tokens": total - read - write,
            "output_tokens": 3,
            "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read,
        }

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        self.headers.append(dict(request.headers))
        if self.status != 200:
            err = {"type": "error", "error": {"type": "overloaded_error", "message": SECRET}}
            return web.json_response(err, status=self.status)
        usage = self._usage(body)
        choice = body.get("tool_choice") or {}
        if choice.get("type") in ("any", "tool"):
            name = choice.get("name") or body["tools"][0]["name"]
            content = [
                {"type": "tool_use", "id": "toolu_1", "name": name, "input": {"city": "Oslo"}}
            ]
            stop = "tool_use"
        else:
            content = [{"type": "text", "text": "hello there"}]
            stop = "end_turn"
        msg = {
            "id": f"msg_{len(self.seen)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return web.json_response(msg)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(kind: str, data: dict) -> None:
            await resp.write(
                f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
            )

        start_usage = {**usage, "output_tokens": 1}
        await send(
            "message_start",
            {"message": {**msg, "content": [], "stop_reason": None, "usage": start_usage}},
        )
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        for i, block in enumerate(content):
            if block["type"] == "text":
                await send(
                    "content_block_start",
                    {"index": i, "content_block": {"type": "text", "text": ""}},
                )
                await send("ping", {})
                for piece in ("hello", " there"):
                    delta = {"type": "text_delta", "text": piece}
                    await send("content_block_delta", {"index": i, "delta": delta})
            else:
                await send(
                    "content_block_start", {"index": i, "content_block": {**block, "input": {}}}
                )
                for piece in ('{"city": ', '"Oslo"}'):
                    delta = {"type": "input_json_delta", "partial_json": piece}
                    await send("content_block_delta", {"index": i, "delta": delta})
            await send("content_block_stop", {"index": i})
        await send(
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 3}},
        )
        await send("message_stop", {})
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        return app
