"""Engine error types.

Every error a caller can provoke with bad input is a ``ValueError`` or ``TypeError`` subclass, so
``except ValueError`` catches them and the gateway can map them to an OpenAI ``invalid_request``
error object.
"""

from __future__ import annotations


class PinLimitError(ValueError):
    """A prefix pin would hold more KV blocks than ``max_pinned_fraction`` of the cache allows."""


class CacheCapacityError(ValueError):
    """A request could never fit in the KV cache, even alone (prompt + max_tokens over capacity)."""


class PrefixCachingDisabledError(ValueError):
    """A prefix-cache operation (e.g. ``pin``) was asked of an engine with prefix caching off."""


class UnsupportedFieldError(ValueError):
    """A request field this engine cannot honour; ``param`` names it as the OpenAI API does
    (the gateway's 400 carries it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine was shut down (or its step loop died) while the request was in flight, or a
    call came after ``shutdown()``."""
