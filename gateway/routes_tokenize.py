"""POST /tokenize (local mode): a prompt's tokens as the server counts them, as vLLM's route.

Body: ``{"model", "messages", "add_generation_prompt": true}`` (a chat, rendered with the chat
template exactly as ``/v1/chat/completions`` renders it) or ``{"model", "prompt"}`` (text,
encoded as ``/v1/completions`` encodes it). Answer: ``{"count", "max_model_len", "tokens"}``.
Clients use it to fit prompts to the context before sending them (``prefixgate bench serve``
does); it runs no model and touches no KV block.
"""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.errors import bad_request
from prefixgate.gateway.prompts import completion_prompts, render_chat
from prefixgate.gateway.schemas import ChatMessage, parse
from prefixgate.gateway.state import STATE
from pydantic import BaseModel, ConfigDict


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of ``messages`` (a chat) and ``prompt`` (text)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    model: str | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize."""
    st = request.app[STATE]
    engine = st.require_engine()
    st.keys.authenticate(request)
    req = parse(TokenizeRequest, await request.read())
    if req.model is not None:
        st.check_model(req.model)
    if (req.messages is None) == (req.prompt is None):
        raise bad_request("send exactly one of messages and prompt", param="messages")
    if req.messages is not None:
        messages = [m.as_dict() for m in req.messages]
        ids = await render_chat(engine.tokenizer, messages, req.add_generation_prompt)
    else:
        ids = (await completion_prompts(engine.tokenizer, req.prompt or ""))[0]
    return web.json_response(
        {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    )
