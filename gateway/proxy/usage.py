"""Token usage of proxied answers, for exact per-key accounting in upstream mode.

A non-streaming answer carries ``usage`` in its JSON body. A stream carries it in its last
chunk only when the request asked ``stream_options.include_usage``; the proxy asks for it on
every streamed request (``ask_usage``) and ``UsageTap`` reads the SSE events as they pass,
dropping that usage-only chunk again when the client had not asked for it. Events pass whole
and unchanged otherwise. A stream without usage (an upstream that ignores the option) is
counted as one completion token per content chunk (vLLM and prefixgate send one token per
chunk), the prompt left at the admission estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prefixgate.gateway.http.access_log import record
from prefixgate.gateway.http.errors import APIError

if TYPE_CHECKING:
    from aiohttp import web
    from prefixgate.gateway.state import GatewayState
    from prefixgate.gateway.tenancy.admission import Ticket
    from prefixgate.gateway.tenancy.keys import Principal
    from prefixgate.gateway.tenancy.shared_state import Lease, StateBackend


@dataclass(slots=True)
class Usage:
    """Prompt and completion tokens of one answer (``exact``: read from ``usage``)."""

    prompt_tokens: int | None = None
    completion_tokens: int = 0
    exact: bool = False

    def read(self, usage: Any) -> bool:
        """Take an OpenAI ``usage`` object; False when it is not one."""
        if not isinstance(usage, dict):
            return False
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(p, int) or not isinstance(c, int) or not (_count(p) and _count(c)):
            return False
        self.prompt_tokens, self.completion_tokens, self.exact = p, c, True
        return True


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def body_usage(data: bytes) -> Usage:
    """The usage of a non-streaming JSON answer (inexact, empty when it has none)."""
    out = Usage()
    try:
        parsed = json.loads(data)
    except ValueError:
        return out
    if isinstance(parsed, dict):
        out.read(parsed.get("usage"))
    return out


def ask_usage(body: dict[str, Any]) -> bool:
    """Make a streamed request ask for usage (in place); returns whether the client had
    asked for it itself (its usage chunk is then passed on, else dropped)."""
    options = body.get("stream_options")
    wanted = isinstance(options, dict) and options.get("include_usage") is True
    if body.get("stream") is True and not wanted:
        base = options if isinstance(options, dict) else {}
        body["stream_options"] = {**base, "include_usage": True}
    return wanted


class UsageTap:
    """Reads ``usage`` from SSE events passing through; ``feed(bytes) -> bytes to forward``.

    Whole events (ending in a blank line) are forwarded as they complete; a partial event is
    held until its end comes (or ``flush`` at the end of the stream).
    """

    __slots__ = ("usage", "_keep_usage_chunk", "_buf", "_content_chunks")

    def __init__(self, keep_usage_chunk: bool) -> None:
        self.usage = Usage()
        self._keep_usage_chunk = keep_usage_chunk
        self._buf = b""
        self._content_chunks = 0

    def feed(self, data: bytes) -> bytes:
        """Bytes of ``data`` (after what was held) that complete events, to forward now."""
        self._buf += data
        out = []
        while True:
            end, sep = _event_end(self._buf)
            if end < 0:
                break
            event = self._buf[: end + sep]
            self._buf = self._buf[end + sep :]
            if self._see(event[:end]):
                out.append(event)
        return b"".join(out)

    def flush(self) -> bytes:
        """The held partial event (the stream ended without its blank line)."""
        rest, self._buf = self._buf, b""
        if rest and not self._see(rest):
            return b""
        return rest

    def completion_tokens(self) -> int:
        """Completion tokens: the reported usage, else one per content chunk seen."""
        return self.usage.completion_tokens if self.usage.exact else self._content_chunks

    def _see(self, event: bytes) -> bool:
        """Note one event; False when it is the injected usage chunk to drop."""
        payload = b"\n".join(
            line[5:].lstrip(b" ")
            for line in event.replace(b"\r\n", b"\n").split(b"\n")
            if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict) and _has_content(c):
                    self._content_chunks += 1
        if obj.get("usage") is not None and self.usage.read(obj.get("usage")):
            return self._keep_usage_chunk or bool(choices)
        return True


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content")) or bool(delta.get("tool_calls"))
    return bool(choice.get("text"))


def _event_end(buf: bytes) -> tuple[int, int]:
    """(index where the first complete event ends, length of its blank-line separator), or
    (-1, 0) when no event is complete yet."""
    best, sep = -1, 0
    for marker in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = buf.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, sep = i, len(marker)
    return best, sep


async def admit_call(
    st: GatewayState, principal: Principal, est_tokens: int
) -> tuple[Lease, Ticket]:
    """Before a proxied call: the key's token lease for ``est_tokens`` (the prompt's estimate,
    tokens), then the admission ticket; the lease is refunded when admission refuses.

    Raises:
        APIError: 429 over the key's limits or the gateway's queue bounds.
    """
    lease = await st.shared.acquire(principal, est_tokens)
    try:
        ticket = st.admission.admit(est_tokens, tenant=principal.tenant, weight=principal.weight)
    except APIError:
        st.shared.refund(principal, lease)
        raise
    return lease, ticket


class Served(Protocol):
    """What a proxied call reports once it ends: whether the upstream served it, and the
    tokens (the prompt None when the upstream reported no usage)."""

    served: bool

    def prompt_tokens(self) -> int | None: ...

    def completion_tokens(self) -> int: ...


def settle_usage(
    request: web.Request,
    shared: StateBackend,
    principal: Principal,
    lease: Lease,
    est_tokens: int,
    call: Served,
) -> None:
    """Once a proxied call ends: a served call settles ``lease`` with the tokens the upstream
    reported (the prompt at the admission estimate ``est_tokens`` when it reported none) and
    a reported prompt goes to the access line; a call not served is refunded."""
    if not call.served:
        shared.refund(principal, lease)
        return
    prompt = call.prompt_tokens()
    shared.settle(
        principal, lease, est_tokens if prompt is None else prompt, call.completion_tokens()
    )
    if prompt is not None:  # the upstream's usage, for the access line
        rec = record(request)
        rec.prompt_tokens, rec.completion_tokens = prompt, call.completion_tokens()
