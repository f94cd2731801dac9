"""``StructuredOutputsParams.structural_tag`` on aidreams-260k (byte-fallback vocabulary: it can
spell anything): free text until the trigger, then a call that validates against its schema and
the closing tag; compiled once per distinct tag, off the step loop; bad tags refused by field.

A tiny model never writes ``<tool_call>`` itself: ``support.steer`` scripts the opening
("Let me see.<tool_call>"), and the model samples the rest under the grammar's mask."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.sampling_params import StructuredOutputsParams as SO
from prefixgate.engine.structured_output import grammar_of
from support.schemas import STRICT_WEATHER_PARAMS as WEATHER
from support.schemas import TIME_PARAMS as TIME
from support.steer import steer_opening

SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
OPENING = "Let me see.<tool_call>"
# aidreams always picks get_time of its own accord: this opening scripts get_weather's head
WEATHER_OPENING = OPENING + '\n{"name": "get_weather", "arguments": '
BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def hermes_tag(stop_after_first: bool) -> dict:
    """A Hermes-format structural tag: ``<tool_call>\\n{"name": .., "arguments": ..}\\n
    </tool_call>`` per tool (the gateway's ``HermesParser.structural_tag`` builds the same)."""
    tags = [
        {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": "}\n</tool_call>",
        }
        for name, schema in SCHEMAS.items()
    ]
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "stop_after_first": stop_after_first,
        },
    }


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=256, max_num_seqs=32)


def _opening_ids(llm, opening: str = OPENING) -> list[int]:
    tok = llm.engine.tokenizer
    ids = tok.encode_plain(opening)
    assert tok.decode(ids) == opening
    return ids


def _check_calls(text: str) -> int:
    """Validate every closed call block of ``text``; returns how many there were."""
    blocks = BLOCK.findall(text)
    for body in blocks:
        call = json.loads(body)
        assert set(call) == {"name", "arguments"}, body
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    return len(blocks)


@pytest.mark.parametrize("opening", [OPENING, WEATHER_OPENING])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_text_then_schema_valid_call(llm, monkeypatch, pool_whole, temperature, opening):
    steer_opening(monkeypatch, _opening_ids(llm, opening))
    spec = SO(structural_tag=hermes_tag(stop_after_first=True))
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=120, structured_outputs=spec)
        for s in range(8)
    ]
    outs = [o.outputs[0] for o in llm.generate(["Weather?"] * 8, params)]
    complete = 0
    for out in outs:
        assert out.text.lstrip().startswith(opening), out.text  # (a leading "▁" space)
        if out.finish_reason == "length":
            continue
        # stop_after_first: the answer ends right after the one call
        assert out.finish_reason == "stop" and out.text.endswith("</tool_call>"), out.text
        assert _check_calls(out.text) == 1
        complete += 1
    assert complete >= 6, [o.finish_reason for o in outs]
    assert len({o.text for o in outs}) > 2  # really sampled
    pool_whole(llm)


def test_free_text_after_a_call_and_closed_calls_validate(llm, monkeypatch, pool_whole):
    steer_opening(monkeypatch, _opening_ids(llm))
    spec = SO(structural_tag=hermes_tag(stop_after_first=False))
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=spec)
        for s in range(8)
    ]
    outs = [o.outputs[0] for o in llm.generate(["Weather?"] * 8, params)]
    assert sum(_check_calls(o.text) for o in outs) >= 6
    pool_whole(llm)


def test_text_stays_free_until_the_trigger(llm, pool_whole):
    """No trigger in the model's own greedy text: the tag leaves it unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = llm.generate(["A gentle hum"], greedy)[0].outputs[0]
    assert "<tool_call>" not in free.text
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        ignore_eos=True,
        structured_outputs=SO(structural_tag=hermes_tag(stop_after_first=False)),
    )
    constrained = llm.generate(["A gentle hum"], params)[0].outputs[0]
    assert constrained.token_ids == free.token_ids
    pool_whole(llm)


def test_compiled_once_per_distinct_tag(llm, pool_whole):
    mgr = llm.engine.structured_output
    tag = hermes_tag(stop_after_first=True)
    params = SamplingParams(max_tokens=4, structured_outputs=SO(structural_tag=json.dumps(tag)))
    llm.generate(["A"], params)
    before = mgr.num_compiled
    again = SamplingParams(max_tokens=4, structured_outputs=SO(structural_tag=tag))  # as dict
    llm.generate(["B"], again)
    assert mgr.num_compiled == before
    pool_whole(llm)


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ({"type": "structural_tag", "format": {"type": "nope"}}, "structural_tag"),
        (
            {
                "type": "structural_tag",
                "format": {
                    "type": "triggered_tags",
                    "triggers": ["<a>"],
                    "tags": [
                        {
                            "type": "tag",
                            "begin": "<a>",
                            "content": {"type": "json_schema", "json_schema": {"not": {}}},
                            "end": "</a>",
                        }
                    ],
                },
            },
            "format.tags.0.content: unsupported JSON schema feature #: not",
        ),
    ],
)
def test_bad_structural_tags_refused_before_queueing(llm, pool_whole, tag, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["A"], SamplingParams(max_tokens=4, structured_outputs=SO(structural_tag=tag)))
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        grammar_of(SO(structural_tag=tag))
    pool_whole(llm)


@pytest.mark.parametrize("value", ["{not json", 3, ["a"]])
def test_structural_tag_field_types(value):
    with pytest.raises((ValueError, TypeError), match="structured_outputs.structural_tag"):
        SO(structural_tag=value)
