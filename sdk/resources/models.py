"""``client.models``: the served models (``GET /v1/models``)."""

from __future__ import annotations

from functools import cached_property
from typing import Unpack

from .._options import CallOptions, split_call
from .._response import to_raw_response_wrapper, to_streamed_response_wrapper
from ..types import ModelInfo, ModelList
from ._common import APIResource, path_part, require_str, takes

__all__ = ["AsyncModels", "AsyncModelsWithRawResponse", "AsyncModelsWithStreamingResponse"]


class AsyncModels(APIResource):
    """``client.models``."""

    @takes(CallOptions)
    async def list(self, **options: Unpack[CallOptions]) -> ModelList:
        """The models the server serves (``GET /v1/models``).

        Raises:
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        _, opts = split_call(options)
        result: ModelList = await self._client.request(
            "GET", "models", cast=ModelList.model_validate, options=opts
        )
        return result

    @takes(CallOptions)
    async def retrieve(self, model: str, **options: Unpack[CallOptions]) -> ModelInfo:
        """One model (``GET /v1/models/{model}``).

        Raises:
            TypeError: ``model`` is not a non-empty str.
            NotFoundError: unknown model.
        """
        require_str("model", model)
        _, opts = split_call(options)
        result: ModelInfo = await self._client.request(
            "GET",
            f"models/{path_part(model, keep_slashes=True)}",
            cast=ModelInfo.model_validate,
            options=opts,
        )
        return result

    @cached_property
    def with_raw_response(self) -> AsyncModelsWithRawResponse:
        """The same methods, returning an ``APIResponse`` (headers, status, ``parse()``)."""
        return AsyncModelsWithRawResponse(self)

    @cached_property
    def with_streaming_response(self) -> AsyncModelsWithStreamingResponse:
        """The same methods as ``async with`` blocks yielding an ``AsyncAPIResponse``."""
        return AsyncModelsWithStreamingResponse(self)


class AsyncModelsWithRawResponse:
    """``client.models.with_raw_response``."""

    def __init__(self, models: AsyncModels) -> None:
        self.list = to_raw_response_wrapper(models.list)
        self.retrieve = to_raw_response_wrapper(models.retrieve)


class AsyncModelsWithStreamingResponse:
    """``client.models.with_streaming_response``."""

    def __init__(self, models: AsyncModels) -> None:
        self.list = to_streamed_response_wrapper(models.list)
        self.retrieve = to_streamed_response_wrapper(models.retrieve)
