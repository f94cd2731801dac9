"""A small base for typed API results: slotted dataclasses built from JSON, unknown fields kept.

``Model.from_dict(data)`` converts nested dicts/lists into the declared field types (a field
typed ``Usage | None`` becomes a ``Usage``, ``list[Choice]`` a list of ``Choice``); scalars are
taken as sent (no validation: any OpenAI-compatible server's values pass through). Keys that
the class does not declare land in ``model_extra`` and stay readable as attributes, so a newer
server's fields are never lost (the pydantic ``extra="allow"`` convention of openai-python).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Self

__all__ = ["Model"]

_HINTS: dict[type, dict[str, Any]] = {}


@dataclasses.dataclass(slots=True, kw_only=True)
class Model:
    """Base of every typed result; subclasses are ``@dataclass(slots=True, kw_only=True)``."""

    model_extra: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: serve fields the class does not declare.
        try:
            extra = object.__getattribute__(self, "model_extra")
        except AttributeError:
            raise AttributeError(name) from None
        if name in extra:
            return extra[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build an instance from decoded JSON.

        Raises:
            TypeError: ``data`` is not a mapping.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__} expects a JSON object, got {type(data).__name__}")
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in hints and key != "model_extra":
                kwargs[key] = _convert(hints[key], value)
            else:
                extra[key] = value
        return cls(model_extra=extra, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: declared fields (``None`` ones dropped) plus the unknown fields."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "model_extra":
                continue
            value = _dump(getattr(self, f.name))
            if value is not None:
                out[f.name] = value
        out.update(self.model_extra)
        return out


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _convert(tp: Any, value: Any) -> Any:
    """Convert ``value`` to the annotated type ``tp`` where it holds nested models."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            converted = _convert(arg, value)
            if converted is not value or not _is_model(arg):
                return converted
        return value
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, list):
            return [_convert(arg, v) for v in value]
        return value
    if _is_model(tp) and isinstance(value, Mapping):
        return tp.from_dict(value)
    return value


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Model)


def _dump(value: Any) -> Any:
    if isinstance(value, Model):
        return value.to_dict()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value
