"""``"strict": true`` tools under ``tool_choice="auto"``: the plan carries the parser's
structural tag; the tag's grammar accepts free text, then only schema-valid calls of the
declared tools in the parser's format (and what the parser reads back validates); a parser
without a trigger (llama3_json) is a 400 naming ``tools[i].function.strict``."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from prefixgate.engine.sampling_params import StructuredOutputsParams
from prefixgate.engine.structured_output import grammar_of, tokenizer_info
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.tool_parsers import get_parser
from prefixgate.gateway.wire.tools import plan_tools

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def _tool(name: str, params: dict, strict: object = None) -> dict:
    fn: dict = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


STRICT = _tool("get_weather", CITY, True)
LOOSE = _tool("note", {"type": "object", "properties": {"k": {"type": "integer"}}}, False)


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    tok = Tokenizer.builtin()
    return xgr.GrammarCompiler(tokenizer_info(tok, tok.vocab_size, []), cache_enabled=False)


def _accepts(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar_of(spec)))
    return matcher.accept_string(text)


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_auto_without_strict_tools_is_unconstrained():
    plan = plan_tools([_tool("get_weather", CITY), LOOSE], "auto", None, "hermes")
    assert plan.mode == "auto" and plan.structured is None


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_a_strict_tool_puts_the_parsers_structural_tag_on_the_plan(parser):
    plan = plan_tools([LOOSE, STRICT], None, None, parser)
    assert plan.mode == "auto" and plan.structured is not None
    assert plan.structured.kind == "structural_tag"
    assert plan.structured.structural_tag["format"]["type"] == "triggered_tags"


def test_hermes_tag_allows_text_then_only_valid_calls(compiler):
    spec = plan_tools([STRICT, LOOSE], "auto", None, "hermes").structured
    assert spec is not None
    ok = _hermes("get_weather", '{"city": "Bern", "unit": "c"}')
    assert _accepts(compiler, spec, "Let me check." + ok + " and more text")
    assert _accepts(compiler, spec, "no call at all, < tool_call > is not the trigger")
    assert not _accepts(compiler, spec, "x" + _hermes("get_weather", '{"city": "Bern"}'))
    assert not _accepts(compiler, spec, _hermes("get_weather", '{"city": "Bern", "unit": "k"}'))
    assert not _accepts(compiler, spec, _hermes("get_weather", '{"city": "Bernhardsdorf"}'))
    assert not _accepts(compiler, spec, _hermes("other", "{}"))
    # the non-strict tool keeps free JSON-object arguments (its name is still checked)
    assert _accepts(compiler, spec, _hermes("note", '{"k": "not an int", "z": [1]}'))
    assert not _accepts(compiler, spec, _hermes("note", "[1]"))
    # what the parser reads back from an accepted text validates
    content, calls = get_parser("hermes").split("Let me check." + ok, True)
    assert content == "Let me check." and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), CITY)


def test_hermes_without_parallel_calls_ends_after_the_first(compiler):
    spec = plan_tools([STRICT], "auto", False, "hermes").structured
    assert spec is not None
    ok = _hermes("get_weather", '{"city": "Bern", "unit": "c"}')
    assert _accepts(compiler, spec, "A" + ok)
    assert not _accepts(compiler, spec, "A" + ok + "B")
    parallel = plan_tools([STRICT], "auto", True, "hermes").structured
    assert parallel is not None and _accepts(compiler, parallel, ok + "B" + ok)


def test_mistral_tag_allows_text_then_a_valid_array(compiler):
    spec = plan_tools([STRICT, LOOSE], "auto", None, "mistral").structured
    assert spec is not None
    call = '{"name": "get_weather", "arguments": {"city": "Bern", "unit": "f"}}'
    text = "Sure.[TOOL_CALLS][" + call + ', {"name": "note", "arguments": {"q": 1}}]'
    assert _accepts(compiler, spec, text)
    assert not _accepts(compiler, spec, text + " trailing")  # the parser reads one array
    assert not _accepts(compiler, spec, 'Sure.[TOOL_CALLS][{"name": "get_weather", '
                        '"arguments": {"city": 3, "unit": "f"}}]')  # fmt: skip
    content, calls = get_parser("mistral").split(text, True)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "note"]
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    single = plan_tools([STRICT], "auto", False, "mistral").structured
    assert single is not None and not _accepts(compiler, single, f"[TOOL_CALLS][{call}, {call}]")


def test_llama3_json_cannot_honour_strict_and_says_which_tool():
    with pytest.raises(APIError) as err:
        plan_tools([LOOSE, STRICT], "auto", None, "llama3_json")
    assert err.value.status == 400 and err.value.param == "tools[1].function.strict"
    assert "llama3_json" in err.value.message and "required" in err.value.message
    # non-strict tools, or "required" / a named function, still work with that parser
    assert plan_tools([LOOSE], "auto", None, "llama3_json").structured is None
    assert plan_tools([STRICT], "required", None, "llama3_json").mode == "required"


@pytest.mark.parametrize("value", ["yes", 1, {}])
def test_strict_must_be_a_boolean(value):
    with pytest.raises(APIError) as err:
        plan_tools([_tool("f", CITY, value)], "auto", None, "hermes")
    assert err.value.param == "tools[0].function.strict"


def test_single_token_triggers_of_real_tokenizers_are_accepted():
    """Qwen's ``<tool_call>`` is an added token and Mistral's ``[TOOL_CALLS]`` a special one:
    the engine's grammar (byte-level BPE vocabulary) accepts their token ids as the trigger,
    then the constrained call, then EOS."""
    from prefixgate.engine.structured_output import StructuredOutputManager  # noqa: PLC0415
    from support.bpe import byte_level_bpe  # noqa: PLC0415
    from tokenizers import AddedToken  # noqa: PLC0415

    hf = byte_level_bpe(['{"name": "f", "arguments": {"a": 1}}', "hello there"])
    hf.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    hf.add_special_tokens(["[TOOL_CALLS]"])
    tok = Tokenizer(hf, eos_token="<|endoftext|>")
    eos = tok.eos_token_id
    mgr = StructuredOutputManager(tok, tok.vocab_size, [eos])
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [_tool("f", params, True)]
    answers = {
        "hermes": (
            'hello<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "<tool_call>",
        ),
        "mistral": ('hello[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "[TOOL_CALLS]"),
    }
    try:
        for parser, (text, trigger) in answers.items():
            spec = plan_tools(tools, "auto", False, parser).structured
            assert spec is not None
            g = mgr.request(spec)
            assert g.future.result(30) is not None and g.ready
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.id_to_token(ids[1]) == trigger  # one token
            for t in ids + [eos]:
                g.accept(t)
                assert g.rejected is None, (parser, tok.id_to_token(t))
            assert g.terminated
    finally:
        mgr.shutdown()
