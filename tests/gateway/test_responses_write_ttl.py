"""The Responses API's ``cache_write_tokens_details`` reports each written token under the
TTL it was written with: ``prompt_cache_retention: "24h"`` under ``ttl_24h_tokens`` (it was
counted under ``ttl_12h_tokens``), a ``cache_control`` 1h under ``ttl_1h_tokens``."""

from __future__ import annotations

import pytest
from prefixgate.gateway.local.cache_marks import Mark
from prefixgate.gateway.local.responses_api import _usage, ttl_field
from prefixgate.gateway.wire.response_models import PromptTokensDetails, Usage


@pytest.mark.parametrize(
    ("ttl_s", "field"),
    [
        (300.0, "ttl_5m_tokens"),
        (1800.0, "ttl_30m_tokens"),
        (3600.0, "ttl_1h_tokens"),
        (43_200.0, "ttl_12h_tokens"),
        (86_400.0, "ttl_24h_tokens"),
        (90.0, "ttl_90s_tokens"),
    ],
)
def test_ttl_field_names_the_ttl(ttl_s, field):
    assert ttl_field(ttl_s) == field


def _split(cached: int, marks: list[Mark]) -> dict[str, int]:
    u = Usage(
        prompt_tokens=200,
        completion_tokens=2,
        total_tokens=202,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
    details = _usage(u, marks)["input_tokens_details"]
    split = details["cache_write_tokens_details"]
    assert sum(split.values()) == details["cache_write_tokens"]
    return split


def test_retention_24h_is_reported_under_24h():
    split = _split(0, [Mark("prompt_cache_retention", 128, 86_400.0)])
    assert split == {"ttl_24h_tokens": 128, "ttl_12h_tokens": 0, "ttl_30m_tokens": 0}


def test_each_ttl_its_own_field():
    marks = [
        Mark("input.0.content.0.cache_control", 32, 3600.0),
        Mark("input.1.content.0.prompt_cache_breakpoint", 64, 43_200.0),
        Mark("input.2.content.0.prompt_cache_breakpoint", 96, 1800.0),
        Mark("prompt_cache_retention", 160, 86_400.0),
    ]
    assert _split(16, marks) == {
        "ttl_1h_tokens": 16,
        "ttl_12h_tokens": 32,
        "ttl_30m_tokens": 32,
        "ttl_24h_tokens": 64,
    }


def test_no_write_keeps_the_two_fields():
    assert _split(128, [Mark("prompt_cache_options", 128, 1800.0)]) == {
        "ttl_12h_tokens": 0,
        "ttl_30m_tokens": 0,
    }
