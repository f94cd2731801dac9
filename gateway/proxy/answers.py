"""An upstream's answer checked against the OpenAI shape before a byte of it is relayed.

The gateway's own response models (``wire/response_models.py``) are the shape: a non-stream
200 of ``/v1/chat/completions`` must be a ``chat.completion`` (``ChatCompletion``), of
``/v1/completions`` a ``text_completion``, of ``/v1/models`` a model list (``/v1/models/{id}``
a model card); every streamed event a ``chat.completion.chunk`` (or ``text_completion``
chunk). Fields an upstream may leave out where the API allows null (``logprobs``, ``usage``,
``system_fingerprint``; a chunk's ``finish_reason``) and the envelope's ``id`` / ``created`` /
``model`` / ``object`` are tolerated when missing (not when of the wrong type); extra fields
pass (the models allow them). A completion must also say why each choice ended: a non-stream choice
without ``finish_reason`` is a truncated answer posing as a finished one.

The same verifier serves the Messages relay (``proxy/messages_relay.py``): a Messages
upstream's whole answer must be an Anthropic ``message`` (``anthropic_models.MessageAnswer``:
nothing may be missing), an OpenAI-compatible upstream's answer to a translated Messages
request a ``chat.completion`` (each chunk a ``chat.completion.chunk``) as on the chat route.

vLLM's ``/tokenize`` and ``/detokenize`` and OpenAI's ``/v1/embeddings``, relayed as they are
(``proxy/token_relay.py``), are checked by the shapes their clients read (``TokenizeAnswer``:
``tokens`` and their ``count``; ``DetokenizeAnswer``: ``prompt``; ``EmbeddingList``: each vector a
list of floats or a base64 string), extra fields passing.

``answer_model(path, stream)`` names the model of a route; ``shape_problem(obj, model,
finished)`` says what is wrong with a parsed answer (None when nothing).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from prefixgate.gateway.wire.anthropic_models import MessageAnswer
from prefixgate.gateway.wire.first_fault import first_fault_validator
from prefixgate.gateway.wire.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ModelCard,
    ModelList,
)
from pydantic import BaseModel, ConfigDict, ValidationError

# Left out by some OpenAI-compatible servers where the API allows null, and the envelope's
# bookkeeping (``id``, ``created``, ``model``, ``object``: clients read them as attributes, a
# missing one is None there, never a TypeError); what an answer is made of — ``choices``, each
# choice's message / delta / text and, non-stream, its finish_reason — must be there.
_MAY_BE_MISSING = frozenset(
    ("logprobs", "usage", "system_fingerprint", "id", "created", "model", "object")
)
_CHUNK_MAY_BE_MISSING = _MAY_BE_MISSING | {"finish_reason"}
_STRICT: frozenset[type[BaseModel]] = frozenset((MessageAnswer,))  # nothing may be missing


class TokenizeAnswer(BaseModel):
    """``POST /tokenize`` (vLLM's, SGLang's): the prompt's ``tokens`` and their ``count``
    (llama.cpp's server sends no count, and its tokens as ``{"id", "piece"}`` objects when
    asked for pieces), the model's ``max_model_len`` (tokens) where the server says it,
    ``token_strs`` when asked."""

    model_config = ConfigDict(extra="allow")
    tokens: list[int | dict[str, Any]]
    count: int | None = None
    max_model_len: int | None = None
    token_strs: list[str | None] | None = None


class DetokenizeAnswer(BaseModel):
    """``POST /detokenize`` (vLLM's): the ids' text."""

    model_config = ConfigDict(extra="allow")
    prompt: str


class EmbeddingUsage(BaseModel):
    """An embeddings answer's ``usage``: its input tokens."""

    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    total_tokens: int


class Embedding(BaseModel):
    """One input's vector: floats, or base64 of little-endian float32 (``encoding_format``)."""

    model_config = ConfigDict(extra="allow")
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    """``POST /v1/embeddings``: one vector per input, in ``data``."""

    model_config = ConfigDict(extra="allow")
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str | None = None
    usage: EmbeddingUsage | None = None


_AS_IS: dict[str, type[BaseModel]] = {
    "/tokenize": TokenizeAnswer,
    "/detokenize": DetokenizeAnswer,
    "/v1/embeddings": EmbeddingList,
}


def answer_model(path: str, stream: bool) -> type[BaseModel] | None:
    """The response model an answer to ``path`` must validate against (a stream: each
    chunk's), None for a route without one."""
    if path == "/v1/chat/completions":
        return ChatCompletionChunk if stream else ChatCompletion
    if path == "/v1/completions":
        return Completion  # its chunks are text_completion objects too
    if path == "/v1/models":
        return None if stream else ModelList
    if path.startswith("/v1/models/"):
        return None if stream else ModelCard
    if path == "/v1/messages":  # a stream: its events, checked in order by the relay
        return None if stream else MessageAnswer
    return _AS_IS.get(path)


def renamed(data: bytes, model: str) -> bytes:
    """A JSON answer ``data`` whose top-level ``model`` says ``model`` (the name the client
    sent, where the gateway sent the upstream another id: a config's alias, deployment id or
    fallback — as LiteLLM's proxy answers); as it came when it has no ``model`` or is not a
    JSON object."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(obj, dict) or "model" not in obj or obj["model"] == model:
        return data
    return json.dumps({**obj, "model": model}).encode()


def shape_problem(obj: Any, model: type[BaseModel], chunk: bool = False) -> str | None:
    """What makes ``obj`` (a parsed JSON answer, or one stream chunk with ``chunk``) not a
    ``model``, in a short sentence; None when it is one.

    A non-stream completion (a model with ``choices``) must also give each choice a
    ``finish_reason``.
    """
    if not isinstance(obj, dict):
        return "a JSON value that is not an object"
    tolerated = (
        frozenset() if model in _STRICT else _CHUNK_MAY_BE_MISSING if chunk else _MAY_BE_MISSING
    )
    try:
        # stops at a list's first bad item: a million bad choices are one error, not a
        # million (first_fault.py: gigabytes and seconds of the event loop)
        first_fault_validator(model, tolerated).validate_python(obj)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "the body"
        return f"not a {_name(model, chunk)}: {where}: {err['msg']}"
    if not chunk and "choices" in model.model_fields:
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason") is None:
                return (
                    f"a {_name(model, chunk)} whose choice {choice.get('index', 0)} has no "
                    "finish_reason"
                )
    return None


def _name(model: type[BaseModel], chunk: bool) -> str:
    field = model.model_fields.get("object")
    kind = field.default if field is not None and isinstance(field.default, str) else None
    kind = kind or model.__name__
    return f"{kind} chunk" if chunk and not kind.endswith("chunk") else kind
