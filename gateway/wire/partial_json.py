"""The object a tool call's arguments hold, also when ``max_tokens`` cut them mid-JSON.

An Anthropic ``tool_use`` block's ``input`` and a Gemini ``functionCall``'s ``args`` are
objects, while the model writes JSON text that a length stop may end anywhere. Both dialects'
bodies and streams take the object from here, in both modes, so they give the same message: a
cut text keeps what the official ``anthropic`` package makes of the streamed
``input_json_delta`` fragments (``jiter.from_json(buf, partial_mode=True)``): every complete
member, the open objects and arrays closed, a member whose value (string, number, literal)
was cut dropped with its key.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"true": True, "false": False, "null": None}
_CUT = object()  # a scalar the text ended inside of


class _Text:
    """A cursor over the JSON text; ``ValueError`` on text that is wrong, not merely cut."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def skip(self) -> bool:
        """Skip white space; True while text is left."""
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1
        return self.i < len(self.s)

    def value(self) -> tuple[Any, bool]:
        """``(value, whole)``: a cut container comes back closed, a cut scalar as ``_CUT``."""
        if not self.skip():
            return _CUT, False
        c = self.s[self.i]
        if c == "{":
            return self.members()
        if c == "[":
            return self.items()
        if c == '"':
            return self.string()
        for word, val in _LITERALS.items():
            rest = self.s[self.i : self.i + len(word)]
            if rest == word:
                self.i += len(word)
                return val, True
            if word.startswith(rest) and self.i + len(rest) == len(self.s):
                self.i = len(self.s)
                return _CUT, False
        j = self.i
        while j < len(self.s) and self.s[j] in _NUMBER_CHARS:
            j += 1
        run = self.s[self.i : j]
        number = _NUMBER.fullmatch(run)
        if j == len(self.s):  # the number may go on: kept only when it reads as one
            self.i = j
            return (json.loads(run) if number else _CUT), False
        if not number:
            raise ValueError(f"not JSON at character {self.i}")
        self.i = j
        return json.loads(run), True

    def string(self) -> tuple[Any, bool]:
        j = self.i + 1
        while j < len(self.s):
            if self.s[j] == "\\":
                j += 2
                continue
            if self.s[j] == '"':
                text = json.loads(self.s[self.i : j + 1])
                self.i = j + 1
                return text, True
            j += 1
        self.i = len(self.s)
        return _CUT, False

    def members(self) -> tuple[dict[str, Any], bool]:
        out: dict[str, Any] = {}
        self.i += 1
        while True:
            if not self.skip():
                return out, False
            if self.s[self.i] == "}" and not out:
                self.i += 1
                return out, True
            key, whole = self.string() if self.s[self.i] == '"' else (None, True)
            if key is None:
                raise ValueError(f"not JSON at character {self.i}")
            if not whole or not self.skip():
                return out, False
            if self.s[self.i] != ":":
                raise ValueError(f"not JSON at character {self.i}")
            self.i += 1
            val, whole = self.value()
            if val is not _CUT:
                out[key] = val
            if not whole or not self.skip():
                return out, False
            c = self.s[self.i]
            self.i += 1
            if c == "}":
                return out, True
            if c != ",":
                raise ValueError(f"not JSON at character {self.i - 1}")

    def items(self) -> tuple[list[Any], bool]:
        out: list[Any] = []
        self.i += 1
        while True:
            if not self.skip():
                return out, False
            if self.s[self.i] == "]" and not out:
                self.i += 1
                return out, True
            val, whole = self.value()
            if val is not _CUT:
                out.append(val)
            if not whole or not self.skip():
                return out, False
            c = self.s[self.i]
            self.i += 1
            if c == "]":
                return out, True
            if c != ",":
                raise ValueError(f"not JSON at character {self.i - 1}")


def arguments_object(arguments: Any) -> dict[str, Any]:
    """The object of tool-call ``arguments`` (JSON text, or an object some upstreams send):
    whole JSON as parsed, JSON cut short as the module docstring says, ``{}`` for anything
    else (text that is not JSON, or JSON that is not an object)."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            cursor = _Text(arguments)
            value, whole = cursor.value()
            if whole or cursor.skip():  # not a cut text
                return {}
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}
