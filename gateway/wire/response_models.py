"""OpenAI response bodies as the gateway sends them: the server's one definition of their shape.

pydantic models of ``chat.completion``, ``chat.completion.chunk``, ``text_completion`` (bodies
and stream chunks), ``usage``, both logprobs shapes, the model card and list, the error body, after the OpenAI
API reference (https://platform.openai.com/docs/api-reference/chat/object). The recorded
OpenAI bodies in ``tests/fixtures/openai_wire`` validate against these models and every key
the gateway sends appears in them (``tests/gateway/test_wire_shapes.py``); the SDK's
``types`` parse the same files. Fields OpenAI sends and the gateway never does
(``service_tier``, ``refusal``, ...) are accepted as extras when validating, never produced. Request bodies are in ``schemas``.

``dump(model)`` serializes one to compact JSON bytes (UTF-8, ``None`` kept as ``null``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, model_serializer

if TYPE_CHECKING:
    from prefixgate.gateway.http.request_account import RequestAccount

# Validation of recorded bodies tolerates fields the gateway never sends.
_OUT = ConfigDict(extra="allow")


class _Sparse(BaseModel):
    """A response model that leaves the fields named in ``sparse_fields`` out of its body
    while they are None (``sparse_fields`` None: every field that is None)."""

    model_config = _OUT
    sparse_fields: ClassVar[frozenset[str] | None] = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: Any) -> dict[str, Any]:
        names = self.sparse_fields
        return {
            k: v
            for k, v in handler(self).items()
            if v is not None or (names is not None and k not in names)
        }


class PromptTokensDetails(_Sparse):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache
    (``cached_tokens``) and, for a request with cache breakpoints, those written at them
    (``cache_write_tokens``, sent only then)."""

    model_config = _OUT
    sparse_fields = frozenset({"cache_write_tokens"})
    cached_tokens: int = 0
    cache_write_tokens: int | None = None


class Usage(BaseModel):
    """Token counts of a response (``total_tokens = prompt_tokens + completion_tokens``)."""

    model_config = _OUT
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        """The usage of ``prompt_tokens`` in, ``completion_tokens`` out, ``cached_tokens`` of
        the prompt from the prefix cache."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )

    @classmethod
    def of_account(cls, acct: RequestAccount) -> Usage:
        """The usage of a request's account (``http.request_account``): the one source the
        access line, the metrics and the key's charge read too.

        Raises:
            ValueError: the account's prompt or completion tokens are not known (None).
        """
        if acct.prompt_tokens is None or acct.completion_tokens is None:
            raise ValueError("the request's usage is not known")
        return cls.of(acct.prompt_tokens, acct.completion_tokens, acct.cached_tokens or 0)


class TopLogprob(BaseModel):
    """One alternative token: its text, natural-log probability and UTF-8 bytes."""

    model_config = _OUT
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """One sampled token of a chat choice with its ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: ``content`` one entry per generated token."""

    model_config = _OUT
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    """``function`` of a tool call: its name and its arguments as a JSON string."""

    model_config = _OUT
    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    model_config = _OUT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Sparse):
    """The generated message of a chat choice (``tool_calls`` only sent when there are)."""

    model_config = _OUT
    sparse_fields = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class _Choice(BaseModel):
    """What every choice of an answer or a chunk starts with: its ``index`` among the ``n``."""

    model_config = _OUT
    index: int


class _Answer(BaseModel):
    """What every answer and stream chunk starts with (subclasses give ``object``, the type of
    ``choices`` and what follows them)."""

    model_config = _OUT
    id: str
    object: str
    created: int
    model: str
    choices: list[Any]


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Answer):
    """``POST /v1/chat/completions`` without ``stream``."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class FunctionDelta(_Sparse):
    """A piece of a streamed tool call's ``function`` (unset fields are not sent)."""

    model_config = _OUT
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """A fragment of a streamed tool call: ``index`` always; ``id``, ``type`` and the
    function's ``name`` in its first fragment; ``arguments`` in pieces (OpenAI's streaming)."""

    model_config = _OUT
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChoiceDelta(_Sparse):
    """What a chunk adds to a chat choice; fields left ``None`` are not sent (``{}`` on the
    finishing chunk, ``{"role": "assistant", "content": ""}`` opening a choice)."""

    model_config = _OUT
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Choice):
    delta: ChoiceDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Answer):
    """One ``data:`` event of a chat stream (``choices: []`` and ``usage`` on the last one of a
    stream with ``include_usage``; ``usage: null`` on the others then, absent otherwise)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions ``logprobs`` (one list entry per token; ``text_offset`` in
    characters of the choice's text)."""

    model_config = _OUT
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(_Answer):
    """``POST /v1/completions`` (``system_fingerprint`` only on the body, not on chunks)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Sparse):
    """``GET /v1/models/{id}`` (``max_model_len`` is vLLM's extra: context length in tokens)."""

    model_config = _OUT
    sparse_fields = frozenset({"max_model_len"})
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "prefixgate"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    model_config = _OUT
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PrefixFacts(Protocol):
    """What the API's prefix object shows of a prefix (local, shared, or upstream mode's)."""

    @property
    def id(self) -> str: ...
    @property
    def created_at(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def expires_at(self) -> float: ...


def prefix_object(entry: PrefixFacts, model: str) -> dict[str, Any]:
    """The API's prefix object (``POST``/``GET /v1/prefixes``) of a local, shared or
    upstream-mode prefix;
    ``created`` and ``expires_at`` in Unix seconds."""
    return {
        "id": entry.id,
        "object": "prefix",
        "model": model,
        "created": entry.created_at,
        "prompt_tokens": entry.prompt_tokens,
        "expires_at": int(entry.expires_at),
    }


def dump(model: BaseModel, exclude: set[str] | None = None) -> bytes:
    """``model`` as compact JSON bytes (``exclude``: top-level fields left out)."""
    return model.__pydantic_serializer__.to_json(model, exclude=exclude)
