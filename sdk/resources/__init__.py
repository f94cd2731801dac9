"""API resources of ``AsyncClient``: ``chat.completions``, ``completions``, ``models``,
``prefixes``, ``responses``, ``embeddings``. They depend on ``_options`` (never on the client module): the client imports
them, not the other way round. Each ``*_sync.py`` beside an async resource is its blocking
twin for ``Client`` (built on ``_blocking``, imported by ``_sync``). Each endpoint's
parameters are stated once, as a TypedDict beside its async resource (``*CreateParams``, as
openai-python's ``*_create_params``), and both twins take them (``_common.takes``)."""

from .chat import (
    AsyncChat,
    AsyncChatCompletions,
    ChatCompletionCreateParams,
    ChatCompletionParseParams,
)
from .completions import AsyncCompletions, CompletionCreateParams
from .embeddings import AsyncEmbeddings, EmbeddingCreateParams
from .models import AsyncModels
from .prefixes import AsyncPrefixes, PrefixCreateParams, PrefixSession
from .responses import AsyncResponses, ResponseCreateParams

__all__ = [
    "AsyncChat",
    "AsyncChatCompletions",
    "AsyncCompletions",
    "AsyncEmbeddings",
    "AsyncModels",
    "AsyncPrefixes",
    "AsyncResponses",
    "ChatCompletionCreateParams",
    "ChatCompletionParseParams",
    "CompletionCreateParams",
    "EmbeddingCreateParams",
    "PrefixCreateParams",
    "PrefixSession",
    "ResponseCreateParams",
]
