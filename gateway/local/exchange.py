"""The ``Exchange``: one admitted HTTP request of any local route (chat, completions,
responses, messages, Gemini), from the key's token buckets and the admission queue to the JSON
body or the SSE stream written by the route's renderer (docs/architecture.md, "One chat
request's walk", step 3); and ``engine_error``, an engine failure before any output as an
error object.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from aiohttp import web
from prefixgate.engine.errors import EngineDeadError
from prefixgate.engine.outputs import CompletionOutput, StepOutput
from prefixgate.engine.protocol import EngineRequest
from prefixgate.gateway.http.access_log import stream_cut
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.lifecycle import end_streams_with
from prefixgate.gateway.http.request_account import account
from prefixgate.gateway.http.sse import KEEPALIVE, SSEWriter, client_gone, client_left
from prefixgate.gateway.local.cache_diagnostics import Comparison, header_part
from prefixgate.gateway.local.cache_marks import (
    CACHE_HEADER,
    Mark,
    cache_header,
    note_states,
    pin_marks,
    written_tokens,
)
from prefixgate.gateway.local.generation import ChoiceRun
from prefixgate.gateway.local.renderers import Renderer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.local.token_walk import first_token_walk
from prefixgate.gateway.state import GatewayState
from prefixgate.gateway.tenancy.keys import Principal
from prefixgate.gateway.tenancy.shared_state import close_lease
from prefixgate.gateway.tenancy.ttft_budget import PREDICTED_TTFT_HEADER, budget_s
from prefixgate.gateway.wire.endings import aborted_error, is_aborted
from prefixgate.gateway.wire.response_models import Usage

logger = logging.getLogger("prefixgate.gateway")

CLIENT_GONE = 499  # nginx's "client closed request": never seen by the client, only in logs


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


def engine_error(exc: Exception) -> APIError:
    """An engine failure before any output, as an OpenAI error: bad input (ValueError,
    TypeError) → 400; the engine shut down (EngineDeadError) → 503; anything else → 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError | TypeError):
        return bad_request(str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, "the engine is shutting down", code="engine_unavailable", retry_after=5.0
        )
    logger.error("engine failed a request: %r", exc)
    return APIError(500, f"generation failed: {type(exc).__name__}", code="engine_error")


ETA_MIN_TOKENS = 8
"""Tokens a choice has before its token rate predicts its end (``Exchange.eta_s``)."""


class Exchange:
    """One admitted HTTP request: runs its choices on the engine and writes the JSON body or
    the SSE stream through its route's renderer.

    Args:
        request: the HTTP request; st: the gateway state; principal: the caller.
        requests: the engine requests, built by the route (``engine_request``): one per
            choice, choice ``i`` is ``requests[i]``; all share one cache salt.
        renderer: the route's ``Renderer`` (chat, completions, responses).
        stream: answer with SSE.
        cache_marks: the prompt's cache breakpoints (``cache_marks.Mark``; one prompt), or
            None: with a list (empty too) the answer has the ``x-prefixgate-cache`` header,
            usage ``cache_write_tokens``, and the marks are pinned once it is answered.
        prompt_index: which prompt of a batched completions request each choice answers
            (None: all answer one prompt).
        comparison: the request's comparison against a named earlier answer
            (``cache_diagnostics.Comparison``): the header adds its ``compare=`` part.
    """

    def __init__(
        self,
        request: web.Request,
        st: GatewayState,
        principal: Principal,
        requests: list[EngineRequest],
        renderer: Renderer,
        stream: bool,
        cache_marks: list[Mark] | None = None,
        prompt_index: list[int] | None = None,
        comparison: Comparison | None = None,
    ) -> None:
        self.comparison = comparison
        self.request = request
        self.cache_marks = cache_marks
        self.st = st
        self.principal = principal
        self.requests = requests
        self.renderer = renderer
        self.salt = requests[0].cache_salt
        prompt = requests[0].prompt
        if isinstance(prompt, str):  # the routes render and tokenize: always token ids
            raise TypeError("Exchange runs tokenized prompts (token ids), not text")
        self.prompt_ids = list(prompt)
        self.stream = stream
        self.prompt_index = prompt_index or [0] * len(requests)
        self.outputs = [CompletionOutput(r.request_id, index=k) for k, r in enumerate(requests)]
        self.t_first_tokens = [0.0] * len(requests)  # monotonic s of each choice's first token
        self.cached: dict[int, int] = {}  # prompt index -> cached tokens (its first choice's)
        prompts = {p: len(r.prompt) for p, r in zip(self.prompt_index, requests, strict=True)}
        self.prompt_tokens = sum(prompts.values())
        self.num_prompts = len(prompts)
        # the request's one account: its usage, times and outcome, as every reader sees them
        self.account = account(request)
        self.account.received = time.monotonic()

    async def run(self) -> web.StreamResponse:
        st = self.st
        budget = budget_s(self.request)  # a malformed header is a 400 before anything is taken
        self.request.app[LOCAL].require_engine()
        lease = await st.shared.acquire(self.principal, self.prompt_tokens)
        if lease.slot_token is not None:  # max_concurrent's Retry-After: when this one ends
            self.principal.slots.set_eta(lease.slot_token, self.eta_s)
        try:
            self.ticket = st.admission.admit(
                self.prompt_tokens,
                len(self.requests),
                param="n" if self.num_prompts == 1 else "prompt",
                tenant=self.principal.tenant,
                weight=self.principal.weight,
                fingerprint=self.fingerprint(),
                budget_s=budget,
                max_tokens=self.max_tokens(),
            )
        except APIError:
            st.shared.refund(self.principal, lease)
            raise
        self.ticket.set_eta(self.eta_s)  # max_running's Retry-After: when this one ends
        acct = self.account
        acct.admitted = time.monotonic()
        st.metrics.prompt_tokens.inc(self.prompt_tokens)
        # kept current as tokens come: a request the shutdown cuts is logged before its
        # handler's cleanup runs, with the usage it had
        acct.prompt_tokens, acct.completion_tokens = self.prompt_tokens, 0
        acct.cached_tokens = 0
        try:
            resp = await (self._stream() if self.stream else self._collect())
            acct.status = resp.status
            if resp.status == 200 and self.cache_marks:
                pin_marks(
                    self.request,
                    self.principal,
                    self.salt,
                    self.prompt_ids,
                    self.cache_marks,
                )
            return resp
        finally:
            self.ticket.done()
            acct.finished = time.monotonic()
            # served: exactly prompt + completion tokens; refused or failed before its first
            # token: spends nothing (the usage is kept current by _record)
            acct.served = bool(acct.completion_tokens)
            acct.finish_reason = self.outputs[0].finish_reason
            close_lease(st.shared, self.principal, lease, acct)
            received = acct.received
            assert received is not None  # set in __init__
            acct.walk = first_token_walk(
                received, acct.admitted, acct.engine_metrics, acct.first_token, acct.first_byte
            )
            if acct.status == 200:
                st.metrics.e2e.observe(acct.finished - received)

    def max_tokens(self) -> int | None:
        """The most output tokens any choice may generate (its ``max_tokens``: the body's, or
        what the context leaves when the body gives none), or None when a choice has no
        bound: admission spaces a budget refusal's slot by this size (``admit``)."""
        caps = [r.sampling_params.max_tokens for r in self.requests]
        if not caps or any(c is None for c in caps):
            return None
        return max(c for c in caps if c is not None)

    def eta_s(self) -> float | None:
        """Predicted seconds until this request ends, from its own progress: each choice's
        tokens left (``max_tokens``, capped by the model length; an earlier stop only shortens
        it) over its measured token rate since its first token. A choice with fewer than
        ``ETA_MIN_TOKENS`` tokens (a rate from two tokens is noise: docs/admission.md) goes by
        the recent generations' seconds per token (``AdmissionController.tpot_s``) instead.
        None when a choice has no ``max_tokens``, or is too young while no rate was measured
        yet."""
        now = time.monotonic()
        left = 0.0
        engine = self.request.app[LOCAL].engine
        room = None if engine is None else engine.max_model_len - len(self.prompt_ids)
        tpot = self.st.admission.tpot_s
        for out, req, t_first in zip(self.outputs, self.requests, self.t_first_tokens, strict=True):
            params = req.sampling_params
            cap = params.max_tokens if params is not None else None
            if cap is not None and room is not None:
                cap = min(cap, room)  # the engine caps prompt + max_tokens at max_model_len
            if cap is None:
                return None
            if out.finish_reason is not None:
                continue
            if out.num_tokens >= ETA_MIN_TOKENS and t_first:
                rate = (out.num_tokens - 1) / max(now - t_first, 1e-6)
                left = max(left, (cap - out.num_tokens) / rate)
            elif tpot > 0:
                left = max(left, (cap - out.num_tokens) * tpot)
            else:
                return None
        return left

    def _predicted_header(self, resp: web.StreamResponse) -> None:
        """``x-prefixgate-predicted-ttft-ms``: the engine's predicted first-token wait at
        admission (milliseconds), when it had one."""
        predicted = self.ticket.predicted_ttft
        if predicted is not None and math.isfinite(predicted):
            resp.headers[PREDICTED_TTFT_HEADER] = f"{predicted * 1000:.0f}"

    def fingerprint(self) -> tuple[str | None, int, int]:
        """What recognises this request when it comes back after a 429 (admission's
        promises): its key, its number of engine requests and a hash of its prompts."""
        prompts: dict[int, tuple[int, ...]] = {}
        for p, r in zip(self.prompt_index, self.requests, strict=True):
            assert not isinstance(r.prompt, str)  # token ids (checked in __init__)
            prompts.setdefault(p, tuple(r.prompt))
        digest = hash(tuple(ids for _, ids in sorted(prompts.items())))
        return self.principal.id, len(self.requests), digest

    def _record(self, i: int, d: StepOutput) -> None:
        """Note one output of choice ``i`` (and the request's metrics)."""
        now = time.monotonic()
        metrics = self.st.metrics
        acct = self.account
        new_tokens = len(d.delta_token_ids)
        if acct.first_token is None and new_tokens:
            acct.first_token = now
            self.ticket.started()
            assert acct.received is not None  # set in __init__
            metrics.ttft.observe(now - acct.received)
            # the engine's own timeline (Request.metrics), read at the seam: this output
            acct.engine_metrics = d.metrics or None
        out = self.outputs[i]
        before = out.num_tokens
        if new_tokens and before == 0:
            self.t_first_tokens[i] = now
        out.add(d)
        metrics.add_generated(new_tokens)
        t_first = self.t_first_tokens[i]
        if before < ETA_MIN_TOKENS <= out.num_tokens and t_first:
            # a measured rate for the requests too young to measure their own (eta_s)
            self.st.admission.note_tpot((now - t_first) / (out.num_tokens - 1))
        self.cached.setdefault(self.prompt_index[i], d.num_cached_tokens)
        acct.completion_tokens = sum(o.num_tokens for o in self.outputs)
        acct.cached_tokens = sum(self.cached.values())
        if d.finished and out.num_tokens > 1:
            metrics.tpot.observe((now - t_first) / (out.num_tokens - 1))

    def _usage(self) -> Usage:
        """The ``usage`` every dialect renders: the account's."""
        usage = Usage.of_account(self.account)
        if self.cache_marks and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
            written = sum(written_tokens(cached, self.cache_marks).values())
            usage.prompt_tokens_details.cache_write_tokens = written
        return usage

    def _cache_header(self, cached: int | None) -> str:
        """The ``x-prefixgate-cache`` value (``cached`` None: not known yet, a stream's)."""
        marks = self.cache_marks or []
        if cached is not None:
            pins = self.request.app[LOCAL].require_cache_pins()
            note_states(marks, cached, pins, self.salt, self.prompt_ids)
        value = cache_header(marks, cached)
        if cached is not None and self.comparison is not None:
            value += "; " + header_part(self.comparison.diagnosis(cached))
        return value

    def _cut_by_abort(self, d: StepOutput | None = None) -> bool:
        """Whether the answer is cut by an aborted choice (``d``'s, else any recorded one's)
        in a dialect that has no finish reason for it (its renderer's ``cut_on_abort``:
        Messages, Gemini, Responses; ``wire.endings``)."""
        if not getattr(self.renderer, "cut_on_abort", False):
            return False
        if d is not None:
            return is_aborted(d.finish_reason)
        return any(is_aborted(o.finish_reason) for o in self.outputs)

    # --- non-streaming --------------------------------------------------------------------
    async def _collect(self) -> web.StreamResponse:
        poll = self.st.settings.poll_s
        async with ChoiceRun(self.request.app[LOCAL].require_engine(), self.requests) as run:
            while run.pending:
                try:
                    ev = await run.next(poll)
                except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
                    raise engine_error(exc) from None
                # checked on every output too: a request whose tokens come faster than
                # ``poll`` must not outlive its client (every wait would end in an output)
                if client_gone(self.request):
                    return web.Response(status=CLIENT_GONE)
                if ev is None:
                    continue
                self._record(*ev)
        if self._cut_by_abort():
            raise aborted_error(upstream=False)
        self.st.metrics.cached_tokens.inc(self.account.cached_tokens or 0)
        resp = _json(self.renderer.json(self.outputs, self._usage()))
        if self.cache_marks is not None:
            resp.headers[CACHE_HEADER] = self._cache_header(self.account.cached_tokens or 0)
        self._predicted_header(resp)
        self.account.first_byte = time.monotonic()  # the body is written next
        return resp

    # --- streaming ------------------------------------------------------------------------
    async def _stream(self) -> web.StreamResponse:
        sse = SSEWriter(self.request, getattr(self.renderer, "keepalive", KEEPALIVE))
        end_streams_with(self.request, self.renderer.error_event)  # the drain's ending
        poll = min(self.st.settings.poll_s, self.st.settings.keepalive_s)
        keepalive = self.st.settings.keepalive_s
        try:
            async with ChoiceRun(self.request.app[LOCAL].require_engine(), self.requests) as run:
                # Errors before the first output (bad input the engine refused) stay HTTP errors.
                first = None
                while run.pending and first is None:
                    try:
                        first = await run.next(poll)
                    except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
                        raise engine_error(exc) from None
                    if first is None:
                        if client_gone(self.request):
                            return web.Response(status=CLIENT_GONE)
                        waited = time.monotonic() - (self.account.received or 0.0)
                        if not sse.response.prepared and waited >= keepalive:
                            await self._open(sse)
                        elif (
                            sse.response.prepared and time.monotonic() - sse.last_write >= keepalive
                        ):
                            await sse.keepalive()
                if not sse.response.prepared:
                    await self._open(sse)
                ev = first
                while True:
                    if ev is not None and self._cut_by_abort(ev[1]):
                        err = aborted_error(upstream=False)
                        stream_cut(self.request, err.code)
                        await sse.write(self.renderer.error_event(err))
                        await sse.response.write_eof()  # no closing events: not a success
                        return sse.response
                    if ev is not None:
                        await self._send(sse, *ev)
                    elif time.monotonic() - sse.last_write >= keepalive:
                        await sse.keepalive()
                    if not run.pending:
                        break
                    if client_gone(self.request):  # ChoiceRun aborts the engine requests
                        return sse.response  # on exit; nothing more to send, no [DONE]
                    try:
                        ev = await run.next(poll)
                    except Exception as exc:  # noqa: BLE001 - reported in-band, then closed
                        err = APIError(500, f"generation failed: {type(exc).__name__}")
                        stream_cut(self.request, err.code)
                        await sse.write(self.renderer.error_event(err))
                        # the error is the stream's last event: no closing events after it
                        # (they would end a cut stream as a success: [DONE], message_stop)
                        await sse.response.write_eof()
                        return sse.response
            self.st.metrics.cached_tokens.inc(self.account.cached_tokens or 0)
            for event in self.renderer.closing(self.outputs, self._usage()):
                await sse.write(event)
            await sse.response.write_eof()
        except ConnectionResetError:  # ChoiceRun aborted the engine requests on exit
            return client_left(sse.response)
        return sse.response

    async def _open(self, sse: SSEWriter) -> None:
        """Send the headers and the renderer's opening chunks (chat: each choice's role)."""
        if self.cache_marks is not None:
            sse.response.headers[CACHE_HEADER] = self._cache_header(None)
        self._predicted_header(sse.response)
        await sse.open()
        for chunk in self.renderer.opening(len(self.requests)):
            await sse.write(self.renderer.event(self._with_usage(chunk)))

    def _with_usage(self, chunk: Any) -> Any:
        """``chunk`` with the request's usage so far (prompt tokens, the completion tokens of
        all its choices until now) when the renderer's ``continuous_usage`` asks for it
        (vLLM's ``continuous_usage_stats``); else as it is."""
        if getattr(self.renderer, "continuous_usage", False):
            chunk.usage = self._usage()
        return chunk

    async def _send(self, sse: SSEWriter, i: int, d: StepOutput) -> None:
        offset = self.outputs[i].num_chars
        self._record(i, d)
        for chunk in self.renderer.chunks(i, d, offset):
            await sse.write(self.renderer.event(self._with_usage(chunk)))
        if self.account.first_byte is None and self.account.first_token is not None:
            self.account.first_byte = time.monotonic()
