"""``wire.partial_json.arguments_object``: a tool call's arguments cut anywhere give the object
the ``anthropic`` package makes of the same text streamed (``jiter`` in partial mode)."""

from __future__ import annotations

import pytest
from prefixgate.gateway.wire.partial_json import arguments_object

jiter = pytest.importorskip("jiter")

WHOLE = [
    '{"city": "Paris", "n": 12, "deep": {"a": [1, 2.5e3, true, null, "x\\"y\\u00e9"], '
    '"b": false}, "neg": -3}',
    '{ "a" : [ {"b": [ ] } , {} ] , "c":"" }',
    '{"a":[[[]]],"b":{"c":{"d":0}}}',
    "{}",
]


@pytest.mark.parametrize("text", WHOLE)
def test_every_cut_gives_what_the_anthropic_package_accumulates(text):
    for k in range(len(text) + 1):
        cut = text[:k]
        try:
            want = jiter.from_json(cut.encode(), partial_mode=True)
        except ValueError:
            want = {}
        assert arguments_object(cut) == (want if isinstance(want, dict) else {}), cut


def test_text_that_is_not_a_cut_object_is_empty():
    for text in ('{"a": 1} x', '{"a" 1', "nope", "[1, 2]", '"x"', "", None, 3):
        assert arguments_object(text) == {}, text
    assert arguments_object({"a": 1}) == {"a": 1}  # an upstream's object, as it is
