"""``client.models`` of the blocking ``Client`` (see ``models.py``)."""

from __future__ import annotations

from typing import Unpack

from .._blocking import SyncResource
from .._options import CallOptions
from ..types import ModelInfo, ModelList
from ._common import takes
from .models import AsyncModels

__all__ = ["SyncModels"]


class SyncModels(SyncResource[AsyncModels]):
    """``client.models`` (see ``AsyncModels``)."""

    @takes(CallOptions)
    def list(self, **options: Unpack[CallOptions]) -> ModelList:
        """Blocking ``AsyncModels.list``."""
        result: ModelList = self._bridge.run(self._async.list, **options)
        return result

    @takes(CallOptions)
    def retrieve(self, model: str, **options: Unpack[CallOptions]) -> ModelInfo:
        """Blocking ``AsyncModels.retrieve``."""
        result: ModelInfo = self._bridge.run(self._async.retrieve, model, **options)
        return result
