"""The one way a wire request becomes the engine's ``SamplingParams``.

Each dialect's request model says which of its fields mean which engine field (its own
``sampling_params`` method: ``request_models._SamplingFields`` for chat and completions,
``anthropic_models.MessagesRequest``, ``gemini_models.GenerationConfig``,
``responses_api.ResponsesRequest``); ``sampling_params`` here builds the engine's object and
turns its refusal into the dialect's 400 naming the wire field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.gateway.http.errors import bad_request
from pydantic import Field

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM and torch generators take
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
"""A request's ``seed`` in every dialect: an int64 (the wire model's 400 names the field; the
engine alone would take [-2**63, 2**64) and say so in its own words)."""
StopString = Annotated[str, Field(min_length=1)]
"""One item of a dialect's list of stop sequences: never empty (``[""]`` is a 400 naming the
item, in every dialect and on its count routes alike)."""


def sampling_params(
    fields: Mapping[str, Any],
    wire_names: Mapping[str, str],
    *,
    prefix: str = "",
) -> SamplingParams:
    """``SamplingParams(**fields)``, a field given as ``None`` left at the engine's default.

    Args:
        fields: engine field name → the value the request gives it (``None``: not given).
        wire_names: engine field name → the dialect's name of the field that set it (the
            400's ``param``; a field not named here is reported without one).
        prefix: the wire path of the object the fields sit in (Gemini's
            ``"generationConfig."``): put before the named field.

    Raises:
        APIError: 400 when the engine refuses a value; its message starts with the engine
            field's name, so ``param`` is that field's wire name.
    """
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        field = re.match(r"[a-z_]+", msg)
        wire = wire_names.get(field.group(0)) if field else None
        raise bad_request(msg, param=prefix + wire if wire else None) from None
