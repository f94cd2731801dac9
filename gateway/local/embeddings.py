"""POST /v1/embeddings (local mode, a model served with ``--runner pooling``).

Body as OpenAI's (https://platform.openai.com/docs/api-reference/embeddings): ``input`` is a
string, a list of strings, a list of token ids or a list of token-id lists; ``encoding_format``
``"float"`` (lists of floats) or ``"base64"`` (little-endian float32 bytes, base64 — what
openai-python asks for by default and decodes). Strings are tokenized as the model's tokenizer
does with its special tokens (BOS/EOS as its post-processor adds them). ``dimensions`` (a
truncated embedding) is refused by name: the model's hidden size is the only size served.
A server running a generation model answers 400, as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import struct

from aiohttp import web
from prefixgate.engine.protocol import TokenizerLike
from prefixgate.gateway.http.errors import APIError, bad_request
from prefixgate.gateway.http.request_account import account
from prefixgate.gateway.tenancy.shared_state import close_lease
from prefixgate.gateway.wire.prompts import OverContext, refuse_oversized
from prefixgate.gateway.wire.token_requests import EmbeddingRequest

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


async def create_embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings."""
    from prefixgate.gateway.local.local_call import open_call

    st, engine, principal, req = await open_call(request, EmbeddingRequest)
    if req.dimensions is not None:
        raise bad_request(
            "dimensions: shortened embeddings are not supported (the model's hidden size is "
            "the only size served; leave dimensions out)",
            param="dimensions",
            code="unsupported_parameter",
        )
    embed = getattr(engine, "embed_async", None)
    if embed is None:
        raise bad_request(
            "this model is served for generation: start the server with --runner pooling "
            "to serve embeddings",
            param="model",
            code="model_not_embedding",
        )
    inputs = await _token_inputs(engine.tokenizer, req.input, engine.max_model_len)
    tokens = sum(len(x) for x in inputs)
    lease = await st.shared.acquire(principal, tokens)
    try:
        ticket = st.admission.admit(
            tokens,
            len(inputs),
            param="input",
            tenant=principal.tenant,
            weight=principal.weight,
            unit="embeddings",
        )
    except APIError:
        st.shared.refund(principal, lease)
        raise
    acct = account(request)
    work = asyncio.ensure_future(embed(inputs))
    try:
        vectors = await asyncio.shield(work)
        # charged exactly its input tokens, as a chat is its prompt + completion
        acct.served, acct.prompt_tokens, acct.completion_tokens = True, tokens, 0
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="input") from None
    finally:
        close_lease(st.shared, principal, lease, acct)
        if work.done():
            ticket.done()
        else:  # client gone: the worker thread cannot be stopped; its place is held till it ends

            def finished(f: asyncio.Future[list[list[float]]]) -> None:
                ticket.done()
                if not f.cancelled():
                    f.exception()  # nobody awaits it any more: retrieved, never logged

            work.add_done_callback(finished)
    data = []
    for i, vec in enumerate(vectors):
        emb: list[float] | str = vec
        if req.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return web.json_response(
        {"object": "list", "data": data, "model": st.model_name, "usage": usage}
    )


async def _token_inputs(
    tokenizer: TokenizerLike, raw: object, max_model_len: int
) -> list[list[int]]:
    """``input`` as token-id lists (strings tokenized in a worker thread).

    Raises:
        APIError: 400 on an empty input or string, or over ``MAX_INPUTS`` inputs; 400
            ``context_length_exceeded`` naming ``input`` when a string's length alone
            (``refuse_oversized``: ``Tokenizer.min_num_tokens``, its UTF-8 bytes over the
            most bytes one token covers) shows it holds more than ``max_model_len`` tokens,
            before anything is tokenized (as ``/tokenize`` bounds its text).
    """
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must not be empty", param="input")
    if all(isinstance(x, int) for x in raw):  # one input of token ids (its length: the context's)
        return [[int(x) for x in raw]]
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(raw)}", param="input")
    if all(isinstance(x, str) for x in raw):
        texts = [str(x) for x in raw]
        if not all(texts):
            raise bad_request("input strings must not be empty", param="input")
        for i, text in enumerate(texts):
            try:  # a bound of max_model_len + 1: an input of max_model_len tokens fits
                refuse_oversized(tokenizer, text, max_model_len + 1, "input")
            except OverContext as exc:
                raise APIError(
                    400,
                    f"input {i} ({exc.chars} characters) holds at least {exc.at_least} tokens "
                    f"by its UTF-8 length (not tokenized), more than this model's maximum "
                    f"context length of {max_model_len} tokens",
                    param="input",
                    code="context_length_exceeded",
                ) from None
        return list(await asyncio.to_thread(tokenizer.encode_batch, texts, True))
    return [[int(t) for t in x] for x in raw if isinstance(x, list)]
