"""``client.models``: the served models (``GET /v1/models``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..types import ModelInfo, ModelList
from ._common import only_options, path_part, require_str

if TYPE_CHECKING:
    from .._client import AsyncClient


class AsyncModels:
    """``client.models``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self, **options: Any) -> ModelList:
        """The models the server serves (``GET /v1/models``); ``options``: ``RequestOptions``."""
        opts = only_options(options)
        return await self._client.request("GET", "models", cast=ModelList.from_dict, options=opts)

    async def retrieve(self, model: str, **options: Any) -> ModelInfo:
        """One model (``GET /v1/models/{model}``).

        Raises:
            NotFoundError: unknown model.
        """
        require_str("model", model)
        opts = only_options(options)
        return await self._client.request(
            "GET",
            f"models/{path_part(model, keep_slashes=True)}",
            cast=ModelInfo.from_dict,
            options=opts,
        )
