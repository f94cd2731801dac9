"""``RequestAccount``: the gateway's one per-request account, read by everything that reports
on a request (docs/architecture.md, "Accounting").

Held once per HTTP request (``account(request)``, created on first use) and filled by the mode
that serves it: local mode from the engine's outputs (tokens, cached tokens, finish reason) and
its ``Request.metrics`` timeline, read at the seam (``engine_metrics``); proxy mode from the
upstream's reported ``usage`` (``read_usage``: the body's, or the stream's last chunk through
``proxy.usage.UsageTap``) and its answer's ``choices`` (``read_choices``: the finish reason,
and in a stream the first and last content chunk's times). Read by the access line (``http/access_log.py``), the per-key
metrics (``GatewayMetrics.count_key_request``), the key's tenant charge
(``tenancy.shared_state.close_lease``) and the ``usage`` the dialects render (local mode:
``wire.response_models.Usage.of_account``; proxy mode: the upstream's own, which it was read
from). A number not known is ``None``, never 0.

Token counts are OpenAI's (``usage``): ``prompt_tokens`` includes ``cached_tokens``; an
Anthropic answer's ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens`` is
its prompt. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(slots=True)
class RequestAccount:
    """One request's accounting (see the module docstring; ``None``: not known).

    Attributes:
        key_name: the caller's key name (``-`` on an open gateway, ``unnamed``), never the key.
        prompt_tokens, cached_tokens, completion_tokens: the request's usage: counted by the
            engine (local mode) or reported by the upstream (proxy mode, ``usage_reported``).
        estimated_completion_tokens: proxy mode, a stream without usage: one token per content
            chunk seen (what the key is charged; not reported as the usage).
        predicted_cached_tokens: proxy mode, the routing policy's prediction on its upstream.
        received: when the route had the request in hand (parsed; TTFT and e2e start here).
        admitted: past the key's limits and the admission queue.
        first_token: the first generated token reached the handler (proxy mode: the first
            content chunk of the upstream's stream; not known for a whole JSON answer).
        last_token: proxy mode, the last content chunk of the upstream's stream came.
        first_byte: the first content was written to the client.
        finished: the handler ended.
        engine_metrics: local mode, the engine's ``Request.metrics`` timeline of the first
            choice, as its first output carried it.
        walk: local mode, the first token's walk as the access line shows it.
        served: tokens were served (the key is charged them); False: refunded.
        status: the HTTP status answered (499: the client left first).
        finish_reason: the first choice's OpenAI finish reason, when it finished.
        error: the code of the in-band error event a started stream ended with.
        charged_tokens: what the key was charged once the request ended (None: refunded or
            not ended).
        choices: proxy mode, how many choices the answer carried (the highest ``index`` + 1
            seen).
    """

    key_name: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    estimated_completion_tokens: int = 0
    usage_reported: bool = False
    predicted_cached_tokens: int | None = None
    received: float | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    first_byte: float | None = None
    finished: float | None = None
    engine_metrics: dict[str, float] | None = None
    walk: str | None = None
    served: bool = False
    status: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    charged_tokens: int | None = None
    choices: int = 1

    def mark_served(self) -> None:
        """Proxy mode: an upstream's answer began reaching the client (``served``)."""
        self.served = True

    def note_token(self) -> None:
        """Proxy mode: a content chunk of the upstream's stream came (a token or more): the
        first one's time is ``first_token``, the latest one's ``last_token``."""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now

    def read_choices(self, choices: Any, streamed: bool) -> None:
        """Proxy mode: the ``choices`` of an OpenAI answer (a whole body's, or one chunk of a
        stream when ``streamed``): the first choice's (``index`` 0) ``finish_reason``; a chunk
        with content (text or tool call fragments, of any choice) is ``note_token``."""
        if not isinstance(choices, list):
            return
        content = False
        for c in choices:
            if not isinstance(c, dict):
                continue
            index = c.get("index", 0)
            if isinstance(index, int) and not isinstance(index, bool) and index >= self.choices:
                self.choices = index + 1
            reason = c.get("finish_reason")
            if c.get("index", 0) == 0 and isinstance(reason, str):
                self.finish_reason = reason
            if streamed and not content:
                delta = c.get("delta")
                if isinstance(delta, dict):
                    content = bool(delta.get("content")) or bool(delta.get("tool_calls"))
                else:
                    content = bool(c.get("text"))
        if content:
            self.note_token()

    def tpot_s(self) -> float | None:
        """Seconds per output token after the first, in a stream of one choice: (``last_token``
        - ``first_token``) over the completion tokens (reported, else counted) less one; None
        when not known (no stream, one token, or several choices: their tokens are counted
        together and their chunks interleave, so no one choice's pace can be read)."""
        if self.first_token is None or self.last_token is None or self.choices > 1:
            return None
        tokens = self.completion_tokens
        if tokens is None:
            tokens = self.estimated_completion_tokens
        if tokens < 2 or self.last_token <= self.first_token:
            return None
        return (self.last_token - self.first_token) / (tokens - 1)

    def read_usage(self, usage: Any) -> bool:
        """Take an OpenAI ``usage`` object (``prompt_tokens``, ``completion_tokens``,
        ``prompt_tokens_details.cached_tokens``); False, nothing taken, when it is not one."""
        if not isinstance(usage, dict):
            return False
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not (_count(p) and _count(c)):
            return False
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.prompt_tokens, self.completion_tokens = p, c
        self.cached_tokens = cached if _count(cached) else None
        self.usage_reported = True
        return True

    def read_anthropic_usage(self, usage: Any) -> bool:
        """Take an Anthropic ``usage`` object (prompt: ``input_tokens`` plus both cache
        counts; ``output_tokens`` when given; cached: ``cache_read_input_tokens``); False,
        nothing taken, when it is not one."""
        if not isinstance(usage, dict):
            return False
        keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        counts = [usage.get(k) for k in keys]
        out = usage.get("output_tokens")
        if counts[0] is None or not all(c is None or _count(c) for c in counts):
            return False
        self.prompt_tokens = sum(c for c in counts if c is not None)
        if _count(out):  # else not known: the charge counts the stream's output
            self.completion_tokens = out
        cached = counts[2]
        self.cached_tokens = cached if _count(cached) else None
        self.usage_reported = True
        return True

    def charge(self, admitted_prompt_tokens: int) -> tuple[int, int]:
        """``(prompt, completion)`` tokens the key is charged for this request: the usage, the
        prompt at ``admitted_prompt_tokens`` (what admission took: an estimate in proxy mode)
        when not known, the completion at ``estimated_completion_tokens`` when not known."""
        prompt = admitted_prompt_tokens if self.prompt_tokens is None else self.prompt_tokens
        completion = self.completion_tokens
        if completion is None:
            completion = self.estimated_completion_tokens
        return prompt, completion


ACCOUNT = web.RequestKey("prefixgate_account", RequestAccount)


def account(request: web.Request) -> RequestAccount:
    """The request's :class:`RequestAccount`, created on first use."""
    acct = request.get(ACCOUNT)
    if acct is None:
        acct = request[ACCOUNT] = RequestAccount()
    return acct
