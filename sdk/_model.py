"""The base of every typed API result: a pydantic model that keeps fields it does not declare.

As openai-python's results: ``model_dump()`` / ``model_dump_json()`` (pydantic's), ``to_dict()`` /
``to_json()`` (the wire form: only the fields the server sent, openai-python's defaults), and
``extra="allow"``: keys a class does not declare land in ``model_extra`` and stay readable as
attributes, so a newer server's fields are never lost. Every declared field has a default, so a
partial body from any OpenAI-compatible server still parses; a value of the wrong type is a
``pydantic.ValidationError`` (a ``ValueError``), which the client reports as
``APIResponseValidationError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import pydantic

__all__ = ["Model"]


class Model(pydantic.BaseModel):
    """Base of every typed result."""

    model_config = pydantic.ConfigDict(extra="allow", protected_namespaces=(), defer_build=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Build an instance from decoded JSON (``model_validate`` of a mapping).

        Raises:
            TypeError: ``data`` is not a mapping.
            pydantic.ValidationError: a field of the wrong type.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__} expects a JSON object, got {type(data).__name__}")
        return cls.model_validate(data)

    def to_dict(self, *, exclude_unset: bool = True, exclude_none: bool = False) -> dict[str, Any]:
        """The JSON form as a dict: by default only the fields the server sent (as sent)."""
        return self.model_dump(mode="json", exclude_unset=exclude_unset, exclude_none=exclude_none)

    def to_json(self, *, indent: int | None = 2, exclude_unset: bool = True) -> str:
        """The JSON form as text (see ``to_dict``)."""
        return self.model_dump_json(indent=indent, exclude_unset=exclude_unset)
