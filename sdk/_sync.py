"""``Client``: the blocking twin of ``AsyncClient``, same surface, same behaviour.

It runs an ``AsyncClient`` on an event loop in a daemon thread (an anyio blocking portal,
``_blocking.Bridge``, started on the first call) and calls into it, so limits, retries,
streaming and batches behave exactly as in the async client; several threads may share one
``Client`` (its concurrency limit is then shared too). Streams come back as ``SyncStream``
(iterator + context manager). Used as openai-python's client is: ``Client().models.list()``
as a temporary, or never closed (the pool and thread are released when the last of the
client, its copies, resources and streams is collected, or at exit, with a
``ResourceWarning``); inside a running event loop a call raises ``RuntimeError`` naming
``AsyncClient``.
Its resources (``resources/*_sync.py``, beside their async twins) have every async method's
parameters, spelled out (see the async twin for their meaning).
"""

from __future__ import annotations

import inspect
from typing import Self, Unpack

from ._blocking import Bridge, SyncAPIResponse, SyncResponseContextManager, SyncStream
from ._client import AsyncClient, ClientOptions, CopyOptions
from .resources.chat_sync import SyncChat, SyncChatCompletions
from .resources.completions_sync import SyncCompletions
from .resources.embeddings_sync import SyncEmbeddings
from .resources.models_sync import SyncModels
from .resources.prefixes_sync import SyncPrefixes, SyncPrefixSession
from .resources.responses_sync import SyncResponses

__all__ = [
    "Client",
    "SyncAPIResponse",
    "SyncChat",
    "SyncChatCompletions",
    "SyncCompletions",
    "SyncEmbeddings",
    "SyncModels",
    "SyncPrefixSession",
    "SyncPrefixes",
    "SyncResponseContextManager",
    "SyncResponses",
    "SyncStream",
]


class Client:
    """Blocking client; takes exactly ``AsyncClient``'s arguments (see there).

    ``close()`` (or ``with Client(...) as client``) closes its pool and stops its thread at
    once; otherwise they go when the client is collected or the interpreter exits.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        async_client = AsyncClient(base_url, api_key, **options)
        self._bind(async_client, Bridge(async_client.close), owner=True)

    def _bind(self, async_client: AsyncClient, bridge: Bridge, *, owner: bool) -> None:
        self._owner = owner  # closing stops the thread and the pool (not for a copy)
        self._async = async_client
        self._bridge = bridge
        self.base_url = async_client.base_url
        self.api_key = async_client.api_key
        self.chat = SyncChat(async_client.chat.completions, bridge)
        self.completions = SyncCompletions(async_client.completions, bridge)
        self.models = SyncModels(async_client.models, bridge)
        self.prefixes = SyncPrefixes(async_client.prefixes, bridge)
        self.responses = SyncResponses(async_client.responses, bridge)
        self.embeddings = SyncEmbeddings(async_client.embeddings, bridge)
        self._closed = False

    @property
    def async_client(self) -> AsyncClient:
        """The wrapped ``AsyncClient`` (lives on the background loop)."""
        return self._async

    def with_options(self, **changes: Unpack[CopyOptions]) -> Client:
        """A copy with some options changed (see ``AsyncClient.with_options``); it shares this
        client's thread, pool and limits, and closing it leaves them open."""
        new = object.__new__(Client)
        new._bind(self._async.with_options(**changes), self._bridge, owner=False)
        return new

    copy = with_options

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool and stop the background thread (idempotent; a
        ``with_options`` copy closes nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            self._bridge.close()


# At run time both take exactly AsyncClient's parameters, spelled out for inspect and help.
Client.__init__.__signature__ = inspect.signature(AsyncClient.__init__)  # type: ignore[attr-defined]
Client.with_options.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    AsyncClient.with_options
).replace(return_annotation="Client")
