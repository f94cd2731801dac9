"""``client.responses`` of the blocking ``Client``: ``AsyncResponses``'s method with the same
parameters (``ResponseCreateParams``, stated once in ``responses.py``), run through the
bridge."""

from __future__ import annotations

from typing import Literal, Unpack, overload

from .._blocking import SyncResource, SyncStream
from ..types import Response, ResponseStreamEvent
from ._common import takes
from .responses import AsyncResponses, ResponseCreateParams

__all__ = ["SyncResponses"]


class SyncResponses(SyncResource[AsyncResponses]):
    """``client.responses`` (see ``AsyncResponses``)."""

    @overload
    def create(
        self, *, stream: Literal[False] = False, **params: Unpack[ResponseCreateParams]
    ) -> Response: ...

    @overload
    def create(
        self, *, stream: Literal[True], **params: Unpack[ResponseCreateParams]
    ) -> SyncStream[ResponseStreamEvent]: ...

    @overload
    def create(
        self, *, stream: bool = False, **params: Unpack[ResponseCreateParams]
    ) -> Response | SyncStream[ResponseStreamEvent]: ...

    @takes(ResponseCreateParams)
    def create(
        self, *, stream: bool = False, **params: Unpack[ResponseCreateParams]
    ) -> Response | SyncStream[ResponseStreamEvent]:
        """Blocking ``AsyncResponses.create``."""
        result: Response | SyncStream[ResponseStreamEvent] = self._bridge.run(
            self._async.create, stream=stream, **params
        )
        return result
