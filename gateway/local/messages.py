"""POST /v1/messages and /v1/messages/count_tokens (local mode): Anthropic's Messages API.

A Messages request is a chat in another shape (``anthropic_models.to_chat``): it is rendered
with the chat template into the same token ids as the equivalent chat completion and runs
through the same ``Exchange`` (rate limits, admission, disconnect → abort, metrics, access
log) with a renderer of its own (``MessagesRenderer``): a ``message`` object, or the event
stream the ``anthropic`` package parses (``message_start``, ``ping``, then per content block
``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
``content_block_stop``, then ``message_delta`` (stop reason, cumulative usage) and
``message_stop``). Errors take Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}`` (``errors.error_dialect``), in-stream as an ``error`` event.

Cache breakpoints (``cache_control``) become engine pins (``local/cache_pins.py``): each
breakpoint's position in the prompt is the tokens the prompt shares with the conversation
cut right after the marked block (rendered without a generation prompt), in whole KV
blocks. Usage: ``cache_read_input_tokens`` = prompt tokens served from the prefix cache,
``cache_creation_input_tokens`` = tokens up to the last breakpoint this request computed
(written to the cache, then pinned), ``input_tokens`` the rest: the three sum to the prompt
exactly (``cache_creation`` splits the written tokens by the TTL of the breakpoint they fall
under). The ``x-prefixgate-cache`` header says where each breakpoint fell and whether it hit
(``cache_marks.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from prefixgate.engine.outputs import CompletionOutput, StepOutput
from prefixgate.gateway.http.errors import ANTHROPIC, APIError, error_dialect
from prefixgate.gateway.local.cache_diagnostics import PROMPT_LOG, Comparison, anthropic_reason
from prefixgate.gateway.local.cache_marks import Mark, find_marks, written_tokens
from prefixgate.gateway.local.generation import engine_request
from prefixgate.gateway.local.local_call import counted_prompt, translated_prompt
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.local.tokenize import counting
from prefixgate.gateway.state import STATE
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.tenancy.pool_hints import pool_hint
from prefixgate.gateway.wire.anthropic_events import (
    MessageEvents,
    content_blocks,
    error_event,
    message,
    message_json,
    stop_reason,
    tool_input,
)
from prefixgate.gateway.wire.anthropic_models import (
    Chat,
    CountTokensRequest,
    MessagesRequest,
    output_constraint,
    parse_request,
    to_chat,
)
from prefixgate.gateway.wire.client_fields import ClientFields, anthropic_fields
from prefixgate.gateway.wire.prompts import check_length
from prefixgate.gateway.wire.response_models import Usage
from prefixgate.gateway.wire.stop_strings import refuse_stop_under_constraint
from prefixgate.gateway.wire.tools import (
    ANTHROPIC_CHOICE,
    ToolDeltas,
    ToolPlan,
    parse_output,
)


def anthropic_usage(
    prompt_tokens: int, cached: int, output_tokens: int, marks: Sequence[Mark]
) -> dict[str, Any]:
    """Anthropic's ``usage`` of a prompt of ``prompt_tokens`` with ``cached`` of them read
    from the prefix cache: written = the breakpoints' tokens past the cached ones (split by
    the TTL each falls under), ``input_tokens`` the rest; read + written + input ==
    ``prompt_tokens``."""
    by_ttl = written_tokens(cached, marks)
    written = sum(by_ttl.values())
    return {
        "input_tokens": prompt_tokens - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "cache_creation": {
            "ephemeral_5m_input_tokens": written - by_ttl.get(3600.0, 0),
            "ephemeral_1h_input_tokens": by_ttl.get(3600.0, 0),
        },
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesRenderer:
    """Engine outputs → a ``message`` object, or its stream events (one choice), built by
    ``wire.anthropic_events`` (the builder proxy mode shares).

    The same methods as the other renderers (``opening``, ``chunks``, ``event``, ``json``,
    ``closing``, ``error_event``), so ``Exchange`` runs it unchanged. ``message_start`` is
    sent with the first output, when the prompt's cached tokens are known, so its usage is
    exact; ``message_delta`` repeats the cumulative usage.
    """

    route = "messages"
    include_usage = True
    cut_on_abort = True  # an aborted answer ends with an error (wire.endings)

    def __init__(
        self,
        rid: str,
        model: str,
        prompt_tokens: int,
        plan: ToolPlan,
        marks: list[Mark],
        diagnose: Callable[[int], dict[str, Any] | None] | None = None,
    ) -> None:
        self.diagnose = diagnose  # cached tokens -> cache_miss_reason (diagnostics asked)
        self.rid = rid
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.tools = plan if plan.active else None
        self.marks = marks
        self._events = MessageEvents(rid, model)
        self._deltas = ToolDeltas(plan) if self.tools is not None else None
        self._called = False

    def _extra(self, usage: dict[str, Any]) -> dict[str, Any] | None:
        if self.diagnose is None:
            return None
        return {
            "diagnostics": {"cache_miss_reason": self.diagnose(usage["cache_read_input_tokens"])}
        }

    def _usage(self, usage: Usage) -> dict[str, Any]:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return anthropic_usage(self.prompt_tokens, cached, usage.completion_tokens, self.marks)

    @staticmethod
    def _stop(o: CompletionOutput, called: bool) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` of a finished choice (the engine's
        ``stop_reason`` is the stop string that ended it, or a stop token's id)."""
        sequence = o.stop_reason if isinstance(o.stop_reason, str) else None
        return stop_reason(o.finish_reason, called, sequence)

    def json(self, outputs: list[CompletionOutput], usage: Usage) -> bytes:
        """The whole ``message`` of the finished choice, as JSON bytes."""
        o = outputs[0]
        content, calls = (o.text, []) if self.tools is None else parse_output(self.tools, o.text)
        blocks = content_blocks(
            content, [(_tool_use_id(c.id), c.name, tool_input(c.arguments)) for c in calls]
        )
        full = self._usage(usage)
        body = message(
            self.rid, self.model, blocks, self._stop(o, bool(calls)), full, self._extra(full)
        )
        return message_json(body)

    # --- stream ---------------------------------------------------------------------------
    def event(self, chunk: bytes) -> bytes:
        """Chunks are already framed events."""
        return chunk

    def opening(self, n: int) -> list[bytes]:
        """Nothing: ``message_start`` waits for the first output (its usage is exact)."""
        return []

    def _start(self, cached: int) -> list[bytes]:
        usage = anthropic_usage(self.prompt_tokens, cached, 0, self.marks)
        return self._events.start(usage, self._extra(usage))

    def _translate(self, delta: dict[str, Any]) -> list[bytes]:
        ev = self._events
        out: list[bytes] = []
        text = delta.get("content")
        if text:
            out += ev.text(text)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                self._called = True
                out += ev.tool_use(_tool_use_id(call["id"]), fn.get("name", ""))
            args = fn.get("arguments") or ""
            if args and ev.open_kind == "tool_use":
                out.append(ev.input_json(ev.index, args))
        return out

    def chunks(self, i: int, d: StepOutput, offset: int) -> list[bytes]:
        """The events of the choice's new output (``message_start`` first)."""
        out = [] if self._events.started else self._start(d.num_cached_tokens)
        if self._deltas is None:
            deltas = [{"content": d.delta_text}] if d.delta_text else []
        else:
            deltas = self._deltas.feed(d.delta_text) if d.delta_text else []
            if d.finished:
                deltas += self._deltas.finish()
        for delta in deltas:
            out += self._translate(delta)
        return out

    def closing(self, outputs: list[CompletionOutput], usage: Usage) -> list[bytes]:
        """The last block's stop, ``message_delta`` (stop reason, usage) and ``message_stop``."""
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out = [] if self._events.started else self._start(cached)
        stop = self._stop(outputs[0], self._called)
        return out + self._events.finish(stop, self._usage(usage))

    def error_event(self, err: APIError) -> bytes:
        """The in-band ``error`` event that ends a stream cut short (Anthropic's shape)."""
        return error_event(err)


def _opened(
    request: web.Request, kind: type[MessagesRequest] | type[CountTokensRequest], body: bytes
) -> tuple[Principal, Any, Chat, ClientFields]:
    """Authenticate, parse ``body`` as ``kind``, check the model and translate the chat (its
    refusals name the Messages fields: the returned ``ClientFields``)."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    req = parse_request(kind, body)
    st.check_model(req.model)
    chat = to_chat(req)
    return principal, req, chat, anthropic_fields(chat.origins, len(chat.tools), "")


async def _prepare(
    request: web.Request, kind: type[MessagesRequest]
) -> tuple[Principal, Any, Chat, ToolPlan, list[int]]:
    """Authenticate, parse, check the model, plan the tools and render the prompt. The chat's
    refusals (rendering, tool turns, tool plan) name the Messages fields
    (``client_fields.in_client_words``), as the proxy's relay names an upstream's."""
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal, req, chat, fields = _opened(request, kind, await request.read())
    plan, ids = await translated_prompt(
        st, engine, chat, chat.parallel_tool_calls, ANTHROPIC_CHOICE, fields
    )
    return principal, req, chat, plan, ids


@error_dialect(ANTHROPIC)
async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens → ``{"input_tokens": N}``: the prompt's tokens, as a
    ``messages`` request's usage counts them (input + cache creation + cache read); a prompt
    past the context is counted too, under ``/tokenize``'s bound (``tokenize.counting``). Tools
    under ``tool_choice`` auto are counted on a server without ``--tool-call-parser`` too
    (``local_call.counted_prompt``: only a generated answer is parsed)."""
    engine = request.app[LOCAL].require_engine()
    _, _, chat, fields = _opened(request, CountTokensRequest, await request.read())
    with counting("count_tokens", engine.max_model_len) as bound:
        ids = await counted_prompt(engine, chat, ANTHROPIC_CHOICE, fields, bound)
    return web.json_response({"input_tokens": len(ids)})


@error_dialect(ANTHROPIC)
async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    from prefixgate.gateway.local.exchange import Exchange
    from prefixgate.gateway.local.openai_routes import _check_constraint

    st = request.app[STATE]
    local = request.app[LOCAL]
    engine = local.require_engine()
    principal, req, chat, plan, ids = await _prepare(request, MessagesRequest)
    forced = "tool_choice" if plan.mode in ("required", "named") else None
    schema, schema_field = output_constraint(req, chat)
    # what the body says on its own before what needs the served model (the schema's
    # grammar), as proxy mode, whose upstream checks that
    refuse_stop_under_constraint(
        req.stop_sequences, "stop_sequences", forced or (schema_field or None)
    )
    if schema is not None:
        await _check_constraint(schema, f"{schema_field}.schema")
    if plan.structured is not None:
        await _check_constraint(plan.structured, "tools")
    max_tokens = check_length(len(ids), req.max_tokens, engine.max_model_len, "messages")
    marks = await find_marks(
        engine.tokenizer, chat.breakpoints, bool(plan.tools), ids, engine.config.block_size
    )
    params = req.sampling_params(max_tokens, plan.structured or schema, plan.mode != "auto")
    rid = "msg_" + uuid.uuid4().hex[:24]
    salt = effective_salt(principal.salt, req.cache_salt)
    log = request.app[PROMPT_LOG]
    wanted = req.diagnostics.previous_message_id if req.diagnostics is not None else None
    previous = log.find(wanted) if wanted else None
    current = log.add(rid, salt, ids, chat.messages, plan.tools, principal.id)
    comparison = diagnose = None
    if req.diagnostics is not None:
        comparison = Comparison(previous, current, engine.config.block_size) if wanted else None

        def diagnose(cached: int) -> dict[str, Any] | None:
            return anthropic_reason(comparison.diagnosis(cached)) if comparison else None

    renderer = MessagesRenderer(rid, st.model_name, len(ids), plan, marks, diagnose)
    requests = [
        engine_request(
            principal, rid, ids, params, cache_salt=req.cache_salt, hint=pool_hint(request)
        )
    ]
    return await Exchange(
        request, st, principal, requests, renderer, req.stream, marks, comparison=comparison
    ).run()
