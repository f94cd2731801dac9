"""One cache diagnosis (``cache_diagnostics.diagnose``), its three renderings: Anthropic's
``cache_miss_reason``, OpenAI's ``prompt_cache_diagnostics`` (checked against the installed
``openai`` type) and the ``x-prefixgate-cache`` header's ``compare=`` part."""

from __future__ import annotations

import pytest
from openai.types.responses.response import Response
from prefixgate.gateway.local.cache_diagnostics import (
    PromptLog,
    anthropic_reason,
    diagnose,
    header_part,
    openai_diagnostics,
)
from pydantic import TypeAdapter

SYS = [{"role": "system", "content": "a"}, {"role": "user", "content": "q"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
_DIAG = TypeAdapter(Response.model_fields["prompt_cache_diagnostics"].annotation)


def _log(ids, salt="s", owner="key:1", messages=SYS, tools=TOOLS):
    return PromptLog(4).add("x", salt, ids, messages, tools, owner)


PREV = _log(list(range(40)))  # 2 whole blocks of 16: 32 reusable tokens


@pytest.mark.parametrize(
    ("current", "cached", "kind", "anthropic", "openai", "header"),
    [
        (_log(list(range(50))), 32, "hit", None, {"type": "cache_hit"}, "compare=hit"),
        (
            _log(list(range(50))),
            16,
            "evicted",
            {"type": "unavailable"},
            {"type": "unavailable"},
            "compare=evicted:missed=16",
        ),
        (
            _log([9, *range(1, 40)], tools=[]),
            0,
            "tools_changed",
            {"type": "tools_changed", "cache_missed_input_tokens": 32},
            {
                "type": "cache_miss",
                "reason": "tools_changed",
                "cache_missed_tokens": 32,
                "comparison_reusable_tokens": 32,
            },
            "compare=tools_changed:missed=32:at=0",
        ),
        (
            _log([*range(20), 0, 0], messages=[{"role": "system", "content": "b"}, SYS[1]]),
            16,
            "system_changed",
            {"type": "system_changed", "cache_missed_input_tokens": 16},
            {
                "type": "cache_miss",
                "reason": "input_changed",
                "cache_missed_tokens": 16,
                "comparison_reusable_tokens": 32,
            },
            "compare=system_changed:missed=16:at=20",
        ),
        (
            _log([*range(20), 0], messages=[SYS[0], {"role": "user", "content": "r"}]),
            16,
            "messages_changed",
            {"type": "messages_changed", "cache_missed_input_tokens": 16},
            {
                "type": "cache_miss",
                "reason": "input_changed",
                "cache_missed_tokens": 16,
                "comparison_reusable_tokens": 32,
            },
            "compare=messages_changed:missed=16:at=20",
        ),
        (
            _log(list(range(40)), salt="t"),
            0,
            "salt_differs",
            {"type": "previous_message_not_found"},
            {"type": "comparison_response_not_found"},
            "compare=salt_differs",
        ),
        (
            _log(list(range(40)), salt="t", owner="key:2"),
            0,
            "not_found",
            {"type": "previous_message_not_found"},
            {"type": "comparison_response_not_found"},
            "compare=not_found",
        ),
    ],
)
def test_one_diagnosis_three_renderings(current, cached, kind, anthropic, openai, header):
    d = diagnose(PREV, current, cached, 16)
    assert d.kind == kind
    assert anthropic_reason(d) == anthropic
    assert openai_diagnostics(d) == openai
    assert _DIAG.validate_python(openai).type == openai["type"]  # OpenAI's exact shape
    assert header_part(d) == header


def test_not_found_and_below_one_block():
    cur = _log(list(range(40)))
    assert diagnose(None, cur, 0, 16).kind == "not_found"
    short = _log(list(range(15)))
    d = diagnose(short, cur, 0, 16)
    assert d.kind == "below_one_block" and anthropic_reason(d) is None
    assert openai_diagnostics(d) == {"type": "unavailable"}
    assert header_part(d) == "compare=below_one_block"
