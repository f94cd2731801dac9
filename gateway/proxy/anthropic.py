"""Anthropic-dialect deployments: an OpenAI chat completions request translated to the
Messages API (``POST /v1/messages``), its answer — whole or streamed event by event —
translated back, with prompt-cache breakpoints placed for the caller.

Request (OpenAI → Anthropic): system and developer messages become ``system`` blocks; user
text and image parts (``image_url``: a base64 ``data:`` URL or an http(s) URL), assistant text and ``tool_calls`` (``tool_use`` blocks), ``tool`` messages
(``tool_result`` blocks in a user turn); ``max_tokens`` / ``max_completion_tokens``
(default :data:`DEFAULT_MAX_TOKENS`: Anthropic requires one), ``temperature``, ``top_p``,
``stop`` (``stop_sequences``), ``tools`` and ``tool_choice``, ``user`` (``metadata.user_id``).
Any other field — ``n`` > 1, ``logprobs``, ``response_format``, penalties, ... — is
refused by name (400), never dropped.

Cache breakpoints (``cache_control``, at most :data:`MAX_BREAKPOINTS`): at the end of a
registered prefix's messages (TTL ``1h`` when the prefix lives more than 5 more minutes,
else ``5m``), on the last system block, and on the last block of the conversation's stable
head (every message before the last user turn), these two only where the text up to them
reaches Anthropic's minimum cacheable length (:data:`MIN_CACHE_CHARS`, about 1024 tokens
at 4 characters a token); breakpoints inside the prefix take its TTL, later ones ``5m``.

Answer (Anthropic → OpenAI): text blocks joined as ``content``, ``tool_use`` blocks as
``tool_calls``; ``stop_reason`` as ``finish_reason`` (``end_turn`` / ``stop_sequence`` →
``stop``, ``max_tokens`` → ``length``, ``tool_use`` → ``tool_calls``); usage:
``prompt_tokens`` = input + cache reads + cache writes, ``prompt_tokens_details``:
``cached_tokens`` = cache reads, ``cache_write_tokens`` = cache writes. An error answer is an
OpenAI error object with the upstream's status and error type, never its message or body.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prefixgate.gateway.http.errors import bad_request
from prefixgate.gateway.http.sse import (
    DONE,
    KEEPALIVE,
    SSE_HEADERS,
    client_gone,
    client_left,
    encode_event,
    end_stream,
)
from prefixgate.gateway.tenancy.keys import bearer_token

logger = logging.getLogger("prefixgate.gateway")

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
MAX_BREAKPOINTS = 4  # Anthropic's limit of cache_control blocks per request
MIN_CACHE_CHARS = 4096  # ~1024 tokens: the shortest prefix most Claude models cache
_IGNORED = frozenset(("model", "messages", "stream", "stream_options", "cache_salt"))
_MAPPED = frozenset(
    (
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "tools",
        "tool_choice",
        "user",
        "parallel_tool_calls",
    )
)
_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def to_messages(
    body: dict[str, Any], model: str, prefix_messages: int = 0, prefix_ttl_s: float = 0.0
) -> dict[str, Any]:
    """The Messages API body of an OpenAI chat completions ``body`` for ``model``; its first
    ``prefix_messages`` messages are a registered prefix living ``prefix_ttl_s`` more seconds
    (a breakpoint at its end, TTL ``1h`` when it outlives 5 minutes).

    Raises:
        APIError: 400 naming a field or content part an Anthropic deployment cannot take.
    """
    for name in body:
        if name not in _IGNORED and name not in _MAPPED and body[name] is not None:
            raise bad_request(
                f"{name} is not supported by this model's Anthropic deployment", param=name
            )
    if body.get("parallel_tool_calls") is False:
        raise bad_request(
            "parallel_tool_calls=false is not supported by this model's Anthropic deployment",
            param="parallel_tool_calls",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    mark: tuple[int, int, int] | None = None  # (system blocks, turns, blocks of the last turn)
    for i, m in enumerate(messages):
        if i == prefix_messages and i:
            mark = (len(system), len(turns), len(turns[-1]["content"]) if turns else 0)
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role in ("system", "developer"):
            system += [{"type": "text", "text": t} for t in _texts(m.get("content"), i) if t]
        elif role == "user":
            _append(turns, "user", _user_blocks(m.get("content"), i))
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [
                {"type": "text", "text": t} for t in _texts(m.get("content"), i) if t
            ]
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {} if isinstance(call, dict) else {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    raise bad_request(
                        f"messages[{i}].tool_calls: arguments must be JSON", param="messages"
                    ) from None
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": fn.get("name"),
                        "input": args,
                    }
                )
            _append(turns, "assistant", blocks)
        elif role == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": m.get("tool_call_id"),
                "content": "".join(_texts(m.get("content"), i)),
            }
            _append(turns, "user", [result])
        else:
            raise bad_request(f"messages[{i}].role {role!r} is not supported", param="messages")
    out: dict[str, Any] = {
        "model": model,
        "max_tokens": body.get("max_completion_tokens")
        or body.get("max_tokens")
        or DEFAULT_MAX_TOKENS,
        "messages": turns,
    }
    if system:
        out["system"] = system
    if body.get("temperature") is not None:
        out["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    stop = body.get("stop")
    if stop is not None:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("user") is not None:
        out["metadata"] = {"user_id": body["user"]}
    if body.get("tools"):
        out["tools"] = [_tool(t) for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
    if body.get("stream"):
        out["stream"] = True
    if prefix_messages >= len(messages) and prefix_messages:
        mark = (len(system), len(turns), len(turns[-1]["content"]) if turns else 0)
    place_breakpoints(out, mark, "1h" if prefix_ttl_s > 300 else "5m")
    return out


def place_breakpoints(
    req: dict[str, Any], prefix: tuple[int, int, int] | None = None, prefix_ttl: str = "5m"
) -> int:
    """Mark the cacheable head of a Messages body with ``cache_control`` (see the module
    docstring): the end of a registered prefix (``prefix``: system blocks, turns and blocks of
    its last turn it covers) with ``prefix_ttl``, the system prompt, the conversation's head
    before the last user turn — each breakpoint inside the prefix with its TTL, after it
    ``5m`` (Anthropic wants longer TTLs first). Returns how many it placed (at most
    :data:`MAX_BREAKPOINTS`)."""
    system = req.get("system") or []
    turns = req.get("messages") or []
    marks: list[tuple[dict[str, Any], bool]] = []  # (block, inside the prefix)
    if prefix is not None:
        n_sys, n_turns, n_blocks = prefix
        if n_turns and n_blocks:
            marks.append((turns[n_turns - 1]["content"][n_blocks - 1], True))
        elif n_sys:
            marks.append((system[n_sys - 1], True))
    chars = sum(len(b.get("text", "")) for b in system)
    if system and chars >= MIN_CACHE_CHARS:
        inside = prefix is not None and (prefix[1] > 0 or prefix[0] >= len(system))
        marks.append((system[-1], inside))
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
    head = turns[:last_user]
    chars += sum(len(json.dumps(b)) for t in head for b in t["content"])
    if head and head[-1]["content"] and chars >= MIN_CACHE_CHARS:
        inside = prefix is not None and prefix[1] > len(head)
        marks.append((head[-1]["content"][-1], inside))
    placed = 0
    for block, inside in marks:
        if "cache_control" in block or placed >= MAX_BREAKPOINTS:
            continue
        block["cache_control"] = {"type": "ephemeral", "ttl": prefix_ttl if inside else "5m"}
        placed += 1
    return placed


_IMAGE_TYPES = frozenset(("image/jpeg", "image/png", "image/gif", "image/webp"))


def _user_blocks(content: Any, i: int) -> list[dict[str, Any]]:
    """A user message's content as Messages API blocks: text, and ``image_url`` parts as
    ``image`` blocks (a ``data:`` URL of JPEG, PNG, GIF or WebP as base64, an http(s) URL
    as a URL source)."""
    if not isinstance(content, list):
        return [{"type": "text", "text": t} for t in _texts(content, i)]
    out: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "image_url":
            out += [{"type": "text", "text": t} for t in _texts([part], i)]
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else None
        if isinstance(url, str) and url.startswith("data:") and ";base64," in url:
            media, data = url[5:].split(";base64,", 1)
            if media not in _IMAGE_TYPES:
                raise bad_request(
                    f"messages[{i}].content: {media or 'this'} images are not supported by "
                    "this model's Anthropic deployment (JPEG, PNG, GIF, WebP)",
                    param="messages",
                )
            source = {"type": "base64", "media_type": media, "data": data}
            out.append({"type": "image", "source": source})
        elif isinstance(url, str) and url.startswith(("https://", "http://")):
            out.append({"type": "image", "source": {"type": "url", "url": url}})
        else:
            raise bad_request(
                f"messages[{i}].content: image_url.url must be a data: or http(s) URL",
                param="messages",
            )
    return out


def _texts(content: Any, i: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list", param="messages")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise bad_request(
                f"messages[{i}].content: {kind or 'this'} parts are not supported here by "
                "this model's Anthropic deployment",
                param="messages",
            )
        out.append(str(part.get("text", "")))
    return out


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Add ``blocks`` as a turn of ``role`` (merged into the previous turn of the same role:
    tool results and the next user text share one user turn)."""
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks or [{"type": "text", "text": ""}]})


def _tool(t: Any) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("tools: only function tools with a name are supported", param="tools")
    out = {"name": fn["name"], "input_schema": fn.get("parameters") or {"type": "object"}}
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        return {"type": "tool", "name": choice["function"]["name"]}
    raise bad_request("tool_choice: not a tool choice", param="tool_choice")


def usage_of(u: Any) -> dict[str, Any]:
    """OpenAI usage of an Anthropic ``usage`` object (see the module docstring)."""
    u = u if isinstance(u, dict) else {}
    read = int(u.get("cache_read_input_tokens") or 0)
    write = int(u.get("cache_creation_input_tokens") or 0)
    prompt = int(u.get("input_tokens") or 0) + read + write
    completion = int(u.get("output_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": read, "cache_write_tokens": write},
    }


def to_completion(msg: dict[str, Any], model: str) -> dict[str, Any]:
    """The ``chat.completion`` of a Messages API answer, under the public ``model`` name."""
    text = "".join(b.get("text", "") for b in msg.get("content", []) if b.get("type") == "text")
    calls = [
        {
            "id": b.get("id"),
            "type": "function",
            "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))},
        }
        for b in msg.get("content", [])
        if b.get("type") == "tool_use"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": "chatcmpl-" + str(msg.get("id", "")),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _FINISH.get(msg.get("stop_reason") or "", "stop"),
            }
        ],
        "usage": usage_of(msg.get("usage")),
    }


def finish_reason(stop_reason: Any) -> str | None:
    """The OpenAI ``finish_reason`` of a Messages answer's ``stop_reason`` (None: none yet)."""
    if not isinstance(stop_reason, str):
        return None
    return _FINISH.get(stop_reason, "stop")


def headers_for(auth: str | None) -> dict[str, str]:
    """Headers of a Messages API request: the deployment's key as ``x-api-key`` (the token of
    a Bearer ``auth``, ``keys.bearer_token``; another scheme's value as it is)."""
    out = {"Content-Type": "application/json", "anthropic-version": ANTHROPIC_VERSION}
    if auth is not None:
        token = bearer_token(auth)
        out["x-api-key"] = auth if token is None else token
    return out


class StreamTranslator:
    """Anthropic stream events in, OpenAI ``chat.completion.chunk`` events out (bytes).

    ``feed(event_type, data) -> bytes``; ``done`` once ``message_stop`` came; ``usage`` the
    OpenAI usage so far (None before ``message_start``). Each chunk is read into ``account``
    (the request's ``RequestAccount``, when given: its finish reason, its token times).
    """

    def __init__(self, model: str, include_usage: bool, account: Any = None) -> None:
        self.account = account
        self.model = model
        self.include_usage = include_usage
        self.id = "chatcmpl-"
        self.created = int(time.time())
        self.done = False
        self.usage: dict[str, Any] | None = None
        self._raw: dict[str, Any] = {}
        self._tools: dict[int, int] = {}  # content block index -> tool call index
        self.finish: str | None = None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        if self.account is not None:
            self.account.read_choices(choices, streamed=True)
        return encode_event(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    def feed(self, kind: str, data: dict[str, Any]) -> bytes:
        if kind == "message_start":
            msg = data.get("message") or {}
            self.id = "chatcmpl-" + str(msg.get("id", ""))
            self._raw = dict(msg.get("usage") or {})
            self.usage = usage_of(self._raw)
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                n = self._tools[data.get("index", 0)] = len(self._tools)
                call = {
                    "index": n,
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": ""},
                }
                return self._chunk({"tool_calls": [call]})
            if block.get("type") == "text" and block.get("text"):
                return self._chunk({"content": block["text"]})
            return b""
        if kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                return self._chunk({"content": delta.get("text", "")})
            if delta.get("type") == "input_json_delta":
                n = self._tools.get(data.get("index", 0), 0)
                part = {"index": n, "function": {"arguments": delta.get("partial_json", "")}}
                return self._chunk({"tool_calls": [part]})
            return b""
        if kind == "message_delta":
            self._raw.update({k: v for k, v in (data.get("usage") or {}).items() if v is not None})
            self.usage = usage_of(self._raw)
            reason = (data.get("delta") or {}).get("stop_reason")
            self.finish = _FINISH.get(reason or "", "stop")
            return self._chunk({}, self.finish)
        if kind == "message_stop":
            self.done = True
            out = b""
            if self.include_usage and self.usage is not None:
                out += encode_event(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.usage,
                    }
                )
            return out + DONE
        if kind == "error":
            err = data.get("error") or {}
            kind_ = str(err.get("type", "api_error"))[:64]
            raise _StreamError(f"the Anthropic upstream's stream failed ({kind_})")
        return b""  # ping, content_block_stop, unknown events


class _StreamError(Exception):
    pass


async def relay_stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    translator: StreamTranslator,
    idle_timeout_s: float,
    keepalive_s: float,
) -> web.StreamResponse:
    """Translate ``resp``'s Anthropic SSE stream to the client as OpenAI chunks, with
    ``: keep-alive`` comments every ``keepalive_s`` while it is silent (as every chat
    stream); a stream that breaks, ends before ``message_stop`` or is silent for
    ``idle_timeout_s`` ends with an in-band error event."""
    from prefixgate.gateway.proxy.relay import mid_stream_error, stream_error, upstream_reads

    out = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await out.prepare(request)
    buf = b""
    error: bytes | None = None
    reads = upstream_reads(resp, keepalive_s, idle_timeout_s)
    try:
        while not translator.done:
            chunk = await anext(reads, b"")
            if chunk is None:  # silent for keepalive_s
                await out.write(KEEPALIVE)
                continue
            if not chunk:
                error = stream_error("the upstream's stream ended before its last event")
                break
            buf = (buf + chunk).replace(b"\r\n", b"\n")
            while b"\n\n" in buf and not translator.done:
                event, buf = buf.split(b"\n\n", 1)
                kind, data = "", b""
                for line in event.split(b"\n"):
                    if line.startswith(b"event:"):
                        kind = line[6:].strip().decode()
                    elif line.startswith(b"data:"):
                        data += line[5:].strip()
                if not data:
                    continue
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise _StreamError(
                        "the upstream sent an event whose data is not JSON"
                    ) from None
                passed = translator.feed(kind or str(obj.get("type", "")), obj)
                if passed:
                    await out.write(passed)
    except _StreamError as exc:
        error = stream_error(str(exc))
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
        if client_gone(request):  # a write to the client failed: aiohttp's
            return client_left(out)  # ClientConnectionResetError is a ClientConnectionError too
        cut = mid_stream_error(exc, idle_timeout_s)
        error = stream_error(cut.message, code=cut.code or "upstream_error")
    except ConnectionResetError:
        return client_left(out)
    return await end_stream(out, error)
