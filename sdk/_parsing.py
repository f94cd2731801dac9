"""``chat.completions.parse``: a Python type as ``response_format``, the answer validated by it.

As openai-python's ``.parse()``: a pydantic model (or any type pydantic can validate: a
dataclass, a TypedDict) becomes ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict": true}}`` with the schema made *strict* (OpenAI's structured-outputs rules: every
object closed with ``additionalProperties: false`` and all its properties required, ``null``
defaults dropped); the answer's content is validated by the type into ``message.parsed``. A
choice cut at the length limit raises ``LengthFinishReasonError`` (its JSON is incomplete), a
filtered one ``ContentFilterFinishReasonError``; a refusal leaves ``parsed`` None. Tool calls of
tools declared ``"strict": true`` get ``function.parsed_arguments`` (the decoded JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from .errors import ContentFilterFinishReasonError, LengthFinishReasonError
from .types import ChatCompletion, ParsedChatCompletion

__all__ = ["response_format_param", "strict_json_schema", "parse_chat_completion"]


def response_format_param(response_format: Any) -> dict[str, Any]:
    """The wire ``response_format`` for a mapping (sent as is) or a type (strict json_schema).

    Raises:
        TypeError: a type pydantic cannot describe as a JSON schema.
    """
    if isinstance(response_format, Mapping):
        return dict(response_format)
    if not isinstance(response_format, type):
        raise TypeError(
            "response_format must be a pydantic model class (or a type pydantic can validate) "
            f"or a response_format dict, got {response_format!r}"
        )
    try:
        if issubclass(response_format, pydantic.BaseModel):
            schema = response_format.model_json_schema()
        else:
            schema = pydantic.TypeAdapter(response_format).json_schema()
    except (pydantic.PydanticUserError, pydantic.errors.PydanticSchemaGenerationError) as exc:
        raise TypeError(f"cannot build a JSON schema for {response_format!r}: {exc}") from exc
    return {
        "type": "json_schema",
        "json_schema": {
            "name": response_format.__name__,
            "schema": strict_json_schema(schema),
            "strict": True,
        },
    }


def strict_json_schema(schema: Any) -> Any:
    """A copy of ``schema`` under OpenAI's strict rules (see the module docstring).

    Walks ``properties``, ``items``, ``anyOf`` / ``oneOf`` / ``allOf``, ``$defs`` and
    ``definitions``; an ``allOf`` of one schema is merged into its parent.
    """
    if isinstance(schema, list):
        return [strict_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_json_schema(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_json_schema(s) for name, s in out[key].items()}
    if "properties" in out or (out.get("type") == "object" and "additionalProperties" not in out):
        # a model's object: closed, every property required (a ``dict[str, X]`` field, an
        # object with an ``additionalProperties`` schema and no properties, is left open)
        out["additionalProperties"] = False
        out["required"] = list(out.get("properties", {}))
    if "default" in out and out["default"] is None:
        del out["default"]
    all_of = out.get("allOf")
    if isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict):
        del out["allOf"]
        out = {**all_of[0], **out}
    return out


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "allOf", "additionalProperties", "not"})


def parse_chat_completion(
    completion: ChatCompletion,
    response_format: Any,
    tools: Sequence[Mapping[str, Any]] | None,
) -> ParsedChatCompletion[Any]:
    """``completion`` with ``message.parsed`` and tool calls' ``parsed_arguments`` filled.

    Raises:
        LengthFinishReasonError: a choice ended with ``finish_reason == "length"``.
        ContentFilterFinishReasonError: a choice ended with ``"content_filter"``.
        pydantic.ValidationError: content that does not validate against the type.
    """
    strict_tools = {
        t["function"]["name"]
        for t in tools or ()
        if isinstance(t, Mapping)
        and isinstance(t.get("function"), Mapping)
        and t["function"].get("strict") is True
    }
    choices = []
    for choice in completion.choices:
        if choice.finish_reason == "length":
            raise LengthFinishReasonError(completion=completion)
        if choice.finish_reason == "content_filter":
            raise ContentFilterFinishReasonError(completion=completion)
        message = choice.message.to_dict()
        if (
            isinstance(response_format, type)
            and choice.message.content
            and not choice.message.refusal
        ):
            message["parsed"] = _validate(response_format, choice.message.content)
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            if function.get("name") in strict_tools:
                function["parsed_arguments"] = json.loads(function.get("arguments") or "null")
        choices.append({**choice.to_dict(), "message": message})
    data = {**completion.to_dict(), "choices": choices}
    return ParsedChatCompletion[Any].model_validate(data)


def _validate(tp: type, content: str) -> Any:
    if issubclass(tp, pydantic.BaseModel):
        return tp.model_validate_json(content)
    return pydantic.TypeAdapter(tp).validate_json(content)
