"""``client.embeddings`` of the blocking ``Client``: ``AsyncEmbeddings``'s method with the same
parameters (``EmbeddingCreateParams``, stated once in ``embeddings.py``), run through the
bridge."""

from __future__ import annotations

from typing import Unpack

from .._blocking import SyncResource
from ..types import CreateEmbeddingResponse
from ._common import takes
from .embeddings import AsyncEmbeddings, EmbeddingCreateParams

__all__ = ["SyncEmbeddings"]


class SyncEmbeddings(SyncResource[AsyncEmbeddings]):
    """``client.embeddings`` (see ``AsyncEmbeddings``)."""

    @takes(EmbeddingCreateParams)
    def create(self, **params: Unpack[EmbeddingCreateParams]) -> CreateEmbeddingResponse:
        """Blocking ``AsyncEmbeddings.create``."""
        result: CreateEmbeddingResponse = self._bridge.run(self._async.create, **params)
        return result
