"""``client.completions`` of the blocking ``Client``: ``AsyncCompletions``'s methods with the
same parameters (``CompletionCreateParams``, stated once in ``completions.py``), run through
the bridge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Unpack, overload

from .._blocking import SyncResource, SyncStream
from ..types import Completion
from ._common import takes
from .completions import AsyncCompletions, CompletionCreateParams

__all__ = ["SyncCompletions"]


class SyncCompletions(SyncResource[AsyncCompletions]):
    """``client.completions`` (see ``AsyncCompletions``)."""

    @overload
    def create(
        self, *, stream: Literal[False] = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion: ...

    @overload
    def create(
        self, *, stream: Literal[True], **params: Unpack[CompletionCreateParams]
    ) -> SyncStream[Completion]: ...

    @overload
    def create(
        self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion | SyncStream[Completion]: ...

    @takes(CompletionCreateParams)
    def create(
        self, *, stream: bool = False, **params: Unpack[CompletionCreateParams]
    ) -> Completion | SyncStream[Completion]:
        """Blocking ``AsyncCompletions.create``."""
        result: Completion | SyncStream[Completion] = self._bridge.run(
            self._async.create, stream=stream, **params
        )
        return result

    def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[Completion | Exception]:
        """Blocking ``AsyncCompletions.batch``."""
        result: list[Completion | Exception] = self._bridge.run(
            self._async.batch, requests, progress=progress
        )
        return result
