"""A chat tool's keys are OpenAI's (``type``, ``function``; the function's ``name``,
``description``, ``parameters``, ``strict``): any other is a 400 naming it, never ignored
(a ``cache_control`` on a tool would otherwise look like a breakpoint and pin nothing)."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from prefixgate.gateway.http.errors import APIError  # noqa: E402
from prefixgate.gateway.wire.tools import check_tools  # noqa: E402

FN = {"name": "lookup", "description": "d", "parameters": {"type": "object"}, "strict": False}


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        (
            {"type": "function", "function": FN, "cache_control": {"type": "ephemeral"}},
            "tools[0].cache_control",
        ),
        ({"type": "function", "function": {**FN, "examples": []}}, "tools[0].function.examples"),
    ],
)
def test_unknown_tool_keys_are_400s_naming_them(tool, param):
    with pytest.raises(APIError) as exc:
        check_tools([tool])
    assert exc.value.status == 400 and exc.value.param == param


def test_known_keys_pass():
    assert check_tools([{"type": "function", "function": FN}])[0]["function"]["name"] == "lookup"
