"""OpenAI routes served by the local engine: chat completions, completions, models.

The walk of one request: authenticate → parse and validate the body → render and tokenize
the prompt → check lengths → per-key rate limits → admission queue → one engine request per
choice (``n``) → a JSON body, or SSE chunks as tokens come. The engine requests are aborted
when the client disconnects (checked every ``poll_s`` while waiting, and on every failed
write while streaming), so their KV blocks are freed at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prefixgate.engine.errors import EngineDeadError
from prefixgate.gateway import responses as R
from prefixgate.gateway.admission import Ticket
from prefixgate.gateway.auth import effective_salt
from prefixgate.gateway.errors import APIError, bad_request
from prefixgate.gateway.generation import Choice, ChoiceRun, Delta
from prefixgate.gateway.prompts import (
    check_length,
    choice_seeds,
    completion_prompts,
    render_chat,
    sampling_params,
)
from prefixgate.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.streaming import SSEWriter, client_gone

logger = logging.getLogger("prefixgate.gateway")

CLIENT_GONE = 499  # nginx's "client closed request": never seen by the client, only in logs


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    st = request.app[STATE]
    engine = st.require_engine()
    principal = st.keys.authenticate(request)
    req = parse(ChatCompletionRequest, await request.read())
    st.check_model(req.model)
    messages = [m.as_dict() for m in req.messages]
    if req.prefix_id is not None:
        messages = st.require_prefixes().get(req.prefix_id, principal.salt).messages + messages
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    ids = await render_chat(engine.tokenizer, messages)
    max_tokens = check_length(len(ids), req.output_limit, engine.max_model_len, "messages")
    rid = "chatcmpl-" + uuid.uuid4().hex
    seeds = choice_seeds(req.seed, req.n)
    choices = [
        Choice(i, f"{rid}-{i}", ids, sampling_params(req, max_tokens, seeds[i]))
        for i in range(req.n)
    ]
    return await _Exchange(request, st, principal, req, rid, choices, chat=True).run()


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    st = request.app[STATE]
    engine = st.require_engine()
    principal = st.keys.authenticate(request)
    req = parse(CompletionRequest, await request.read())
    st.check_model(req.model)
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    prompts = await completion_prompts(engine.tokenizer, req.prompt)
    rid = "cmpl-" + uuid.uuid4().hex
    seeds = choice_seeds(req.seed, req.n)
    choices = []
    for p, ids in enumerate(prompts):
        max_tokens = check_length(len(ids), req.output_limit, engine.max_model_len, "prompt")
        for j in range(req.n):
            index = p * req.n + j
            choices.append(
                Choice(
                    index,
                    f"{rid}-{index}",
                    ids,
                    sampling_params(req, max_tokens, seeds[j]),
                    prompt_index=p,
                )
            )
    return await _Exchange(request, st, principal, req, rid, choices, chat=False).run()


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    return web.json_response({"object": "list", "data": [_model_card(st)]})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    st.check_model(request.match_info["model"])
    return web.json_response(_model_card(st))


def _model_card(st: GatewayState) -> dict[str, Any]:
    card = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "prefixgate"}
    if st.engine is not None:
        card["max_model_len"] = st.engine.max_model_len
    return card


def engine_error(exc: Exception) -> APIError:
    """An engine failure before any output, as an OpenAI error: bad input (ValueError,
    TypeError) → 400; the engine shut down (EngineDeadError) → 503; anything else → 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError | TypeError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, "the engine is shutting down", code="engine_unavailable", retry_after=5.0
        )
    logger.error("engine failed a request: %r", exc)
    return APIError(500, f"generation failed: {type(exc).__name__}", code="engine_error")


class _Exchange:
    """One admitted request: runs its choices and writes the JSON body or the SSE stream."""

    def __init__(
        self,
        request: web.Request,
        st: GatewayState,
        principal: Any,
        req: Any,
        rid: str,
        choices: list[Choice],
        chat: bool,
    ) -> None:
        self.request = request
        self.st = st
        self.principal = principal
        self.req = req
        self.rid = rid
        self.choices = choices
        self.chat = chat
        self.salt = effective_salt(principal.salt, req.cache_salt)
        self.created = int(time.time())
        self.model = st.model_name
        self.engine = st.require_engine()
        assert st.token_texts is not None  # set with the engine
        self.token_text = st.token_texts
        n = len(choices)
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.num_tokens = [0] * n
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.cached: dict[int, int] = {}  # prompt index -> cached tokens (its first choice's)
        prompts = {c.prompt_index: len(c.prompt_token_ids) for c in choices}
        self.prompt_tokens = sum(prompts.values())
        self.num_prompts = len(prompts)
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.t_first_choice = [0.0] * n
        self.ticket: Ticket | None = None

    async def run(self) -> web.StreamResponse:
        st = self.st
        self.principal.acquire(self.prompt_tokens)
        try:
            ticket = self.ticket = st.admission.admit(
                self.prompt_tokens,
                len(self.choices),
                param="n" if self.num_prompts == 1 else "prompt",
            )
        except APIError:
            self.principal.release(0)
            raise
        st.metrics.prompt_tokens.inc(self.prompt_tokens)
        route = "chat" if self.chat else "completions"
        status = "error"
        try:
            if self.req.stream:
                resp = await self._stream()
            else:
                resp = await self._collect()
            status = str(resp.status)
            return resp
        finally:
            ticket.done()
            completion = sum(self.num_tokens)
            self.principal.release(completion)
            st.metrics.requests.labels(route, status).inc()
            if status == "200":
                st.metrics.e2e.observe(time.monotonic() - self.t0)

    # --- bookkeeping ----------------------------------------------------------------------
    def _record(self, i: int, d: Delta) -> None:
        """Note one output of choice ``i``."""
        now = time.monotonic()
        if self.t_first is None and d.new_tokens:
            self.t_first = now
            if self.ticket is not None:
                self.ticket.started()
            self.st.metrics.ttft.observe(now - self.t0)
        if d.new_tokens and self.num_tokens[i] == 0:
            self.t_first_choice[i] = now
        self.num_tokens[i] = d.num_tokens
        self.st.metrics.add_generated(d.new_tokens)
        if d.logprobs is not None:
            self.logprobs[i].extend(d.logprobs)
        p = self.choices[i].prompt_index
        if p not in self.cached:
            self.cached[p] = d.num_cached_tokens
        self.text[i] = d.text
        if d.finished:
            self.finish[i] = d.finish_reason
            if d.num_tokens > 1:
                self.st.metrics.tpot.observe((now - self.t_first_choice[i]) / (d.num_tokens - 1))

    def _usage(self) -> dict[str, Any]:
        return R.usage(self.prompt_tokens, sum(self.num_tokens), sum(self.cached.values()))

    def _logprobs(self, entries: list | None, offset: int = 0) -> dict | None:
        if entries is None or self.req.num_logprobs is None:
            return None
        if self.chat:
            return R.chat_logprobs(self.token_text, entries)
        return R.completion_logprobs(self.token_text, entries, offset)

    # --- non-streaming --------------------------------------------------------------------
    async def _collect(self) -> web.StreamResponse:
        poll = self.st.settings.poll_s
        async with ChoiceRun(self.engine, self.choices, self.salt) as run:
            while run.pending:
                try:
                    ev = await run.next(poll)
                except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
                    raise engine_error(exc) from None
                if ev is None:
                    if client_gone(self.request):
                        return web.Response(status=CLIENT_GONE)
                    continue
                self._record(*ev)
        self.st.metrics.cached_tokens.inc(sum(self.cached.values()))
        if self.chat:
            choices = [
                R.chat_choice(i, self.text[i], self.finish[i], self._logprobs(self.logprobs[i]))
                for i in range(len(self.choices))
            ]
            body = R.chat_completion(self.rid, self.created, self.model, choices, self._usage())
        else:
            choices = [
                R.completion_choice(
                    i, self.text[i], self.finish[i], self._logprobs(self.logprobs[i])
                )
                for i in range(len(self.choices))
            ]
            body = R.completion(self.rid, self.created, self.model, choices, self._usage())
        return web.json_response(body)

    # --- streaming ------------------------------------------------------------------------
    async def _stream(self) -> web.StreamResponse:
        sse = SSEWriter(self.request)
        poll = min(self.st.settings.poll_s, self.st.settings.keepalive_s)
        keepalive = self.st.settings.keepalive_s
        with_usage = self.req.include_usage
        try:
            async with ChoiceRun(self.engine, self.choices, self.salt) as run:
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
                        if not sse.response.prepared and time.monotonic() - self.t0 >= keepalive:
                            await self._open(sse, with_usage)
                        elif (
                            sse.response.prepared and time.monotonic() - sse.last_write >= keepalive
                        ):
                            await sse.keepalive()
                if not sse.response.prepared:
                    await self._open(sse, with_usage)
                ev = first
                while True:
                    if ev is not None:
                        await self._send_delta(sse, *ev, with_usage)
                    elif time.monotonic() - sse.last_write >= keepalive:
                        await sse.keepalive()
                    if not run.pending:
                        break
                    try:
                        ev = await run.next(poll)
                    except Exception as exc:  # noqa: BLE001 - reported in-band, then [DONE]
                        await sse.send(
                            APIError(500, f"generation failed: {type(exc).__name__}").body()
                        )
                        break
            self.st.metrics.cached_tokens.inc(sum(self.cached.values()))
            if with_usage:
                obj = "chat.completion.chunk" if self.chat else "text_completion"
                await sse.send(
                    R.usage_chunk(self.rid, self.created, self.model, obj, self._usage())
                )
            await sse.done()
        except ConnectionResetError:
            pass  # client gone mid-stream: ChoiceRun aborted the engine requests on exit
        return sse.response

    async def _open(self, sse: SSEWriter, with_usage: bool) -> None:
        """Send the headers and, for chat, each choice's role chunk."""
        await sse.open()
        if self.chat:
            for i in range(len(self.choices)):
                await sse.send(
                    R.chat_chunk(
                        self.rid,
                        self.created,
                        self.model,
                        i,
                        {"role": "assistant", "content": ""},
                        with_usage=with_usage,
                    )
                )

    async def _send_delta(self, sse: SSEWriter, i: int, d: Delta, with_usage: bool) -> None:
        offset = len(self.text[i])
        self._record(i, d)
        logprobs = self._logprobs(d.logprobs, offset) if d.logprobs else None
        finish = d.finish_reason
        if not d.delta_text and logprobs is None and finish is None:
            return  # nothing visible yet (a held-back stop-string prefix or partial UTF-8)
        if self.chat:
            delta = {"content": d.delta_text} if d.delta_text or finish is None else {}
            chunk = R.chat_chunk(
                self.rid,
                self.created,
                self.model,
                i,
                delta,
                finish,
                logprobs,
                with_usage=with_usage,
            )
        else:
            chunk = R.completion_chunk(
                self.rid,
                self.created,
                self.model,
                R.completion_choice(i, d.delta_text, finish, logprobs),
                with_usage=with_usage,
            )
        await sse.send(chunk)
