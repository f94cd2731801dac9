"""``client.models``: the served models (``GET /v1/models``)."""

from __future__ import annotations

from typing import Unpack

from .._options import CallOptions, split_call
from ..types import ModelInfo, ModelList
from ._common import APIResource, path_part, require_str, takes

__all__ = ["AsyncModels"]


class AsyncModels(APIResource):
    """``client.models``."""

    raw_methods = streamed_methods = ("list", "retrieve")

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
