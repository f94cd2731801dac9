"""The start every local-mode API route shares: state, engine, key, parsed body, model."""

from __future__ import annotations

from typing import Any, TypeVar

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE, GatewayState
from prefixgate.gateway.tenancy.keys import Principal
from prefixgate.gateway.wire.client_fields import ClientFields, in_client_words
from prefixgate.gateway.wire.prompts import render_chat
from prefixgate.gateway.wire.request_models import parse
from prefixgate.gateway.wire.tools import (
    ChoiceWords,
    ToolPlan,
    choose_tool,
    plan_tools,
    prompt_tools,
)
from pydantic import BaseModel

Body = TypeVar("Body", bound=BaseModel)


async def open_call(
    request: web.Request, model: type[Body]
) -> tuple[GatewayState, EngineClient, Principal, Body]:
    """The app's state, its engine, the caller's key and the body parsed as ``model`` (see
    ``request_models.parse``) with its ``model`` field checked, in that order.

    Raises:
        APIError: 503 while the model loads, 401 from the key, 400 from the body, 404 for a
            model this gateway does not serve.
    """
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    principal = st.keys.authenticate(request)
    req = parse(model, await request.read())
    st.check_model(getattr(req, "model"))  # noqa: B009 - every route body names its model
    return st, engine, principal, req


async def translated_prompt(
    st: GatewayState,
    engine: EngineClient,
    chat: Any,
    parallel_tool_calls: bool | None,
    words: ChoiceWords,
    fields: ClientFields,
    bound: int | None = None,
) -> tuple[ToolPlan, list[int]]:
    """A translated dialect's (Messages, Gemini) ``chat`` (its ``messages``, ``tools``,
    ``tool_choice``) as its tool plan and prompt ids: ``plan_tools`` (advice in ``words``),
    then ``render_chat`` (refused from its length past ``bound`` tokens: ``max_model_len``
    unless given).

    Raises:
        APIError: the plan's or the rendering's refusal, naming the client's own fields
            (``fields``, ``client_fields.in_client_words``).
    """
    try:
        plan = plan_tools(
            chat.tools or None,
            chat.tool_choice,
            parallel_tool_calls,
            st.settings.tool_call_parser,
            words,
        )
    except APIError as exc:
        raise in_client_words(exc, fields) from None
    return plan, await _rendered(engine, chat, plan.tools, fields, bound)


async def counted_prompt(
    engine: EngineClient,
    chat: Any,
    words: ChoiceWords,
    fields: ClientFields,
    bound: int | None = None,
) -> list[int]:
    """The prompt ids of a translated dialect's ``chat`` that is only counted (Messages
    ``count_tokens``, Gemini ``countTokens``): the prompt generation renders, with the tools
    its template declares (``tools.prompt_tools``: none under ``tool_choice`` "none"). What
    only a generated answer needs (the server's ``--tool-call-parser``, a strict tool's
    structural tag) is not asked for: a count generates nothing, as the proxy's count through
    ``/tokenize``.

    Raises:
        APIError: 400 naming the client's field (``in_client_words``): a bad tool or tool
            choice (``tools.choose_tool``), the rendering's refusal (past ``bound`` tokens,
            ``max_model_len`` unless given).
    """
    try:
        checked, mode, _ = choose_tool(chat.tools or None, chat.tool_choice, words)
    except APIError as exc:
        raise in_client_words(exc, fields) from None
    return await _rendered(engine, chat, prompt_tools(checked, mode), fields, bound)


async def _rendered(
    engine: EngineClient,
    chat: Any,
    tools: list[dict[str, Any]],
    fields: ClientFields,
    bound: int | None,
) -> list[int]:
    """``render_chat`` of ``chat.messages`` with ``tools`` declared, refusals in the client's
    words."""
    try:
        return await render_chat(
            engine.tokenizer,
            chat.messages,
            max_model_len=engine.max_model_len if bound is None else bound,
            tools=tools or None,
        )
    except APIError as exc:
        raise in_client_words(exc, fields) from None
