"""A model's shape check that stops at each container's first bad item: errors bounded by the
schema, not by the value.

pydantic validates every item of a list and keeps one error per bad item: an upstream answer
of a million numbers where choices belong (2 MB) made a million errors, ~400 bytes each in
pydantic-core and ~1 KB more each as Python dicts, 1.3 GB and 9 s of the proxy's event loop; a
60 MB one had the proxy killed for memory (Intel Xeon, 2 vCPUs, 7 December 2026).
``first_fault_validator(model, optional)`` validates ``model``'s own schema with ``fail_fast``
on every list, tuple, set and dict: a few errors, whatever the value's size.

It checks a shape only: its models build stand-in objects (pydantic-core reuses a model
class's prebuilt validator, so each model's ``cls`` is swapped for a plain class to get one
with the changed schema), so it serves models without validators of their own, whose parsed
value is not used (``proxy/answers.py``). ``optional`` names fields that may be missing at any
depth (an upstream may leave out ``logprobs``, ``usage``, ...): they default to None when
absent and are still checked when present, so a missing one is no error and cannot stop the
check before a later item's real fault.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic import BaseModel
from pydantic_core import SchemaValidator

_CONTAINERS = frozenset(("list", "tuple", "set", "frozenset", "dict"))


class _Shape:
    """What a checked model's value is built as (never read)."""


@functools.cache
def first_fault_validator(
    model: type[BaseModel], optional: frozenset[str] = frozenset()
) -> SchemaValidator:
    """A validator of ``model``'s shape stopping at each container's first bad item, the fields
    named in ``optional`` defaulting to None when absent (cached per model and set).

    Raises:
        TypeError: ``model`` has validators of its own (they would see stand-in objects).
    """
    if model.__pydantic_decorators__.model_validators or any(
        m.__pydantic_decorators__.field_validators or m.__pydantic_decorators__.model_validators
        for m in _models(model)
    ):
        raise TypeError(f"{model.__name__} has validators: its shape cannot be checked alone")
    schema = copy.deepcopy(model.__pydantic_core_schema__)
    _fail_fast(schema, optional)
    return SchemaValidator(schema)


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Every model class ``model``'s schema names (itself included)."""
    found: list[type[BaseModel]] = []
    stack: list[Any] = [model.__pydantic_core_schema__]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            cls = node.get("cls")
            if node.get("type") == "model" and isinstance(cls, type) and cls not in found:
                found.append(cls)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return found


def _fail_fast(schema: Any, optional: frozenset[str]) -> None:
    """In ``schema`` (walked without recursion): ``fail_fast`` on every container, each model's
    class the stand-in, each required model field named in ``optional`` given a None default."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if not isinstance(kind, str):  # a key named "type" in some metadata, not a schema
            kind = None
        if kind in _CONTAINERS:
            node["fail_fast"] = True
        elif kind == "model":
            node["cls"] = _Shape
        elif kind == "model-fields" and optional:
            for name, field in node.get("fields", {}).items():
                inner = field.get("schema", {})
                if name in optional and inner.get("type") != "default":
                    field["schema"] = {"type": "default", "schema": inner, "default": None}
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
