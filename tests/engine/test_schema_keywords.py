"""Every JSON Schema keyword is enforced or refused (engine/structured_output.py).

xgrammar 0.2 drops some keywords and combinations with only a line on stderr (``pattern`` or
``format`` with ``minLength``/``maxLength``, ``multipleOf`` on numbers or with a range, a
lookahead, ``oneOf`` with overlapping branches, ...) and others without a word (unknown
``format``\\s, ``not``, ``if``, ``content*``). Each is a ValueError naming it before anything is
queued; every schema accepted rejects its violating instance, and its sampled answers on
aidreams validate under ``jsonschema`` (formats checked)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import xgrammar as xgr
from prefixgate.engine import LLM, SamplingParams
from prefixgate.engine.sampling_params import StructuredOutputsParams as SO
from prefixgate.engine.structured_output import (
    _JSON_OPTIONS,
    ENFORCED_FORMATS,
    grammar_of,
    native_warnings,
)
from xgrammar.testing import _is_grammar_accept_string

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741 - the schema of an integer
N = {"type": "number"}
P3 = {"a": I, "b": I, "c": I}

# (schema, an instance that violates it, a fragment the refusal names) — refused keywords
REFUSED = [
    ({**S, "pattern": "^a+$", "maxLength": 2}, '"aaaa"', "pattern with maxLength"),
    ({**S, "pattern": "^a+$", "minLength": 3}, '"a"', "pattern with minLength"),
    ({**S, "format": "date", "maxLength": 3}, '"2020-01-01"', "format with maxLength"),
    ({**S, "format": "uri", "minLength": 1, "maxLength": 9}, '"http://a.b/cdefgh"', "format"),
    ({**S, "format": "credit-card"}, None, "format 'credit-card'"),
    ({**S, "format": "idn-email"}, '"x"', "format 'idn-email'"),
    ({**S, "format": "regex"}, '"("', "format 'regex'"),
    ({**N, "multipleOf": 0.5}, "0.3", "multipleOf on a non-integer"),
    ({**N, "multipleOf": 1}, "1.5", "multipleOf on a non-integer"),
    ({**I, "multipleOf": 2.5}, "3", "multipleOf with a non-integer"),
    ({**I, "multipleOf": 3, "minimum": 1}, "2", "multipleOf with minimum"),
    ({**I, "multipleOf": 3, "exclusiveMinimum": 0}, "4", "multipleOf with exclusiveMinimum"),
    ({**I, "multipleOf": 3, "maximum": 10}, "4", "multipleOf with maximum"),
    ({**S, "pattern": "^(?!a)[ab]$"}, '"a"', "Lookahead"),
    ({**S, "pattern": "^a$b"}, '"ab"', "Anchor"),
    ({"oneOf": [I, N]}, "1", "oneOf"),
    ({"allOf": [I, {"minimum": 5}]}, "1", "allOf"),
    ({"not": I}, "1", "not"),
    ({"if": I, "then": {"minimum": 3}}, "1", "if"),
    ({**S, "contentEncoding": "base64"}, None, "contentEncoding"),  # annotations: refused, as
    ({**S, "contentMediaType": "application/json"}, None, "contentMediaType"),  # not enforced
    ({"type": "array", "items": I, "uniqueItems": True}, "[1,1]", "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "[2]", "contains"),
    (
        {"type": "object", "properties": {"a": I}, "dependentRequired": {"a": ["b"]}},
        '{"a":1}',
        "dependentRequired",
    ),
    # nested: the path is named
    (
        {"type": "object", "properties": {"d": {**S, "format": "date", "maxLength": 4}}},
        '{"d":"2020-01-01"}',
        "#/properties/d: format with maxLength",
    ),
    (
        {"$defs": {"x": {**N, "multipleOf": 0.1}}, "$ref": "#/$defs/x"},
        "0.05",
        "#/$defs/x: multipleOf",
    ),
]

# (schema, a violating instance, a valid one) — accepted and enforced
ENFORCED = [
    ({**S, "minLength": 2, "maxLength": 3}, '"abcd"', '"abc"'),
    ({**S, "pattern": "^a[0-9]c$"}, '"abc"', '"a1c"'),
    ({**S, "format": "date"}, '"2020-13-45"', '"2020-12-01"'),
    ({**S, "format": "uuid"}, '"not-a-uuid"', '"123e4567-e89b-12d3-a456-426614174000"'),
    ({**I, "multipleOf": 3}, "4", "6"),
    ({**I, "minimum": 3, "exclusiveMaximum": 5}, "5", "4"),
    ({**N, "minimum": 0.5, "maximum": 1.5}, "2", "1"),
    ({"type": "array", "items": I, "minItems": 2, "maxItems": 3}, "[1]", "[1,2]"),
    ({"type": "array", "prefixItems": [I], "items": False}, "[1,2]", "[1]"),
    ({"type": "object", "properties": P3, "minProperties": 2}, '{"a":1}', '{"a":1,"b":2}'),
    ({"type": "object", "properties": P3, "maxProperties": 1}, '{"a":1,"b":2}', '{"a":1}'),
    ({"type": "object", "properties": {"a": I}, "required": ["a"]}, "{}", '{"a":1}'),
    ({"enum": [1, "a", None]}, "2", '"a"'),
    ({"const": "abc"}, '"abd"', '"abc"'),
    ({"anyOf": [I, S]}, "true", '"x"'),
    ({"oneOf": [I, S]}, "true", "3"),  # provably disjoint branches: exact
    ({"$defs": {"x": {**I, "minimum": 3}}, "$ref": "#/$defs/x"}, "1", "3"),
    ({"allOf": [{**I, "minimum": 3}]}, "1", "3"),
]


def _compile(schema):
    return grammar_of(SO(json=schema))


@pytest.mark.parametrize(("schema", "bad", "named"), REFUSED)
def test_every_keyword_the_grammar_drops_is_refused_by_name(schema, bad, named):
    with pytest.raises(ValueError, match="^structured_outputs.json") as exc:
        _compile(schema)
    assert named in str(exc.value), str(exc.value)
    if bad is None:  # a keyword jsonschema does not assert either (unknown format, content*)
        return
    # the instance really violates the schema, and xgrammar's own grammar lets it through
    # (uniqueItems, contains and dependentRequired it enforces today: their refusal is the
    # conservative side of "enforced or refused")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema, format_checker=jsonschema.FormatChecker())
    with native_warnings():
        raw = xgr.Grammar.from_json_schema(schema, **_JSON_OPTIONS)
    lets_through = _is_grammar_accept_string(raw, json.dumps(json.loads(bad)))
    assert lets_through or named in ("uniqueItems", "contains", "dependentRequired", "not")


@pytest.mark.parametrize(("schema", "bad", "good"), ENFORCED)
def test_every_accepted_keyword_is_enforced(schema, bad, good):
    grammar = _compile(schema)
    # the engine writes compact JSON with ", " and ": " (json.dumps' default separators)
    assert not _is_grammar_accept_string(grammar, json.dumps(json.loads(bad)))
    assert _is_grammar_accept_string(grammar, json.dumps(json.loads(good)))
    checker = jsonschema.FormatChecker()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema, format_checker=checker)
    jsonschema.validate(json.loads(good), schema, format_checker=checker)


@pytest.mark.parametrize("fmt", sorted(ENFORCED_FORMATS))
def test_each_enforced_format_rejects_a_malformed_value(fmt):
    assert not _is_grammar_accept_string(_compile({**S, "format": fmt}), '" !!not valid!! "')


CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": I},
       "required": ["kind", "lives"]}  # fmt: skip
DOG = {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}, "good": {"type": "boolean"}},
       "required": ["kind", "good"]}  # fmt: skip
PET = {  # pydantic's discriminated union Cat | Dog on "kind"
    "$defs": {"Cat": CAT, "Dog": DOG},
    "type": "object",
    "properties": {
        "pet": {
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "discriminator": {"propertyName": "kind"},
        }
    },
    "required": ["pet"],
}


def test_one_of_told_apart_by_a_property_is_exact_and_accepted():
    grammar = _compile(PET)
    for pet, ok in [
        ({"kind": "cat", "lives": 3}, True),
        ({"kind": "wolf", "good": True}, True),
        ({"kind": "cat", "good": True}, False),
        ({"kind": "dog", "lives": 3}, False),
    ]:
        assert _is_grammar_accept_string(grammar, json.dumps({"pet": pet})) is ok, pet
    # branches not pinned apart (kind shared, or not objects: "required" says nothing about a
    # string) stay refused
    same = {**DOG, "properties": {**DOG["properties"], "kind": {"enum": ["cat", "dog"]}}}
    loose = {k: v for k, v in CAT.items() if k != "type"}
    for branches in ([CAT, same], [loose, {k: v for k, v in DOG.items() if k != "type"}]):
        with pytest.raises(ValueError, match="oneOf"):
            _compile({"oneOf": branches})


def test_regex_and_structural_tag_warnings_refuse_too():
    with pytest.raises(ValueError, match="structured_outputs.regex: not enforced exactly"):
        grammar_of(SO(regex="a$b"))
    grammar_of(SO(regex=r"a\ b"))  # an escaped space matches a space: exact, accepted
    tag = {
        "type": "structural_tag",
        "format": {"type": "json_schema", "json_schema": {**S, "pattern": "^a$", "maxLength": 1}},
    }
    with pytest.raises(ValueError, match="pattern with maxLength"):
        grammar_of(SO(structural_tag=tag))


def test_native_warnings_passes_other_stderr_output_on(capfd):
    with native_warnings() as found:
        os.write(2, b"another thread's log line\n")
        xgr.Grammar.from_json_schema({**N, "multipleOf": 0.5}, **_JSON_OPTIONS)
    assert len(found) == 1 and "multipleOf" in found[0]
    err = capfd.readouterr().err
    assert "another thread's log line" in err and "multipleOf" not in err


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=256, max_num_seqs=32)


ACCEPTED_ON_MODEL = [
    {
        "type": "object",
        "properties": {
            "d": {**S, "format": "date"},
            "k": {**I, "multipleOf": 5},
            "s": {**S, "minLength": 1, "maxLength": 4},
            "p": {**S, "pattern": "^[ab]{2}$"},
        },
        "required": ["d", "k", "s", "p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "u": {**S, "format": "uuid"},
            "t": {"type": "array", "items": {**I, "minimum": 0, "maximum": 9}, "maxItems": 2},
        },
        "required": ["u", "t"],
        "additionalProperties": False,
    },
    {"anyOf": [{**I, "minimum": 10, "maximum": 20}, {"enum": ["x", "y"]}]},
    PET,
]


@pytest.mark.parametrize("schema", ACCEPTED_ON_MODEL)
def test_accepted_schemas_give_answers_that_validate(llm, schema, pool_whole):
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=SO(json=schema))
        for i in range(12)
    ]
    outs = [o.outputs[0] for o in llm.generate(["Tell me"] * 12, params)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 6, [o.finish_reason for o in outs]
    for o in finished:
        jsonschema.validate(json.loads(o.text), schema, format_checker=jsonschema.FormatChecker())
    pool_whole(llm)


# Length-bounded strings (xgrammar lowers them apart from plain strings): raw control
# characters are invalid JSON and must never be admitted; escapes are JSON characters and
# count once each against the bound. Plain, in an array, in a structural tag, with minLength.
BOUNDED = [
    (
        SO(json={"type": "object", "properties": {"a": {**S, "maxLength": 3}}, "required": ["a"]}),
        '{{"a": {}}}',
    ),
    (SO(json={"type": "array", "items": {**S, "minLength": 1, "maxLength": 3}}), "[{}]"),
    (
        SO(
            structural_tag={
                "type": "structural_tag",
                "format": {"type": "json_schema", "json_schema": {**S, "maxLength": 3}},
            }
        ),
        "{}",
    ),
]


@pytest.mark.parametrize(("spec", "frame"), BOUNDED)
def test_length_bounded_strings_are_exact_json_strings(spec, frame):
    grammar = grammar_of(spec)

    def accepts(string_literal: str) -> bool:
        return _is_grammar_accept_string(grammar, frame.format(string_literal))

    for raw in ("\t", "\x01", "\x1f", "a\x00"):  # raw C0: strict JSON parsers refuse them
        assert not accepts('"' + raw + '"'), repr(raw)
    for ok in ('"ab"', '"a\\tb"', '"\\"\\\\/"', '"\\u00e9"', '"\x7f"'):  # escapes: one char each
        assert accepts(ok), ok
        json.loads(frame.format(ok))  # and the instance is valid JSON
    assert not accepts('"abcd"') and not accepts('"\\t\\t\\t\\t"')  # the bound holds
    if "minLength" in json.dumps(spec.json or {}):
        assert not accepts('""')


def test_length_bounded_answers_parse_as_strict_json(llm, pool_whole):
    schema = {
        "type": "object",
        "properties": {"city": {**S, "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(temperature=1.3, seed=i, max_tokens=60, structured_outputs=SO(json=schema))
        for i in range(24)
    ]
    outs = [o.outputs[0] for o in llm.generate(["Tell me"] * 24, params)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for o in finished:
        jsonschema.validate(json.loads(o.text), schema)  # json.loads is strict: no raw C0
    pool_whole(llm)
