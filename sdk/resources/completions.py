"""``client.completions``: legacy text completions, ``POST /v1/completions``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from ..batch import run_batch
from ..streaming import AsyncStream
from ..types import Completion
from ._common import clean_body, require_str, split_options

if TYPE_CHECKING:
    from .._client import AsyncClient


class AsyncCompletions:
    """``client.completions``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | list[str] | list[int],
        stream: Literal[False] = False,
        **params: Any,
    ) -> Completion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: str | list[str] | list[int],
        stream: Literal[True],
        **params: Any,
    ) -> AsyncStream[Completion]: ...

    async def create(
        self,
        *,
        model: str,
        prompt: str | list[str] | list[int],
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        echo: bool | None = None,
        stream_options: Mapping[str, Any] | None = None,
        user: str | None = None,
        **params: Any,
    ) -> Completion | AsyncStream[Completion]:
        """Complete ``prompt`` (text, list of texts, or token ids).

        ``stream=True`` returns an ``AsyncStream[Completion]`` of chunks. ``params``: further
        body fields or ``RequestOptions`` keywords (see ``chat.completions.create``).

        Raises:
            TypeError: bad ``model`` or ``prompt`` type (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", model)
        if not isinstance(prompt, (str, list)):
            raise TypeError(f"prompt must be a str or a list, got {type(prompt).__name__}")
        params, options = split_options(params)
        body = clean_body(
            dict(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                n=n,
                stop=stop,
                seed=seed,
                logprobs=logprobs,
                echo=echo,
                stream_options=stream_options,
                user=user,
                **params,
            )
        )
        if stream:
            body["stream"] = True
        return await self._client.request(
            "POST",
            "completions",
            body=body,
            cast=Completion.from_dict,
            stream=stream,
            options=options,
        )

    async def batch(
        self, requests: Sequence[Mapping[str, Any]], *, progress: bool = False
    ) -> list[Completion | Exception]:
        """Like ``chat.completions.batch`` for ``create(**request)`` of this resource."""
        return await run_batch(
            self._non_stream_create,
            requests,
            workers=self._client.max_concurrency,
            progress=progress,
            desc="completions",
        )

    async def _non_stream_create(self, **request: Any) -> Completion:
        if request.get("stream"):
            raise ValueError("batch() requests cannot stream: drop stream=True")
        return await self.create(**request)
