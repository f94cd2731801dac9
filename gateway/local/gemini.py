"""Gemini's API (``/v1beta``, local mode): generateContent, streamGenerateContent, countTokens,
models, and ``cachedContents`` on the prefix pins.

A ``generateContent`` request is a chat in another shape (``gemini_models.to_chat``): it is
rendered with the chat template into the same token ids as the equivalent chat completion and
runs through the same ``Exchange`` (rate limits, admission, disconnect → abort, metrics,
access log) with a renderer of its own (``GeminiRenderer``): a ``GenerateContentResponse``
(``candidates``, ``usageMetadata``, ``modelVersion``, ``responseId``), or with
``:streamGenerateContent?alt=sse`` one ``data: {GenerateContentResponse}`` event per piece of
text, the last with each candidate's ``finishReason`` and the whole ``usageMetadata``. Errors
take Gemini's shape, ``{"error": {"code", "message", "status"}}`` (``errors.GEMINI``), in a
stream as a last ``data: {"error": ...}`` event (``google-genai`` raises it).

Usage: ``promptTokenCount`` the prompt's tokens, ``cachedContentTokenCount`` those of them
served from the prefix cache (a named cache's pinned blocks, or any earlier request's:
implicit caching), ``candidatesTokenCount`` the generated tokens of every candidate,
``totalTokenCount`` prompt + candidates. Finish reasons: ``STOP`` (end of turn, a stop
sequence, a function call), ``MAX_TOKENS``, ``OTHER`` (any other); an answer the engine
aborted is an error, not a finish reason (``wire.endings``).

``cachedContents`` are prefixes of the prefix API (``local/prefixes.py``): a cache's
``systemInstruction`` + ``contents`` (+ ``tools``) are rendered without a generation prompt
and pinned; its name is ``cachedContents/<prefix id>``, so the same pin is also
``/v1/prefixes/<prefix id>``. Tenant scoping (another key's cache is 404), the key's quota
(429 ``RESOURCE_EXHAUSTED``) and revocation are the prefix API's. A ``generateContent`` naming
``cachedContent`` renders the cache's messages followed by its own ``contents``; it may not
send its own ``systemInstruction``, ``tools`` or ``toolConfig`` (Gemini refuses them too).
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

from aiohttp import web
from prefixgate.engine.outputs import CompletionOutput, StepOutput
from prefixgate.gateway.http.errors import (
    GEMINI,
    APIError,
    bad_request,
    error_dialect,
)
from prefixgate.gateway.local.generation import engine_request
from prefixgate.gateway.local.local_call import counted_prompt, translated_prompt
from prefixgate.gateway.local.prefix_routes import prefix_quota
from prefixgate.gateway.local.prefixes import PrefixEntry, SharedPrefix
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.local.tokenize import counting
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.tenancy.pool_hints import pool_hint
from prefixgate.gateway.wire.client_fields import gemini_fields
from prefixgate.gateway.wire.gemini_models import (
    CachedContentCreate,
    CachedContentUpdate,
    Chat,
    CountTokensRequest,
    GenerateContentRequest,
    GenerationConfig,
    cache_life_s,
    cache_messages,
    life_seconds,
    openai_tools,
    parse_request,
    refuse_beside_cache,
    refuse_constraint_beside_tools,
    structured,
    to_chat,
)
from prefixgate.gateway.wire.gemini_routes import (
    CACHE_PREFIX,
    KEEPALIVE,
    add_gemini_routes,
    cache_miss,
    list_page,
    model_object,
    no_route,  # noqa: F401  (add_gemini_routes reads the handlers off this module)
    refuse_get_of_method,
    require_sse_alt,
    rfc3339,
    split_model_method,
)
from prefixgate.gateway.wire.partial_json import arguments_object
from prefixgate.gateway.wire.prompts import check_length, choice_seeds, render_chat
from prefixgate.gateway.wire.response_models import Usage
from prefixgate.gateway.wire.stop_strings import refuse_stop_under_constraint
from prefixgate.gateway.wire.tools import (
    GEMINI_CHOICE,
    ToolDeltas,
    ToolPlan,
    parse_output,
)

_DESCRIPTION = "served by prefixgate"  # the model object's description

_FINISH = {"stop": "STOP", "length": "MAX_TOKENS"}


def finish_reason(o: CompletionOutput) -> str:
    """Gemini's ``finishReason`` of a finished choice (``STOP``, ``MAX_TOKENS``, ``OTHER``)."""
    return _FINISH.get(o.finish_reason or "", "OTHER")


def usage_metadata(usage: Usage) -> dict[str, int]:
    """Gemini's ``usageMetadata`` of an answer's usage (module docstring)."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "promptTokenCount": usage.prompt_tokens,
        "candidatesTokenCount": usage.completion_tokens,
        "cachedContentTokenCount": cached,
        "totalTokenCount": usage.prompt_tokens + usage.completion_tokens,
    }


def _function_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": arguments_object(arguments)}}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class GeminiRenderer:
    """Engine outputs → a ``GenerateContentResponse``, or its SSE chunks (every candidate).

    The same methods as the other renderers, so ``Exchange`` runs it unchanged. Text is sent
    as it comes; function calls (whole, as Gemini streams them) with the choice's end.
    """

    route = "generate_content"
    include_usage = True
    cut_on_abort = True  # an aborted answer ends with an error (wire.endings)
    keepalive = KEEPALIVE  # an empty line (google-genai reads a ``:`` comment as a JSON chunk)

    def __init__(self, rid: str, model: str, plan: ToolPlan, n: int) -> None:
        self.rid = rid
        self.model = model
        self.tools = plan if plan.active else None
        self._deltas = [ToolDeltas(plan) for _ in range(n)] if self.tools is not None else None
        self._calls: list[dict[int, dict[str, str]]] = [{} for _ in range(n)]

    def _response(self, candidates: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        body: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            body["usageMetadata"] = usage_metadata(usage)
        body["modelVersion"] = self.model
        body["responseId"] = self.rid
        return body

    def json(self, outputs: list[CompletionOutput], usage: Usage) -> bytes:
        """The whole ``GenerateContentResponse``, as JSON bytes."""
        candidates = []
        for i, o in enumerate(outputs):
            content, calls = (
                (o.text, []) if self.tools is None else parse_output(self.tools, o.text)
            )
            parts: list[dict[str, Any]] = []
            if content or not calls:
                parts.append({"text": content or ""})
            parts += [_function_call(c.name, c.arguments, c.id) for c in calls]
            candidates.append(
                {
                    "content": {"role": "model", "parts": parts},
                    "finishReason": finish_reason(o),
                    "index": i,
                }
            )
        return _dumps(self._response(candidates, usage))

    # --- stream ---------------------------------------------------------------------------
    def event(self, chunk: bytes) -> bytes:
        """Chunks are already framed events."""
        return chunk

    def opening(self, n: int) -> list[bytes]:
        """Nothing: the first chunk carries text."""
        return []

    def _chunk(self, candidates: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        return b"data: " + _dumps(self._response(candidates, usage)) + b"\n\n"

    def chunks(self, i: int, d: StepOutput, offset: int) -> list[bytes]:
        """A chunk of the choice's new text (function calls wait for ``closing``)."""
        if self._deltas is None:
            text = d.delta_text
        else:
            deltas = self._deltas[i].feed(d.delta_text) if d.delta_text else []
            if d.finished:
                deltas += self._deltas[i].finish()
            text = ""
            for delta in deltas:
                text += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    slot = self._calls[i].setdefault(
                        call.get("index", 0), {"id": "", "name": "", "arguments": ""}
                    )
                    slot["id"] = call.get("id") or slot["id"]
                    slot["name"] = fn.get("name") or slot["name"]
                    slot["arguments"] += fn.get("arguments") or ""
        if not text:
            return []
        content = {"role": "model", "parts": [{"text": text}]}
        return [self._chunk([{"content": content, "index": i}])]

    def closing(self, outputs: list[CompletionOutput], usage: Usage) -> list[bytes]:
        """The last chunk: each candidate's function calls and ``finishReason``, and the
        whole ``usageMetadata``."""
        candidates = []
        for i, o in enumerate(outputs):
            calls = [self._calls[i][k] for k in sorted(self._calls[i])]
            parts = [_function_call(c["name"], c["arguments"], c["id"]) for c in calls]
            candidates.append(
                {
                    "content": {"role": "model", "parts": parts or [{"text": ""}]},
                    "finishReason": finish_reason(o),
                    "index": i,
                }
            )
        return [self._chunk(candidates, usage)]

    def error_event(self, err: APIError) -> bytes:
        """The last event of a stream cut short: ``data: {"error": ...}`` (Gemini's shape)."""
        return b"data: " + _dumps(err.gemini_body()) + b"\n\n"


# --- shared steps ---------------------------------------------------------------------------
def _check_model(st: GatewayState, model: str, param: str = "model") -> None:
    names = st.served_names()
    if model.removeprefix("models/") not in names:
        raise APIError(
            404,
            f"models/{model.removeprefix('models/')[:80]} is not found; this server serves "
            + " or ".join(f"models/{n}" for n in names),
            param=param,
            code="model_not_found",
        )


async def _cached(
    request: web.Request, name: str, principal: Principal, param: str = "cachedContent"
) -> PrefixEntry | SharedPrefix:
    """The live cache ``name`` (``cachedContents/<id>``) of the caller's key; ``param``: the
    field a refusal names (``gemini_routes.cache_miss``).

    Raises:
        APIError: 404 when unknown, expired, revoked or another key's (the prefix API's).
    """
    if not name.startswith(CACHE_PREFIX):
        raise bad_request(
            f"cachedContent: {name[:80]!r} is not a cachedContents/... name", "cachedContent"
        )
    prefixes = request.app[LOCAL].require_prefixes()
    try:
        return await prefixes.lookup(name.removeprefix(CACHE_PREFIX), principal.salt)
    except APIError as exc:
        raise cache_miss(exc, param) from None


async def _chat(request: web.Request, req: GenerateContentRequest, principal: Principal) -> Chat:
    """The request as a chat; with ``cachedContent``, the cache's messages and tools first.

    Raises:
        APIError: 400 for ``systemInstruction`` / ``tools`` / ``toolConfig`` beside
            ``cachedContent``; 404 for a cache the key cannot read.
    """
    refuse_beside_cache(req)
    if not req.cachedContent:
        return to_chat(req)
    entry = await _cached(request, req.cachedContent, principal)
    bare = GenerateContentRequest(contents=req.contents)
    chat = to_chat(bare)
    chat.messages = [*entry.messages, *chat.messages]
    chat.origins = ["cachedContent"] * len(entry.messages) + chat.origins
    chat.tools = [dict(t) for t in entry.tools or []]
    return chat


async def _prepare(
    request: web.Request, req: GenerateContentRequest, principal: Principal
) -> tuple[Chat, ToolPlan, list[int]]:
    """The request's chat, tool plan and prompt ids. The chat's refusals (rendering, tool
    turns, tool plan) name Gemini's fields (``client_fields.in_client_words``), as the proxy's
    relay names an upstream's.
    """
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    chat = await _chat(request, req, principal)
    fields = gemini_fields(chat.origins, req.tools, req.generationConfig)
    plan, ids = await translated_prompt(st, engine, chat, None, GEMINI_CHOICE, fields)
    return chat, plan, ids


# --- routes ---------------------------------------------------------------------------------
@error_dialect(GEMINI)
async def model_method(request: web.Request) -> web.StreamResponse:
    """POST /v1beta/models/{model}:{method} (or under /v1): ``generateContent``,
    ``streamGenerateContent`` (``alt=sse``) or ``countTokens``; any other method 404."""
    model, method = split_model_method(request)
    if method == "generateContent":
        return await _generate(request, model, stream=False)
    if method == "streamGenerateContent":
        require_sse_alt(request)
        return await _generate(request, model, stream=True)
    return await _count_tokens(request, model)


async def _count_tokens(request: web.Request, model: str) -> web.Response:
    """``{"totalTokens": N, "cachedContentTokenCount"?}``: the prompt's tokens as
    ``generateContent``'s ``promptTokenCount`` counts them; a prompt past the context is
    counted too, under ``/tokenize``'s bound (``tokenize.counting``). Tools under mode AUTO
    are counted on a server without ``--tool-call-parser`` too (``local_call.counted_prompt``:
    only a generated answer is parsed)."""
    st = request.app[STATE]
    request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    body = parse_request(CountTokensRequest, await request.read())
    _check_model(st, model)
    req = body.request()
    if req.model is not None:
        _check_model(st, req.model, "generateContentRequest.model")
    engine = request.app[LOCAL].require_engine()
    chat = await _chat(request, req, principal)
    fields = gemini_fields(chat.origins, req.tools, req.generationConfig)
    with counting("countTokens", engine.max_model_len) as bound:
        ids = await counted_prompt(engine, chat, GEMINI_CHOICE, fields, bound)
    out: dict[str, Any] = {"totalTokens": len(ids)}
    return web.json_response(out)


async def _generate(request: web.Request, model: str, stream: bool) -> web.StreamResponse:
    from prefixgate.gateway.local.exchange import Exchange
    from prefixgate.gateway.local.openai_routes import _check_constraint

    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    req = parse_request(GenerateContentRequest, await request.read())
    _check_model(st, model)
    if req.model and req.model.removeprefix("models/") != model.removeprefix("models/"):
        raise bad_request("model: the body names another model than the path", param="model")
    chat, plan, ids = await _prepare(request, req, principal)
    gc = req.generationConfig
    constraint = structured(gc)
    refuse_constraint_beside_tools(constraint, chat.tools, chat.tool_choice)
    stop = list(gc.stopSequences or []) if gc is not None else []
    if plan.mode in ("required", "named"):
        forced = "toolConfig"
    elif constraint is not None:
        forced = "generationConfig.responseMimeType"
    else:
        forced = None
    refuse_stop_under_constraint(stop, "generationConfig.stopSequences", forced)
    spec = constraint if constraint is not None else plan.structured
    if spec is not None:
        await _check_constraint(spec, forced or "tools")
    max_tokens = check_length(
        len(ids),
        gc.maxOutputTokens if gc is not None else None,
        engine.max_model_len,
        "contents",
        "generationConfig.maxOutputTokens",
    )
    n = (gc.candidateCount if gc is not None else None) or 1
    seeds = choice_seeds(gc.seed if gc is not None else None, n)
    rid = uuid.uuid4().hex[:24]
    requests = []
    hint = pool_hint(request)
    config = gc if gc is not None else GenerationConfig.model_validate({})
    for i in range(n):
        params = config.sampling_params(max_tokens, seeds[i], stop, spec, plan.mode != "auto")
        requests.append(engine_request(principal, f"{rid}-{i}", ids, params, hint=hint))
    renderer = GeminiRenderer(rid, model.removeprefix("models/"), plan, n)
    return await Exchange(request, st, principal, requests, renderer, stream).run()


@error_dialect(GEMINI)
async def list_models(request: web.Request) -> web.Response:
    """GET /v1beta/models → ``{"models": [Model]}`` (one per served model id)."""
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    st.keys.authenticate(request)
    page, more = list_page(st.served_names(), request.query)
    models = [model_object(name, _DESCRIPTION, engine.max_model_len) for name in page]
    return web.json_response({"models": models, **more})


@error_dialect(GEMINI)
async def get_model(request: web.Request) -> web.Response:
    """GET /v1beta/models/{model} → the ``Model``; 404 for another name."""
    refuse_get_of_method(request)
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    st.keys.authenticate(request)
    name = request.match_info["target"].removeprefix("models/")
    _check_model(st, name)
    return web.json_response(model_object(name, _DESCRIPTION, engine.max_model_len))


# --- cachedContents -------------------------------------------------------------------------
def cache_object(entry: PrefixEntry | SharedPrefix, model: str) -> dict[str, Any]:
    """The ``CachedContent`` resource of a prefix (``usageMetadata.totalTokenCount``: the
    rendered prefix's tokens)."""
    updated = getattr(entry, "updated_at", 0) or entry.created_at
    out: dict[str, Any] = {
        "name": CACHE_PREFIX + entry.id,
        "model": f"models/{model}",
        "createTime": rfc3339(entry.created_at),
        "updateTime": rfc3339(updated),
        "expireTime": rfc3339(getattr(entry, "expires_unix", 0.0) or entry.expires_at),
        "usageMetadata": {"totalTokenCount": entry.prompt_tokens},
    }
    if entry.display_name is not None:
        out["displayName"] = entry.display_name
    return out


@error_dialect(GEMINI)
async def create_cache(request: web.Request) -> web.Response:
    """POST /v1beta/cachedContents → the ``CachedContent`` (its pin made)."""
    st = request.app[STATE]
    local = request.app[LOCAL]
    engine = local.require_engine()
    principal = st.keys.authenticate(request)
    req = parse_request(CachedContentCreate, await request.read())
    _check_model(st, req.model)
    if req.toolConfig is not None:
        raise bad_request(
            "toolConfig: a tool config in a cached content is not supported (send "
            "toolConfig-free requests on the cache)",
            param="toolConfig",
        )
    prefixes = local.require_prefixes()
    ttl_s = cache_life_s(req, prefixes.max_ttl_s)
    messages = cache_messages(req)
    tools = openai_tools(req.tools) or None
    ids = await render_chat(
        engine.tokenizer,
        messages,
        add_generation_prompt=False,
        max_model_len=engine.max_model_len,
        tools=tools,
    )
    check_length(len(ids), None, engine.max_model_len, "contents")
    entry = await prefixes.create(
        messages,
        ids,
        ttl_s,
        principal.salt,
        effective_salt(principal.salt, None),
        owner=principal.id,
        quota=prefix_quota(principal.spec, st.settings, engine.stats().get("kv_blocks_total", 0)),
        tenant=principal.tenant,
        tools=tools,
        display_name=req.displayName,
    )
    return web.json_response(cache_object(entry, st.model_name))


def _cache_id(request: web.Request) -> str:
    return request.match_info["cache_id"]


@error_dialect(GEMINI)
async def get_cache(request: web.Request) -> web.Response:
    """GET /v1beta/cachedContents/{id} → the ``CachedContent``; 404 when unknown, expired or
    another key's."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    entry = await _cached(request, CACHE_PREFIX + _cache_id(request), principal, "name")
    return web.json_response(cache_object(entry, st.model_name))


@error_dialect(GEMINI)
async def list_caches(request: web.Request) -> web.Response:
    """GET /v1beta/cachedContents?pageSize=&pageToken= → ``{"cachedContents": [...],
    "nextPageToken"?}``: the caller's key's live caches on this replica, oldest first."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    prefixes = request.app[LOCAL].require_prefixes()
    page, more = list_page(prefixes.owned(principal.salt), request.query)
    caches = [cache_object(e, st.model_name) for e in page]
    return web.json_response({"cachedContents": caches, **more})


@error_dialect(GEMINI)
async def update_cache(request: web.Request) -> web.Response:
    """PATCH /v1beta/cachedContents/{id} {ttl | expireTime} → the ``CachedContent`` with its
    new life (only the life can change: ``updateMask`` other than ttl / expireTime is a 400)."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    prefixes = request.app[LOCAL].require_prefixes()
    req = parse_request(CachedContentUpdate, await request.read())
    mask = request.query.get("updateMask")
    if mask is not None:
        for f in mask.split(","):
            if f.strip() not in ("ttl", "expireTime", "expire_time"):
                raise bad_request(
                    f"updateMask: only ttl or expireTime can change, got {f.strip()[:40]!r}",
                    param="updateMask",
                )
    if req.ttl is None and req.expireTime is None:
        raise bad_request("give ttl or expireTime", param="ttl")
    ttl_s = life_seconds(req.ttl, req.expireTime, 0.0)
    try:
        entry = await prefixes.renew(_cache_id(request), principal.salt, ttl_s)
    except APIError as exc:
        if exc.status == 400 and exc.param == "ttl" and req.ttl is None:
            # the life was given as expireTime: name the field the client sent
            raise bad_request(
                f"expireTime: a cache lives at most {prefixes.max_ttl_s:g} s from now "
                "(the server's --max-prefix-ttl-s)",
                param="expireTime",
            ) from None
        if exc.status == 404:
            raise cache_miss(exc, "name") from None
        raise
    return web.json_response(cache_object(entry, st.model_name))


@error_dialect(GEMINI)
async def delete_cache(request: web.Request) -> web.Response:
    """DELETE /v1beta/cachedContents/{id} → ``{}`` (its pin released)."""
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    prefixes = request.app[LOCAL].require_prefixes()
    try:
        await prefixes.remove(_cache_id(request), principal.salt)
    except APIError as exc:
        if exc.status == 404:
            raise cache_miss(exc, "name") from None
        raise
    return web.json_response({})


def add_routes(app: web.Application, expect_handler: Any) -> None:
    """Gemini's local-mode routes on ``app``."""
    add_gemini_routes(app, sys.modules[__name__], expect_handler)
