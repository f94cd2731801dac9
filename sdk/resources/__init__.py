"""API resources of ``AsyncClient``: ``chat.completions``, ``completions``, ``models``,
``prefixes``. They depend on ``_options`` (never on the client module): the client imports
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
from .models import AsyncModels
from .prefixes import AsyncPrefixes, PrefixCreateParams, PrefixSession

__all__ = [
    "AsyncChat",
    "AsyncChatCompletions",
    "AsyncCompletions",
    "AsyncModels",
    "AsyncPrefixes",
    "ChatCompletionCreateParams",
    "ChatCompletionParseParams",
    "CompletionCreateParams",
    "PrefixCreateParams",
    "PrefixSession",
]
