"""Request bodies of vLLM's ``/tokenize`` and ``/detokenize`` and OpenAI's ``/v1/embeddings``,
one definition for both modes: local mode validates every body with them
(``local/tokenize.py``, ``local/embeddings.py``); upstream mode forwards a served model's body
as sent (the upstream judges it, as on chat) and validates it with them only where local mode
names a defect before the model: a body beside a model nobody serves, an embeddings body
without a model (``proxy/token_relay.py``), so one body gets one answer in both modes.

Fields as vLLM's (``TokenizeRequest`` / ``DetokenizeRequest``) and OpenAI's
(https://platform.openai.com/docs/api-reference/embeddings): strict types, an unknown field is
a 400 naming it (``request_models.parse``).
"""

from __future__ import annotations

from typing import Any, Literal

from prefixgate.gateway.http.json_guard import MAX_MESSAGES, MAX_TOOLS
from prefixgate.gateway.wire.request_models import ChatMessage
from pydantic import BaseModel, ConfigDict, Field


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of ``messages`` (a chat) and ``prompt`` (text); ``model``
    optional (the served model)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    prompt: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text; ``model`` optional (the served model)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: ``input`` a string, strings, token ids or lists of token ids;
    ``model`` required, as OpenAI's."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
