"""API resources of ``AsyncClient``: ``chat.completions``, ``completions``, ``models``,
``prefixes``. They depend on ``_options`` (never on the client module): the client imports
them, not the other way round."""

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
