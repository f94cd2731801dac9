"""``client.completions`` of the blocking ``Client``: ``AsyncCompletions``'s methods with the
same parameters, run through the bridge (see ``completions.py`` for their meaning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from .._blocking import Bridge, RawMethods, SyncStream
from .._options import Timeout
from ..types import Completion
from ._common import call_args
from .completions import AsyncCompletions

__all__ = ["SyncCompletions"]


class SyncCompletions:
    """``client.completions`` (see ``AsyncCompletions``)."""

    def __init__(self, completions: AsyncCompletions, bridge: Bridge) -> None:
        self._async = completions
        self._bridge = bridge
        self.with_raw_response = RawMethods(bridge, completions, ("create",), False)
        self.with_streaming_response = RawMethods(bridge, completions, ("create",), True)

    @overload
    def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: Literal[False] = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion: ...

    @overload
    def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: Literal[True],
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> SyncStream[Completion]: ...

    @overload
    def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: bool = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion | SyncStream[Completion]: ...

    def create(
        self,
        *,
        model: str,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        stream: bool = False,
        best_of: int | None = None,
        echo: bool | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[str, float] | Mapping[int, float] | None = None,
        logprobs: int | None = None,
        max_tokens: int | None = None,
        n: int | None = None,
        presence_penalty: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream_options: Mapping[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_tokens: int | None = None,
        ignore_eos: bool | None = None,
        stop_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
        extra_query: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        timeout: Timeout | None = None,
        max_retries: int | None = None,
        idle_timeout: float | None = None,
    ) -> Completion | SyncStream[Completion]:
        """Blocking ``AsyncCompletions.create``."""
        result: Completion | SyncStream[Completion] = self._bridge.run(
            self._async.create, **call_args(locals())
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
