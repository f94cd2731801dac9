"""OpenAI routes served by the local engine: chat completions, completions, models.

The walk of one request: authenticate → parse and validate the body → render and tokenize
the prompt → check lengths → per-key rate limits → admission queue → one engine request per
choice (``n``) → a JSON body, or SSE chunks as tokens come (``exchange.Exchange``, with the route's
renderer: ``renderers.ChatRenderer`` or ``CompletionRenderer``). The engine requests are
aborted when the client disconnects (checked every ``poll_s`` while waiting, and on every
failed write while streaming), so their KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import cachetools
from aiohttp import web
from prefixgate.engine.protocol import EngineRequest
from prefixgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from prefixgate.engine.scheduling_policy import policy_class
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.local.cache_marks import (
    Mark,
    find_marks,
)
from prefixgate.gateway.local.exchange import Exchange
from prefixgate.gateway.local.generation import engine_request
from prefixgate.gateway.local.local_call import open_call
from prefixgate.gateway.local.renderers import ChatRenderer, CompletionRenderer
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal
from prefixgate.gateway.tenancy.pool_hints import pool_hint
from prefixgate.gateway.wire.cache_breakpoints import chat_breakpoints
from prefixgate.gateway.wire.prompts import (
    check_length,
    check_vocab,
    choice_seeds,
    completion_prompts,
    kept_prompt_tokens,
    render_bound,
    render_chat,
    truncated,
)
from prefixgate.gateway.wire.request_fields import (
    check_constraint,
)
from prefixgate.gateway.wire.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    check_chat_body,
    check_completion_body,
    check_template_kwargs,
)
from prefixgate.gateway.wire.response_models import ModelCard, ModelList, dump
from prefixgate.gateway.wire.tools import ToolPlan, plan_tools, template_messages


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    st, engine, principal, req = await open_call(request, ChatCompletionRequest)
    spec, field = check_chat_body(req)  # what the body says on its own: as proxy mode
    messages = template_messages(req.messages)
    if req.prefix_id is not None:
        prefix = await request.app[LOCAL].require_prefixes().lookup(req.prefix_id, principal.salt)
        messages = prefix.messages + messages
    # what needs this server: its tool-call parser, the schemas' grammar, the vocabulary
    plan = plan_tools(
        req.tools, req.tool_choice, req.parallel_tool_calls, st.settings.tool_call_parser
    )
    if spec is not None and plan.structured is not None:  # forced calls: check_chat_body's
        raise bad_request(
            f"{field}: cannot be combined with strict tools under tool_choice 'auto' (their "
            "calls are constrained)",
            param=field,
        )
    if plan.structured is not None:
        spec, field = plan.structured, "tools"
    if spec is not None:
        await _check_constraint(spec, field or "structured_outputs")
    check_vocab(req, engine.tokenizer.vocab_size)
    check_template_kwargs(req.chat_template_kwargs, engine.tokenizer)
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    offset = len(messages) - len(req.messages)  # a prefix_id's messages come first
    keep = kept_prompt_tokens(req.truncate_prompt_tokens, engine.max_model_len)
    ids = await render_chat(
        engine.tokenizer,
        messages,
        req.add_generation_prompt,
        max_model_len=render_bound(keep, engine.max_model_len),
        tools=plan.tools or None,
        template_kwargs=req.chat_template_kwargs,
        continue_final_message=req.continue_final_message,
    )
    ids = truncated(ids, keep)
    max_tokens = check_length(
        len(ids), req.output_limit, engine.max_model_len, "messages", req.output_limit_param
    )
    marks = await find_marks(
        engine.tokenizer,
        chat_breakpoints(req, messages, offset, plan.tools),
        bool(plan.tools),
        ids,
        engine.config.block_size,
        req.chat_template_kwargs,
    )
    rid = "chatcmpl-" + uuid.uuid4().hex
    seeds = choice_seeds(req.seed, req.n)
    # tool-call markers of some formats are special tokens: keep them in the text to parse
    keep_special = plan.mode == "auto"
    requests = [
        _engine_request(
            request,
            principal,
            req,
            f"{rid}-{i}",
            ids,
            req.sampling_params(max_tokens, seeds[i], spec, keep_special),
        )
        for i in range(req.n)
    ]
    return await _run(
        request, st, principal, req, ChatRenderer, rid, requests, tools=plan, cache_marks=marks
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    st, engine, principal, req = await open_call(request, CompletionRequest)
    spec, field = check_completion_body(req)
    if spec is not None:
        await _check_constraint(spec, field or "structured_outputs")
    check_vocab(req, engine.tokenizer.vocab_size)
    keep = kept_prompt_tokens(req.truncate_prompt_tokens, engine.max_model_len)
    bound = render_bound(keep, engine.max_model_len)
    prompts = [
        truncated(ids, keep)
        for ids in await completion_prompts(engine.tokenizer, req.prompt, bound)
    ]
    rid = "cmpl-" + uuid.uuid4().hex
    seeds = choice_seeds(req.seed, req.n)
    requests, prompt_index = [], []
    for p, ids in enumerate(prompts):
        max_tokens = check_length(len(ids), req.output_limit, engine.max_model_len, "prompt")
        for j in range(req.n):
            params = req.sampling_params(max_tokens, seeds[j], spec)
            requests.append(
                _engine_request(request, principal, req, f"{rid}-{p * req.n + j}", ids, params)
            )
            prompt_index.append(p)
    return await _run(
        request, st, principal, req, CompletionRenderer, rid, requests, prompt_index=prompt_index
    )


def _engine_request(
    request: web.Request,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> EngineRequest:
    """One choice's engine request, with the body's ``cache_salt`` and ``priority`` (checked
    against the engine's scheduling policy)."""
    built = engine_request(
        principal,
        request_id,
        prompt,
        params,
        cache_salt=req.cache_salt,
        priority=req.priority,
        hint=pool_hint(request),
    )
    check_priority_policy(
        req.priority, request.app[LOCAL].require_engine().config.scheduling_policy
    )
    return built


async def _run(
    request: web.Request,
    st: GatewayState,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    renderer_type: type[ChatRenderer | CompletionRenderer],
    rid: str,
    requests: list[EngineRequest],
    tools: ToolPlan | None = None,
    cache_marks: list[Mark] | None = None,
    prompt_index: list[int] | None = None,
) -> web.StreamResponse:
    """Run the request's choices through an Exchange with the route's renderer (chat: with
    the request's tool plan and cache breakpoints)."""
    args = (
        rid,
        int(time.time()),
        st.model_name,
        request.app[LOCAL].require_token_texts(),
        req.num_logprobs,
        req.include_usage,
    )
    renderer = (
        ChatRenderer(*args, tools=tools) if renderer_type is ChatRenderer else renderer_type(*args)
    )
    renderer.continuous_usage = req.continuous_usage
    return await Exchange(
        request, st, principal, requests, renderer, req.stream, cache_marks, prompt_index
    ).run()


def check_priority_policy(requested: int | None, policy: str) -> None:
    """A request's own non-zero ``priority`` only orders requests under a policy that reads it
    (``uses_priority``: ``priority``); under any other it would be accepted and do nothing, so
    it is refused (vLLM's rule). ``0``, the no-op value, is always taken.

    Raises:
        APIError: 400 ``priority_not_supported`` naming ``priority``.
    """
    if requested and not policy_class(policy).uses_priority:
        raise APIError(
            400,
            f"priority: this server schedules requests by {policy!r}, where a request priority "
            "has no effect (it needs prefixgate serve --scheduling-policy priority)",
            param="priority",
            code="priority_not_supported",
        )


_VALID_CONSTRAINTS: cachetools.LRUCache[str, bool] = cachetools.LRUCache(1024)


async def _check_constraint(spec: StructuredOutputsParams, field: str) -> None:
    """400 naming ``field`` when the constraint does not compile (grammar conversion in a
    worker thread; valid specs are remembered)."""
    key = spec.key()
    if key in _VALID_CONSTRAINTS:
        return
    await asyncio.to_thread(check_constraint, spec, field)
    _VALID_CONSTRAINTS[key] = True


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: a card per served model id (``--served-model-name``'s)."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    cards = [_model_card(request.app, name) for name in st.served_names()]
    return _json(dump(ModelList(data=cards)))


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the card of that served id."""
    st = request.app[STATE]
    st.keys.authenticate(request)
    model = request.match_info["model"]
    st.check_model(model)
    return _json(dump(_model_card(request.app, model)))


def _model_card(app: web.Application, name: str) -> ModelCard:
    engine = app[LOCAL].engine
    length = engine.max_model_len if engine is not None else None
    return ModelCard(id=name, max_model_len=length)


def _json(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")
