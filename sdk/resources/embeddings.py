"""``client.embeddings``: ``POST /v1/embeddings``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypedDict, Unpack

from .._options import BodyCallOptions, split_call
from ..types import CreateEmbeddingResponse
from ._common import APIResource, require_str, takes

__all__ = ["AsyncEmbeddings", "EmbeddingCreateParams", "EmbeddingRequired"]


class EmbeddingRequired(TypedDict):
    """The keywords an embeddings call cannot do without."""

    input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
    model: str


class EmbeddingCreateParams(EmbeddingRequired, BodyCallOptions, total=False):
    """The keywords of ``embeddings.create`` (async and blocking), openai-python's."""

    dimensions: int | None
    encoding_format: Literal["float", "base64"] | None
    user: str | None


class AsyncEmbeddings(APIResource):
    """``client.embeddings``."""

    raw_methods = streamed_methods = ("create",)

    @takes(EmbeddingCreateParams)
    async def create(self, **params: Unpack[EmbeddingCreateParams]) -> CreateEmbeddingResponse:
        """Embed ``input``: a string, a list of strings, a list of token ids, or a list of
        token-id lists (one embedding each, ``data[i]`` for input ``i``).

        ``encoding_format`` unset or ``"float"``: lists of floats; ``"base64"``: the server's
        base64 text (little-endian float32), as it came. The server is one started for
        embeddings (a generation model answers 400).

        Raises:
            TypeError: a ``model`` that is not a non-empty str, an ``input`` that is neither a
                str nor a list, an unknown keyword (nothing is sent).
            APIStatusError, APIConnectionError, APITimeoutError: see ``AsyncClient.request``.
        """
        require_str("model", params["model"])
        given = params["input"]
        if isinstance(given, bytes) or not isinstance(given, (str, Sequence)):
            raise TypeError(f"input must be a str or a list, got {type(given).__name__}")
        body, options = split_call(params)
        body["input"] = (
            given
            if isinstance(given, str)
            else [x if isinstance(x, (str, int)) else list(x) for x in given]
        )
        result: CreateEmbeddingResponse = await self._client.request(
            "POST",
            "embeddings",
            body=body,
            cast=CreateEmbeddingResponse.model_validate,
            options=options,
        )
        return result
