"""``client.models`` of the blocking ``Client`` (see ``models.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._blocking import Bridge, RawMethods
from .._options import Timeout
from ..types import ModelInfo, ModelList
from ._common import call_args
from .models import AsyncModels

__all__ = ["SyncModels"]


class SyncModels:
    """``client.models`` (see ``AsyncModels``)."""

    def __init__(self, models: AsyncModels, bridge: Bridge) -> None:
        self._async = models
        self._bridge = bridge
        self.with_raw_response = RawMethods(bridge, models, ("list", "retrieve"), False)
        self.with_streaming_response = RawMethods(bridge, models, ("list", "retrieve"), True)

    def list(
        self,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> ModelList:
        """Blocking ``AsyncModels.list``."""
        result: ModelList = self._bridge.run(self._async.list, **call_args(locals()))
        return result

    def retrieve(
        self,
        model: str,
        *,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
    ) -> ModelInfo:
        """Blocking ``AsyncModels.retrieve``."""
        result: ModelInfo = self._bridge.run(self._async.retrieve, **call_args(locals()))
        return result
