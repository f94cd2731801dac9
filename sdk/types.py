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
from dataclasses import dataclass, field
from typing import Any

from ._model import Model

__all__ = [
    "Model",
    "PromptTokensDetails",
    "CompletionTokensDetails",
    "CompletionUsage",
    "TopLogprob",
    "TokenLogprob",
    "ChoiceLogprobs",
    "ChatCompletionMessage",
    "Choice",
    "ChatCompletion",
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
]

_dc = dataclass(slots=True, kw_only=True)


@_dc
class PromptTokensDetails(Model):
    """Breakdown of prompt tokens: ``cached_tokens`` were served from the prefix cache."""

    cached_tokens: int | None = None


@_dc
class CompletionTokensDetails(Model):
    """Breakdown of completion tokens (``reasoning_tokens`` where a server reports them)."""

    reasoning_tokens: int | None = None


@_dc
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


@_dc
class TopLogprob(Model):
    """One alternative token and its log-probability (natural log)."""

    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


@_dc
class TokenLogprob(Model):
    """The sampled token, its log-probability and the ``top_logprobs`` alternatives."""

    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@_dc
class ChoiceLogprobs(Model):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] | None = None


@_dc
class ChatCompletionMessage(Model):
    """The assistant's message."""

    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@_dc
class Choice(Model):
    """One of the ``n`` answers; ``finish_reason`` is ``"stop"``, ``"length"``, ..."""

    index: int = 0
    message: ChatCompletionMessage = field(default_factory=ChatCompletionMessage)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


@_dc
class ChatCompletion(Model):
    """Result of ``chat.completions.create`` (``object == "chat.completion"``)."""

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice] = field(default_factory=list)
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


@_dc
class ChoiceDelta(Model):
    """The text (and role, on the first chunk) added by one stream chunk."""

    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@_dc
class ChunkChoice(Model):
    """One choice's delta in a stream chunk; ``finish_reason`` set on its last chunk."""

    index: int = 0
    delta: ChoiceDelta = field(default_factory=ChoiceDelta)
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


@_dc
class ChatCompletionChunk(Model):
    """One SSE chunk of a streamed chat completion (``object == "chat.completion.chunk"``).

    With ``stream_options={"include_usage": True}`` the last chunk has empty ``choices`` and
    the ``usage``.
    """

    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = field(default_factory=list)
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


@_dc
class CompletionLogprobs(Model):
    """Legacy completions logprobs (parallel lists, one entry per token)."""

    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


@_dc
class CompletionChoice(Model):
    """One answer of ``completions.create``."""

    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


@_dc
class Completion(Model):
    """Result (or, streamed, one chunk) of ``completions.create`` (``"text_completion"``)."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = field(default_factory=list)
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


@_dc
class ModelInfo(Model):
    """One served model (``object == "model"``); ``id`` is the name to pass as ``model``."""

    id: str = ""
    object: str = "model"
    created: int = 0
    owned_by: str = ""


@_dc
class ModelList(Model):
    """Result of ``models.list``; iterable over its ``data``."""

    object: str = "list"
    data: list[ModelInfo] = field(default_factory=list)

    def __iter__(self) -> Iterator[ModelInfo]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


@_dc
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


@_dc
class PrefixDeleted(Model):
    """Result of ``prefixes.delete``."""

    id: str = ""
    object: str = "prefix.deleted"
    deleted: bool = True
