"""Typed results of the OpenAI API (+ prefixgate's ``/v1/prefixes``).

Field names follow the OpenAI API reference (https://platform.openai.com/docs/api-reference):
``ChatCompletion.choices[0].message.content``, ``.usage.prompt_tokens_details.cached_tokens``
(prompt tokens served from the server's prefix cache), ``ChatCompletionChunk.choices[0].delta``.
Every field has a default, so a partial body from any OpenAI-compatible server still parses;
fields a class does not declare stay readable as attributes (see ``Model``). Token counts are
in tokens, ``created`` / ``expires_at`` in Unix seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from pydantic import Field

from ._model import Model

__all__ = [
    "Model",
    "PromptTokensDetails",
    "CompletionTokensDetails",
    "CompletionUsage",
    "TopLogprob",
    "TokenLogprob",
    "ChoiceLogprobs",
    "Function",
    "ChatCompletionMessageToolCall",
    "ChatCompletionMessage",
    "Choice",
    "ChatCompletion",
    "ChoiceDeltaToolCallFunction",
    "ChoiceDeltaToolCall",
    "ChoiceDelta",
    "ChunkChoice",
    "ChatCompletionChunk",
    "CompletionLogprobs",
    "CompletionChoice",
    "Completion",
    "ModelInfo",
    "ModelList",
    "Prefix",
    "PrefixDeleted",
    "ParsedFunction",
    "ParsedFunctionToolCall",
    "ParsedChatCompletionMessage",
    "ParsedChoice",
    "ParsedChatCompletion",
    "ResponseOutputText",
    "ResponseOutputItem",
    "ResponseUsage",
    "Response",
    "ResponseStreamEvent",
    "Embedding",
    "EmbeddingUsage",
    "CreateEmbeddingResponse",
]


class PromptTokensDetails(Model):
    """Breakdown of prompt tokens: ``cached_tokens`` were served from the prefix cache."""

    cached_tokens: int | None = None


class CompletionTokensDetails(Model):
    """Breakdown of completion tokens (``reasoning_tokens`` where a server reports them)."""

    reasoning_tokens: int | None = None


class CompletionUsage(Model):
    """Token counts of one request (tokens)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 when the server did not say)."""
        d = self.prompt_tokens_details
        return (d.cached_tokens or 0) if d is not None else 0


class _Completion(Model):
    """The fields every completion body and chunk has; subclasses give ``object`` and the type of
    ``choices``."""

    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    choices: list[Any] = Field(default_factory=list)
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class TopLogprob(Model):
    """One alternative token and its log-probability (natural log)."""

    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


class TokenLogprob(Model):
    """The sampled token, its log-probability and the ``top_logprobs`` alternatives."""

    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(Model):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class Function(Model):
    """The function a tool call invokes: ``arguments`` is a JSON text (as the model wrote it:
    parse it with ``json.loads`` and validate it before use)."""

    name: str = ""
    arguments: str = ""


class ChatCompletionMessageToolCall(Model):
    """One tool call of an assistant message (``type == "function"``)."""

    id: str = ""
    type: str = "function"
    function: Function = Field(default_factory=Function)


class _Message(Model):
    """The fields of an assistant message and of a stream delta; subclasses give the type of
    ``tool_calls`` (and the message its ``role``)."""

    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] | None = None


class ChatCompletionMessage(_Message):
    """The assistant's message: ``content``, or ``tool_calls`` (``finish_reason ==
    "tool_calls"``), or a ``refusal``."""

    role: str = "assistant"
    tool_calls: list[ChatCompletionMessageToolCall] | None = None


class Choice(Model):
    """One of the ``n`` answers; ``finish_reason`` is ``"stop"``, ``"length"``, ..."""

    index: int = 0
    message: ChatCompletionMessage = Field(default_factory=ChatCompletionMessage)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Completion):
    """Result of ``chat.completions.create`` (``object == "chat.completion"``)."""

    object: str = "chat.completion"
    choices: list[Choice] = Field(default_factory=list)


class ChoiceDeltaToolCallFunction(Model):
    """A fragment of a streamed tool call's function: ``name`` on its first fragment, then
    pieces of the ``arguments`` JSON text to concatenate."""

    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(Model):
    """A fragment of the tool call number ``index`` (``id`` and ``type`` on its first one)."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    function: ChoiceDeltaToolCallFunction | None = None


class ChoiceDelta(_Message):
    """What one stream chunk adds: text (and the role, on the first chunk) or tool-call
    fragments."""

    tool_calls: list[ChoiceDeltaToolCall] | None = None


class ChunkChoice(Model):
    """One choice's delta in a stream chunk; ``finish_reason`` set on its last chunk."""

    index: int = 0
    delta: ChoiceDelta = Field(default_factory=ChoiceDelta)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Completion):
    """One SSE chunk of a streamed chat completion (``object == "chat.completion.chunk"``).

    With ``stream_options={"include_usage": True}`` the last chunk has empty ``choices`` and
    the ``usage``.
    """

    object: str = "chat.completion.chunk"
    choices: list[ChunkChoice] = Field(default_factory=list)


class CompletionLogprobs(Model):
    """Legacy completions logprobs (parallel lists, one entry per token)."""

    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


class CompletionChoice(Model):
    """One answer of ``completions.create``."""

    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Completion):
    """Result (or, streamed, one chunk) of ``completions.create`` (``"text_completion"``)."""

    object: str = "text_completion"
    choices: list[CompletionChoice] = Field(default_factory=list)


class ModelInfo(Model):
    """One served model (``object == "model"``); ``id`` is the name to pass as ``model``."""

    id: str = ""
    object: str = "model"
    created: int = 0
    owned_by: str = ""


class ModelList(Model):
    """Result of ``models.list``; iterable over its ``data``."""

    object: str = "list"
    data: list[ModelInfo] = Field(default_factory=list)

    def __iter__(self) -> Iterator[ModelInfo]:  # type: ignore[override]
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class Prefix(Model):
    """A registered, pinned prompt prefix (prefixgate's ``POST /v1/prefixes``).

    ``prompt_tokens`` is the prefix length in tokens, ``expires_at`` the Unix time (seconds)
    after which the server may drop it.
    """

    id: str = ""
    object: str = "prefix"
    model: str | None = None
    prompt_tokens: int = 0
    expires_at: float | None = None


class PrefixDeleted(Model):
    """Result of ``prefixes.delete``."""

    id: str = ""
    object: str = "prefix.deleted"
    deleted: bool = True


ResponseFormatT = TypeVar("ResponseFormatT")


class ParsedFunction(Function):
    """A tool call's function with ``parsed_arguments``: the arguments decoded, for a tool
    declared ``strict`` (else None)."""

    parsed_arguments: Any = None


class ParsedFunctionToolCall(ChatCompletionMessageToolCall):
    """A tool call of ``chat.completions.parse``."""

    function: ParsedFunction = Field(default_factory=ParsedFunction)


class ParsedChatCompletionMessage(ChatCompletionMessage, Generic[ResponseFormatT]):
    """The message of ``chat.completions.parse``: ``parsed`` is the content validated by the
    ``response_format`` model (None on a refusal or a tool call)."""

    parsed: ResponseFormatT | None = None
    tool_calls: list[ParsedFunctionToolCall] | None = None  # type: ignore[assignment]


class ParsedChoice(Choice, Generic[ResponseFormatT]):
    """A choice of ``chat.completions.parse``."""

    message: ParsedChatCompletionMessage[ResponseFormatT] = Field(
        default_factory=ParsedChatCompletionMessage
    )


class ParsedChatCompletion(ChatCompletion, Generic[ResponseFormatT]):
    """Result of ``chat.completions.parse``: ``choices[i].message.parsed``."""

    choices: list[ParsedChoice[ResponseFormatT]] = Field(default_factory=list)  # type: ignore[assignment]


class ResponseOutputText(Model):
    """A content part of a Responses output message (``type == "output_text"``)."""

    type: str = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)


class ResponseOutputItem(Model):
    """One item of ``Response.output``: a ``message`` (``role``, ``status``, ``content``
    parts); other item types keep their fields as attributes (``Model``)."""

    id: str = ""
    type: str = "message"
    role: str | None = None
    status: str | None = None
    content: list[ResponseOutputText] | None = None


class ResponseUsage(Model):
    """A response's usage (tokens): ``input_tokens`` (``input_tokens_details.cached_tokens``
    from the prefix cache), ``output_tokens``, ``total_tokens``."""

    input_tokens: int = 0
    input_tokens_details: PromptTokensDetails | None = None
    output_tokens: int = 0
    output_tokens_details: CompletionTokensDetails | None = None
    total_tokens: int = 0


class Response(Model):
    """Result of ``responses.create`` (``object == "response"``); ``status`` is
    ``completed``, ``incomplete`` (``incomplete_details.reason``: ``max_output_tokens``) or
    ``failed``; ``output_text`` joins the text of its output messages."""

    id: str = ""
    object: str = "response"
    created_at: float = 0
    model: str = ""
    status: str | None = None
    output: list[ResponseOutputItem] = Field(default_factory=list)
    instructions: str | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: ResponseUsage | None = None

    @property
    def output_text(self) -> str:
        """Every ``output_text`` part of the ``message`` items, joined (openai-python's)."""
        return "".join(
            part.text
            for item in self.output
            if item.type == "message"
            for part in item.content or []
            if part.type == "output_text"
        )


class ResponseStreamEvent(Model):
    """One event of ``responses.create(stream=True)``: ``type`` (``response.created``,
    ``response.output_text.delta`` ..., ``response.completed`` / ``response.incomplete`` /
    ``response.failed``), ``sequence_number``; ``delta`` on text deltas, ``response`` on the
    whole-response events; the other fields of each type stay attributes (``Model``)."""

    type: str = ""
    sequence_number: int = 0
    delta: str | None = None
    response: Response | None = None


class Embedding(Model):
    """One input's embedding: floats, or base64 text with ``encoding_format="base64"``
    (little-endian float32)."""

    object: str = "embedding"
    index: int = 0
    embedding: list[float] | str = Field(default_factory=list)


class EmbeddingUsage(Model):
    """An embeddings call's usage (tokens)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class CreateEmbeddingResponse(Model):
    """Result of ``embeddings.create``: ``data[i]`` is input ``i``'s ``Embedding``."""

    object: str = "list"
    data: list[Embedding] = Field(default_factory=list)
    model: str = ""
    usage: EmbeddingUsage | None = None
