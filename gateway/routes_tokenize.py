"""POST /tokenize and POST /detokenize (local mode), as vLLM's routes.

``/tokenize``: a prompt's tokens as the server counts them.

Body: ``{"model", "messages", "add_generation_prompt": true}`` (a chat, rendered with the chat
template exactly as ``/v1/chat/completions`` renders it) or ``{"model", "prompt"}`` (text,
encoded as ``/v1/completions`` encodes it). Answer: ``{"count", "max_model_len", "tokens"}``.
Clients use it to fit prompts to the context before sending them (``prefixgate bench serve``
does); it runs no model and touches no KV block. ``/detokenize``: ``{"model", "tokens"}`` →
``{"prompt"}`` (special tokens kept, as vLLM's), each id checked against the vocabulary.
"""

from __future__ import annotations

from aiohttp import web
from prefixgate.gateway.errors import bad_request
from prefixgate.gateway.prompts import completion_prompts, render_chat
from prefixgate.gateway.schemas import ChatMessage, parse
from prefixgate.gateway.state import STATE
from pydantic import BaseModel, ConfigDict, Field


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


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize.

    Raises:
        APIError: 400 when an id is outside ``[0, vocab_size)`` (``param`` ``tokens.<i>``).
    """
    st = request.app[STATE]
    engine = st.require_engine()
    st.keys.authenticate(request)
    req = parse(DetokenizeRequest, await request.read())
    if req.model is not None:
        st.check_model(req.model)
    vocab = engine.tokenizer.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(
                f"token id {t} is outside the vocabulary [0, {vocab})", param=f"tokens.{i}"
            )
    text = engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return web.json_response({"prompt": text})
