"""POST /tokenize and POST /detokenize (local mode), as vLLM's routes.

``/tokenize``: a prompt's tokens as the server counts them.

Body: ``{"model", "messages", "add_generation_prompt": true, "tools"}`` (a chat, rendered with
the chat template exactly as ``/v1/chat/completions`` renders it; ``tools``, vLLM's field, OpenAI
function tools checked as chat checks them and passed to the template: what a proxy sends to
count a Gemini or Anthropic request with tools) or ``{"model", "prompt",
"add_special_tokens": true}`` (text, encoded as ``/v1/completions`` encodes it; ``false``: no
BOS/EOS added, as vLLM's). Answer: ``{"count", "max_model_len", "tokens"}``. Any other field is
a 400 naming it (never ignored); ``add_special_tokens`` with ``messages`` only as ``false``
(the template writes the special tokens itself), ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs`` (vLLM's, as chat takes them) only with
``messages``. ``return_token_strs: true`` (vLLM's) adds ``token_strs``: each token's string in
the vocabulary (``"▁word"``, ``"<0x0A>"``), one per id.
Bounded work: ``messages`` holds at most ``MAX_MESSAGES`` (4,096, counted by the ingress
guard before anything is validated or rendered), and a text (the prompt, or the rendered chat)
is tokenized only when its token count's lower bound (``Tokenizer.min_num_tokens``: its UTF-8
bytes over the most bytes one token covers) is under ``TOKENIZE_CONTEXTS`` (8) ×
``max_model_len``; beyond, 400 ``context_length_exceeded`` naming the field, before
tokenizing (a prompt that long fits no request). A text under that bound is counted exactly,
however many tokens it turns out to hold (vLLM's ``/tokenize`` counts any length): the bound
is on the text's bytes, not on the count (aidreams-260k: 12,288 bytes). The count
routes of the other dialects (``count_tokens``, ``countTokens``) count under the same bound
(``counting``).
Clients use it to fit prompts to the context before sending them (``prefixgate bench serve``
does); it runs no model and touches no KV block. ``/detokenize``: ``{"model", "tokens"}`` →
``{"prompt"}`` (special tokens kept, as vLLM's), each id checked against the vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.state import STATE
from prefixgate.gateway.wire.prompts import (
    OverContext,
    completion_prompts,
    refuse_oversized,
    render_chat,
)
from prefixgate.gateway.wire.request_models import check_template_kwargs, parse
from prefixgate.gateway.wire.token_requests import DetokenizeRequest, TokenizeRequest
from prefixgate.gateway.wire.tools import check_tools

if TYPE_CHECKING:
    from prefixgate.engine.protocol import EngineClient

TOKENIZE_CONTEXTS = 8  # /tokenize counts texts of up to this many contexts (lower bound)


_Body = TypeVar("_Body", TokenizeRequest, DetokenizeRequest)


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize.

    Raises:
        APIError: 400 on a bad body; 400 ``context_length_exceeded`` naming ``messages`` or
            ``prompt`` when the text's length alone shows it holds at least
            ``TOKENIZE_CONTEXTS * max_model_len`` tokens (``Tokenizer.min_num_tokens``:
            UTF-8 bytes over the most bytes one token covers; nothing tokenized).
    """
    engine = request.app[LOCAL].require_engine()
    with counting("/tokenize", engine.max_model_len):
        return await _tokenize(request)


@contextmanager
def counting(route: str, max_model_len: int) -> Iterator[int]:
    """The bound of a counting route (``/tokenize``, Anthropic's ``count_tokens``, Gemini's
    ``countTokens``): yields ``TOKENIZE_CONTEXTS * max_model_len`` tokens, the bound to
    render or encode the text with; a text refused by it (``OverContext``) is told in the
    route's words (``count_refusal``), not the generation routes' "no room to generate".
    """
    try:
        yield TOKENIZE_CONTEXTS * max_model_len
    except OverContext as exc:
        raise count_refusal(exc, route, max_model_len) from None


def count_refusal(exc: OverContext, route: str, max_model_len: int) -> APIError:
    """A counting route's 400 ``context_length_exceeded`` for a text its length alone bounds
    past ``exc.bound`` tokens (naming the same field)."""
    return APIError(
        400,
        f"{route} counts a text unless its length alone shows it holds at least "
        f"{TOKENIZE_CONTEXTS} x max_model_len = {exc.bound} tokens; the text of {exc.param} "
        f"({exc.chars} characters) holds at least {exc.at_least} by its UTF-8 length (not "
        f"tokenized), more than a request to this model can hold (max_model_len "
        f"{max_model_len})",
        param=exc.param,
        code=exc.code,
    )


async def _engine_and_body(request: web.Request, kind: type[_Body]) -> tuple[EngineClient, _Body]:
    """The local engine and the request's body parsed as ``kind``, once the key is checked
    (a ``model`` named in the body must be the served one).

    Raises:
        APIError: 503 while the model loads, 401 / 400 / 404 from the key, body and model.
    """
    st = request.app[STATE]
    engine = request.app[LOCAL].require_engine()
    st.keys.authenticate(request)
    req = parse(kind, await request.read())
    if req.model is not None:
        st.check_model(req.model)
    return engine, req


async def _tokenize(request: web.Request) -> web.Response:
    engine, req = await _engine_and_body(request, TokenizeRequest)
    cap = TOKENIZE_CONTEXTS * engine.max_model_len
    if (req.messages is None) == (req.prompt is None):
        raise bad_request("send exactly one of messages and prompt", param="messages")
    if req.messages is not None:
        if req.add_special_tokens:
            raise bad_request(
                "add_special_tokens: only false with messages (the chat template writes the "
                "special tokens itself)",
                param="add_special_tokens",
            )
        messages = [m.as_dict() for m in req.messages]
        gen = req.add_generation_prompt is not False
        cont = bool(req.continue_final_message)
        if cont and gen:  # vLLM's rule, as chat's (request_models.ChatCompletionRequest)
            raise bad_request(
                "continue_final_message: cannot be true with add_generation_prompt true (its "
                "default): send add_generation_prompt false to continue the final message",
                param="continue_final_message",
            )
        check_template_kwargs(req.chat_template_kwargs, engine.tokenizer)
        tools = check_tools(req.tools) or None  # 400 naming tools.<i>... for a bad tool
        ids = await render_chat(
            engine.tokenizer,
            messages,
            gen,
            max_model_len=cap,
            tools=tools,
            template_kwargs=req.chat_template_kwargs,
            continue_final_message=cont,
        )
    elif req.tools:
        raise bad_request("tools: only with messages (a prompt is encoded as it is)", param="tools")
    elif (chat_only := _chat_only_field(req)) is not None:
        raise bad_request(
            f"{chat_only}: only with messages (a prompt is encoded as it is)", param=chat_only
        )
    elif req.add_special_tokens is False:
        if not req.prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        refuse_oversized(engine.tokenizer, req.prompt, cap, "prompt")
        ids = list((await asyncio.to_thread(engine.tokenizer.encode_batch, [req.prompt], False))[0])
    else:
        ids = (await completion_prompts(engine.tokenizer, req.prompt or "", cap))[0]
    body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = token_strs(engine.tokenizer, ids)
    return web.json_response(body)


def _chat_only_field(req: TokenizeRequest) -> str | None:
    """The first field of a ``prompt`` body that only a chat (``messages``) takes, or None."""
    for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            return name
    return None


def token_strs(tokenizer: Any, ids: list[int]) -> list[str | None]:
    """Each id's string in the vocabulary (vLLM's ``return_token_strs``:
    ``convert_ids_to_tokens``), ``None`` for an id the tokenizer has no string of."""
    return [tokenizer.id_to_token(i) for i in ids]


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize.

    Raises:
        APIError: 400 when an id is outside ``[0, vocab_size)`` (``param`` ``tokens.<i>``).
    """
    engine, req = await _engine_and_body(request, DetokenizeRequest)
    vocab = engine.tokenizer.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(
                f"token id {t} is outside the vocabulary [0, {vocab})", param=f"tokens.{i}"
            )
    text = engine.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return web.json_response({"prompt": text})
