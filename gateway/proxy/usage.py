"""Token usage of proxied answers, read into the request's ``RequestAccount`` (the access
line, the per-key metrics and the key's charge all read it there).

A non-streaming answer carries ``usage`` in its JSON body. A stream carries it in its last
chunk only when the request asked ``stream_options.include_usage``; the proxy asks for it on
every streamed request (``ask_usage``) and ``UsageTap`` reads the SSE events as they pass,
dropping that usage-only chunk again when the client had not asked for it. Events pass whole
and unchanged otherwise. A stream without usage (an upstream that ignores the option) is
counted as one completion token per content chunk (vLLM and prefixgate send one token per
chunk, ``RequestAccount.estimated_completion_tokens``), the prompt left at the admission
estimate; the usage then stays not known (None). Once a call ends the handler charges the key
from the account (``tenancy.shared_state.close_lease``).
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any

from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.tenancy.shared_state import close_lease

if TYPE_CHECKING:
    from prefixgate.gateway.http.request_account import RequestAccount
    from prefixgate.gateway.state import GatewayState
    from prefixgate.gateway.tenancy.admission import Ticket
    from prefixgate.gateway.tenancy.keys import Principal
    from prefixgate.gateway.tenancy.shared_state import Lease


def body_usage(data: bytes, acct: RequestAccount) -> bool:
    """Read the ``usage`` of a non-streaming JSON answer into ``acct`` (and its first
    choice's ``finish_reason``); False when it has no usage (no tokens taken)."""
    parsed = _json_object(data)
    if parsed is None:
        return False
    acct.read_choices(parsed.get("choices"), streamed=False)
    return acct.read_usage(parsed.get("usage"))


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


def input_usage(tail: bytes, acct: RequestAccount) -> bool:
    """Read an embeddings answer's usage (its input tokens: ``prompt_tokens``, the last in
    ``tail``, the answer's last bytes, where ``usage`` follows the vectors) into ``acct`` as a
    request of that many prompt tokens and no completion, as local mode charges it; False
    when the answer has none (the key is then charged admission's estimate)."""
    found = _PROMPT_TOKENS.findall(tail)
    if not found:
        return False
    acct.prompt_tokens, acct.completion_tokens = int(found[-1]), 0
    acct.usage_reported = True
    return True


def _json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` parsed as a JSON object; None when it is not JSON or not an object."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def ask_usage(body: dict[str, Any]) -> bool:
    """Make a streamed request ask for usage (in place); returns whether the client had
    asked for it itself (its usage chunk is then passed on, else dropped)."""
    options = body.get("stream_options")
    # vLLM's continuous_usage_stats: include_usage defaults to true beside it (and beside
    # include_usage false the body is left as sent, for the upstream's answer)
    continuous = isinstance(options, dict) and options.get("continuous_usage_stats") is True
    wanted = isinstance(options, dict) and (
        options.get("include_usage") is True or (continuous and "include_usage" not in options)
    )
    if body.get("stream") is True and not wanted and not continuous:
        base = options if isinstance(options, dict) else {}
        body["stream_options"] = {**base, "include_usage": True}
    return wanted


class UsageTap:
    """Reads ``usage`` from SSE events passing through into the request's account ``acct``
    (``RequestAccount.read_usage``; until it comes, ``estimated_completion_tokens`` counts one
    per content chunk); ``feed(bytes) -> bytes to forward``.

    Whole events (ending in a blank line) are forwarded as they complete; a partial event is
    held until its end comes (or ``flush`` at the end of the stream).
    """

    __slots__ = ("account", "_keep_usage_chunk", "_buf")

    def __init__(self, acct: RequestAccount, keep_usage_chunk: bool) -> None:
        self.account = acct
        self._keep_usage_chunk = keep_usage_chunk
        self._buf = b""

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

    def _see(self, event: bytes) -> bool:
        """Note one event; False when it is the injected usage chunk to drop."""
        payload = b"\n".join(
            line[5:].lstrip(b" ")
            for line in event.replace(b"\r\n", b"\n").split(b"\n")
            if line.startswith(b"data:")
        )
        if not payload or payload == b"[DONE]":
            return True
        obj = _json_object(payload)
        if obj is None:
            return True
        choices = obj.get("choices")
        self.account.read_choices(choices, streamed=True)  # finish reason, token times
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict) and _has_content(c):
                    self.account.estimated_completion_tokens += 1
        if obj.get("usage") is not None and self.account.read_usage(obj.get("usage")):
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


def output_bound(body: Any) -> int | None:
    """The output bound a proxied body asks for: its ``max_completion_tokens``,
    ``max_tokens`` (chat, completions, Messages) or ``max_output_tokens`` (Responses), the
    first that is an int >= 1; ``None`` when none is (a malformed one is the upstream's to
    refuse). Admission spaces a budget refusal's slot by it (``AdmissionController.admit``)."""
    if not isinstance(body, dict):
        return None
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


async def admit_call(
    st: GatewayState,
    principal: Principal,
    est_tokens: int,
    acct: RequestAccount,
    max_tokens: int | None = None,
) -> tuple[Lease, Ticket]:
    """Before a proxied call: the key's token lease for ``est_tokens`` (the prompt's estimate,
    tokens), then the admission ticket (``max_tokens``: the body's output bound,
    ``output_bound``; ``None``: not given); the lease is refunded when admission refuses.
    Notes ``acct.received`` (now: the request is parsed) and ``acct.admitted``.

    Raises:
        APIError: 429 over the key's limits or the gateway's queue bounds.
    """
    acct.received = time.monotonic()
    lease = await st.shared.acquire(principal, est_tokens)
    try:
        ticket = st.admission.admit(
            est_tokens, tenant=principal.tenant, weight=principal.weight, max_tokens=max_tokens
        )
    except APIError:
        st.shared.refund(principal, lease)
        raise
    acct.admitted = time.monotonic()
    return lease, ticket


def end_call(st: GatewayState, principal: Principal, lease: Lease, acct: RequestAccount) -> None:
    """Once a proxied call ends (the handler's ``finally``): ``acct.finished``, the key
    charged from the account (``close_lease``), the e2e metric from admission; a stream's
    TTFT (from ``acct.received`` to its first content chunk) and TPOT
    (``RequestAccount.tpot_s``), as local mode observes them; and the gateway's token
    counters from the usage the upstream reported (a count not reported is not counted:
    never a guess)."""
    acct.finished = time.monotonic()
    close_lease(st.shared, principal, lease, acct)
    if acct.admitted is not None:
        st.metrics.e2e.observe(acct.finished - acct.admitted)
    if acct.first_token is not None and acct.received is not None:
        st.metrics.ttft.observe(acct.first_token - acct.received)
    tpot = acct.tpot_s()
    if tpot is not None:
        st.metrics.tpot.observe(tpot)
    if acct.prompt_tokens is not None:
        st.metrics.prompt_tokens.inc(acct.prompt_tokens)
    if acct.completion_tokens is not None:
        st.metrics.add_generated(acct.completion_tokens)
    if acct.cached_tokens is not None:
        st.metrics.cached_tokens.inc(acct.cached_tokens)
