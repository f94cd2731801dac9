"""JSON schemas and tools that several structured-output and tool-calling tests share, on
aidreams-260k (small bounds, so a tiny model finishes an answer within a few dozen tokens).

Plain dicts: a test must not mutate them (copy first)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": -3, "maximum": 42},
        "ok": {"type": "boolean"},
        "in": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
        "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["c", "n", "ok", "in", "t"],
    "additionalProperties": False,
}
"""Enum, bounded integer, boolean, a nested object and a bounded array, all required."""

FLAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["c", "n", "ok"],
    "additionalProperties": False,
}
"""Three required keys (enum, one-digit integer, boolean): the shortest answer of a kind."""

TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
"""``get_time``'s parameters: one enum."""

TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": TIME_PARAMS},
}
"""The ``get_time`` tool (not strict), as a chat request's ``tools`` entry."""


def weather_tool(
    city_max_length: int, description: str | None = None, strict: bool = False
) -> dict[str, Any]:
    """The ``get_weather`` tool as a chat request's ``tools`` entry: a ``city`` string of at
    most ``city_max_length`` characters and a ``unit`` (``c`` / ``f``), both required; with
    its ``description`` and ``strict: true`` when given (key order as the API documents)."""
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": city_max_length},
            "unit": {"enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    function: dict[str, Any] = {"name": "get_weather"}
    if description is not None:
        function["description"] = description
    function["parameters"] = params
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


STRICT_WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
"""``get_weather``'s parameters for the strict-tool tests: a bounded string, an enum, a
bounded integer."""

PET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
"""A pet: a bounded string, an enum, a bounded integer, all required (strict)."""


class Pet(BaseModel):
    """``PET_SCHEMA``'s fields as a pydantic model (for clients given a model class)."""

    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)
