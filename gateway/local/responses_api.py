"""POST /v1/responses (local mode): OpenAI's Responses API over the chat pipeline.

A Responses request is a chat request in another shape: ``instructions`` becomes the system
message (so a shared system prompt rides the prefix cache as it does for chat), ``input`` (a
string, or a list of message items) the following turns. It runs through the same ``Exchange``
as chat completions (admission, rate limits, disconnect → abort, metrics, access log) with a
renderer of its own (``ResponsesRenderer``) that writes a ``response`` object, or the typed
stream events of the API reference (https://platform.openai.com/docs/api-reference/responses
-streaming): ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` …, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``
(or ``response.incomplete`` when ``max_output_tokens`` cut it), each with a
``sequence_number``. The stream has no ``[DONE]``, as OpenAI's. The request's model and the answer's shapes are
``wire/responses_models.py``'s, shared with the proxy's relay (``proxy/responses_relay.py``).

Prompt caching takes the chat's controls (``local/cache_marks.py``): ``prompt_cache_key``
(accepted with no effect: every prompt is prefix-cached already), ``prompt_cache_options``
(``mode`` implicit / explicit, ``ttl`` 30m / 12h; ``prewarm`` only false),
``prompt_cache_retention`` (``24h`` pins the input for a day) and ``prompt_cache_breakpoint``
(or ``cache_control``) on ``input_text`` parts; usage carries
``input_tokens_details.cache_write_tokens`` and the answer the ``x-prefixgate-cache`` header.
``prompt_cache_options.comparison_response_id`` names an earlier response: the answer's
``prompt_cache_diagnostics`` (OpenAI's shape: ``cache_hit``, ``cache_miss`` with its reason,
``cache_missed_tokens`` and ``comparison_reusable_tokens``, ``comparison_response_not_found``,
``unavailable``) says what was reused (``local/cache_diagnostics.py``, shared with Messages).

What is not implemented is refused by name (400), never ignored: stored responses
(``store: true``, ``previous_response_id``, ``conversation``), tools, reasoning, images/files
in the input, ``include``, ``background``, logprobs. ``text.format`` takes ``text``,
``json_object`` and ``json_schema`` (enforced by the grammar path, as chat's
``response_format``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web
from prefixgate.engine.outputs import CompletionOutput, StepOutput
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.local.cache_diagnostics import PROMPT_LOG, Comparison, openai_diagnostics
from prefixgate.gateway.local.cache_marks import (
    Mark,
    find_marks,
    written_tokens,
)
from prefixgate.gateway.local.generation import engine_request
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.pool_hints import pool_hint
from prefixgate.gateway.wire.cache_breakpoints import openai_breakpoints
from prefixgate.gateway.wire.prompts import check_length, render_chat
from prefixgate.gateway.wire.response_models import Usage
from prefixgate.gateway.wire.responses_models import (
    ResponseEvents,
    ResponsesRequest,
    parse_request,
    ttl_field,
    usage_object,
)

__all__ = ["ResponsesRenderer", "ResponsesRequest", "create_response", "parse_request"]


class ResponsesRenderer:
    """Engine outputs → a ``response`` object, or its stream events (one choice), written by
    ``wire.responses_models.ResponseEvents`` (the proxy's relay writes the same).

    Same methods as the chat and completions renderers (``opening``, ``chunk``, ``body``,
    ``event``, ``closing``), so ``Exchange`` runs it unchanged.
    """

    cut_on_abort = True  # an aborted answer ends with an error (wire.endings)
    route = "responses"
    include_usage = True

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        req: ResponsesRequest,
        marks: list[Mark] | None = None,
        comparison: Comparison | None = None,
    ) -> None:
        self.comparison = comparison  # prompt_cache_options.comparison_response_id asked
        self.marks = marks or []
        self.events = ResponseEvents(rid, created, model, req)

    def _usage(self, usage: Usage) -> dict[str, Any]:
        return _usage(usage, self.marks)

    def _diagnostics(self, usage: Usage) -> dict[str, Any] | None:
        """``prompt_cache_diagnostics`` (None: not asked)."""
        if self.comparison is None:
            return None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return openai_diagnostics(self.comparison.diagnosis(cached))

    def json(self, outputs: list[CompletionOutput], usage: Usage) -> bytes:
        """The whole ``response`` of the finished choice, as JSON bytes."""
        o = outputs[0]
        body = self.events.response(
            "completed", o.text, self._usage(usage), o.finish_reason, self._diagnostics(usage)
        )
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def event(self, chunk: bytes) -> bytes:
        """Chunks are already framed events."""
        return chunk

    def opening(self, n: int) -> list[bytes]:
        """``response.created`` … ``response.content_part.added``."""
        return self.events.opening()

    def chunks(self, i: int, d: StepOutput, offset: int) -> list[bytes]:
        """``response.output_text.delta`` of the new text (none when nothing is new)."""
        if not d.delta_text:
            return []
        return [self.events.delta(d.delta_text)]

    def closing(self, outputs: list[CompletionOutput], usage: Usage) -> list[bytes]:
        """``response.output_text.done`` … ``response.completed`` (or ``.incomplete``)."""
        o = outputs[0]
        return self.events.closing(
            o.text, self._usage(usage), o.finish_reason, self._diagnostics(usage)
        )

    def error_event(self, err: APIError) -> bytes:
        """The ending of a stream cut short (``ResponseEvents.failed``: ``error``, then
        ``response.failed``)."""
        return self.events.failed(err)


def _usage(u: Usage, marks: list[Mark]) -> dict[str, Any]:
    """The Responses ``usage``: ``input_tokens_details.cached_tokens`` read from the prefix
    cache, ``cache_write_tokens`` written at the breakpoints, split in
    ``cache_write_tokens_details`` by the TTL each token was written with (``ttl_field``;
    ``ttl_30m_tokens`` and ``ttl_12h_tokens`` always, another TTL's field when it wrote), so
    read + written + the uncached rest == ``input_tokens``."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    by_ttl = written_tokens(cached, marks)
    split: dict[str, int] | None = None
    if marks:
        split = {"ttl_12h_tokens": 0, "ttl_30m_tokens": 0}
        for ttl_s, n in by_ttl.items():
            key = ttl_field(ttl_s)
            split[key] = split.get(key, 0) + n
    return usage_object(u.prompt_tokens, u.completion_tokens, cached, sum(by_ttl.values()), split)


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    from prefixgate.gateway.local.exchange import Exchange

    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    req = parse_request(await request.read())
    st.check_model(req.model)
    messages = req.messages()
    if not messages or (isinstance(req.input, list) and not req.input):
        raise bad_request("input must hold at least one message", param="input")
    try:
        ids = await render_chat(engine.tokenizer, messages, max_model_len=engine.max_model_len)
    except APIError as exc:  # the chat's words: the conversation is the request's input
        if exc.param == "messages":
            exc.param = "input"
        raise
    max_tokens = check_length(
        len(ids), req.max_output_tokens, engine.max_model_len, "input", "max_output_tokens"
    )
    rid = "resp_" + uuid.uuid4().hex
    structured = req.output_constraint()
    if structured is not None:
        from prefixgate.gateway.local.openai_routes import _check_constraint

        fmt = "text.format.schema" if structured.json is not None else "text.format"
        await _check_constraint(structured, fmt)
    params = req.sampling_params(max_tokens, structured)
    offset = 1 if req.instructions else 0
    breakpoints = openai_breakpoints(
        req.input if isinstance(req.input, list) else [],
        req.prompt_cache_options,
        req.prompt_cache_retention,
        messages,
        offset,
        [],
        field="input",
    )
    marks = await find_marks(engine.tokenizer, breakpoints, False, ids, engine.config.block_size)
    requests = [
        engine_request(
            principal,
            f"{rid}-0",
            ids,
            params,
            cache_salt=req.cache_salt,
            hint=pool_hint(request),
        )
    ]
    salt = requests[0].cache_salt
    log = request.app[PROMPT_LOG]
    options = req.prompt_cache_options
    wanted = options.comparison_response_id if options is not None else None
    previous = log.find(wanted) if wanted else None
    current = log.add(rid, salt, ids, messages, [], principal.id)
    comparison = Comparison(previous, current, engine.config.block_size) if wanted else None
    renderer = ResponsesRenderer(rid, int(time.time()), st.model_name, req, marks, comparison)
    return await Exchange(
        request, st, principal, requests, renderer, req.stream, marks, comparison=comparison
    ).run()
