"""``client.models`` of the blocking ``Client`` (see ``models.py``)."""

from __future__ import annotations

from typing import Unpack

from .._blocking import Bridge, RawMethods
from .._options import CallOptions
from ..types import ModelInfo, ModelList
from ._common import takes
from .models import AsyncModels

__all__ = ["SyncModels"]


class SyncModels:
    """``client.models`` (see ``AsyncModels``)."""

    def __init__(self, models: AsyncModels, bridge: Bridge) -> None:
        self._async = models
        self._bridge = bridge
        self.with_raw_response = RawMethods(bridge, models, ("list", "retrieve"), False)
        self.with_streaming_response = RawMethods(bridge, models, ("list", "retrieve"), True)

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
