"""API resources of ``AsyncClient``: ``chat.completions``, ``completions``, ``models``,
``prefixes``. They depend on ``_options`` (never on the client module): the client imports
them, not the other way round. Each ``*_sync.py`` beside an async resource is its blocking
twin for ``Client`` (built on ``_blocking``, imported by ``_sync``)."""

from .chat import AsyncChat, AsyncChatCompletions
from .completions import AsyncCompletions
from .models import AsyncModels
from .prefixes import AsyncPrefixes, PrefixSession

__all__ = [
    "AsyncChat",
    "AsyncChatCompletions",
    "AsyncCompletions",
    "AsyncModels",
    "AsyncPrefixes",
    "PrefixSession",
]
