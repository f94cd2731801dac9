"""Constrained decoding (xgrammar) on aidreams-260k, a tiny model that never saw JSON: every
answer that finishes with "stop" satisfies its constraint; unconstrained rows of a mixed batch
are untouched; grammars survive preemption; compilation never stalls other requests."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr
from prefixgate.engine import LLM, CompletionOutput, SamplingParams
from prefixgate.engine.sampling_params import StructuredOutputsParams as SO
from prefixgate.engine.structured_output import (
    StructuredOutputManager,
    grammar_of,
    tokenizer_info,
    unsupported_schema_feature,
)
from prefixgate.engine.tokenizer import Tokenizer
from support.schemas import NESTED_SCHEMA as SCHEMA

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llm(aidreams_path):
    return LLM(aidreams_path, num_kv_blocks=256, max_num_seqs=64)


def _sampled(so: SO, n: int, max_tokens: int = 90) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so)
        for i in range(n)
    ]


def test_json_schema_50_requests_validate(llm, pool_whole):
    outs = llm.generate(["Tell me"] * 50, _sampled(SO(json=SCHEMA), 50))
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 45, [o.outputs[0].finish_reason for o in outs]
    for c in stopped:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in stopped}) > 5  # temperature 1.0 really samples
    pool_whole(llm)


def test_json_object_and_schema_as_text(llm, pool_whole):
    outs = llm.generate(
        ["A"] * 8,
        _sampled(SO(json_object=True), 4, 100) + _sampled(SO(json=json.dumps(SCHEMA)), 4),
    )
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs[4:]) >= 3
    pool_whole(llm)


def test_choice_and_regex(llm, pool_whole):
    choices = ["yes", "no", "maybe later", 'say "hi"']
    pattern = r"[A-Z][a-z]{2,6}-\d{2,4}"
    outs = llm.generate(
        ["Once"] * 40, _sampled(SO(choice=choices), 20, 30) + _sampled(SO(regex=pattern), 20, 30)
    )
    for o in outs[:20]:
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in choices
    for o in outs[20:]:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    pool_whole(llm)


def test_grammar_ebnf_and_ignore_eos_still_stops(llm, pool_whole):
    grammar = 'root ::= "(" digit ("," digit){0,3} ")"\ndigit ::= [0-9]'
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=60,
        ignore_eos=True,
        structured_outputs=SO(grammar=grammar),
    )
    out = llm.generate(["Count"], params)[0].outputs[0]
    assert out.finish_reason == "stop", out
    assert re.fullmatch(r"\(\d(,\d){0,3}\)", out.text), out.text
    pool_whole(llm)


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm, pool_whole):
    prompts = ["I sense the nodes", "A gentle hum", "The dreamer wakes inside the code and"]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    mixed = llm.generate(
        prompts + ["Tell me"] * 6,
        [greedy] * 3 + _sampled(SO(json=SCHEMA), 3) + _sampled(SO(choice=["x", "yy"]), 3),
    )
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:6]:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    pool_whole(llm)


def test_constrained_greedy_equals_unconstrained_when_grammar_allows_it(llm, pool_whole):
    """The mask only removes tokens: a regex that allows the model's own greedy text leaves it
    unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate(["A gentle hum"], greedy)[0].outputs[0]
    pattern = re.escape(free.text) + ".*"
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, structured_outputs=SO(regex=pattern)
    )
    constrained = llm.generate(["A gentle hum"], params)[0].outputs[0]
    assert constrained.token_ids == free.token_ids
    pool_whole(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_grammar_survives_preemption(aidreams_path, prefix_caching, pool_whole):
    """So few KV blocks that requests are preempted and recomputed: the constrained (seeded)
    outputs equal those of an ample cache and still validate."""
    prompts = ["Tell me a story about the sea"] * 12
    params = (
        _sampled(SO(json=SCHEMA), 8)
        + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    )
    ample = LLM(aidreams_path, block_size=16, num_kv_blocks=256, max_num_seqs=16)
    want = [o.outputs[0] for o in ample.generate(prompts, params)]
    small = LLM(
        aidreams_path,
        block_size=16,
        num_kv_blocks=10,
        max_num_seqs=16,
        enable_prefix_caching=prefix_caching,
    )
    got = [o.outputs[0] for o in small.generate(prompts, params)]
    assert small.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for c in got[:8]:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    pool_whole(small)
    pool_whole(ample)


def test_compilation_never_stalls_other_requests(llm, monkeypatch, pool_whole):
    """A request whose grammar is compiling is skipped; an unconstrained one runs to the end
    meanwhile; once compiled the constrained one runs too. Each spec compiles once."""
    eng = llm.engine
    mgr = eng.structured_output
    release = threading.Event()
    real = mgr._compile

    def slow(spec):
        assert release.wait(30)
        return real(spec)

    monkeypatch.setattr(mgr, "_compile", slow)
    spec = SO(regex=r"slow-[0-9]{3}")
    eng.add_request("c1", "Once", SamplingParams(max_tokens=20, structured_outputs=spec))
    eng.add_request("c2", "Once", SamplingParams(max_tokens=20, structured_outputs=spec))
    eng.add_request("free", "Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done: dict[str, CompletionOutput] = {}
    whole: dict[str, CompletionOutput] = {}
    for _ in range(40):
        for out in eng.step():
            whole.setdefault(out.request_id, CompletionOutput()).add(out)
            if out.finished:
                done[out.request_id] = whole[out.request_id]
        if "free" in done:
            break
    assert "free" in done and "c1" not in done and "c2" not in done
    assert eng.scheduler.num_waiting == 2 and eng.scheduler.num_running == 0
    release.set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            whole.setdefault(out.request_id, CompletionOutput()).add(out)
            if out.finished:
                done[out.request_id] = whole[out.request_id]
    for rid in ("c1", "c2"):
        assert re.fullmatch(r"slow-[0-9]{3}", done[rid].text)
        assert done[rid].finish_reason == "stop"
    assert mgr.num_compiled >= 1
    before = mgr.num_compiled
    llm.generate(["Again"], SamplingParams(max_tokens=20, structured_outputs=spec))
    assert mgr.num_compiled == before  # cached: compiled once per distinct spec
    pool_whole(llm)


def test_failed_compilation_fails_only_that_request(llm, monkeypatch, pool_whole):
    mgr = llm.engine.structured_output

    def broken(spec):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(mgr, "_compile", broken)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate(
            ["a", "b"],
            [
                SamplingParams(max_tokens=5, structured_outputs=SO(regex="never-cached-[a-z]")),
                SamplingParams(max_tokens=5),
            ],
        )
    pool_whole(llm)
    monkeypatch.undo()
    ok = llm.generate(["a"], SamplingParams(max_tokens=30, structured_outputs=SO(regex="ok-[a-z]")))
    assert re.fullmatch("ok-[a-z]", ok[0].outputs[0].text)
    pool_whole(llm)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(json={"type": "foo"}), "structured_outputs.json"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json"),
        (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (dict(json={"not": {"type": "string"}}), "not"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="[a-"), "structured_outputs.regex"),
        (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_refused_before_queueing(llm, spec, field, pool_whole):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["a"], SamplingParams(structured_outputs=SO(**spec)))
    pool_whole(llm)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": ["a", 1]}, {"regex": ""}],
)
def test_structured_outputs_params_need_exactly_one_valid_constraint(kwargs):
    with pytest.raises((ValueError, TypeError)):
        SO(**kwargs)


def test_unsupported_schema_feature_walks_subschemas_not_property_names():
    ok = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    assert unsupported_schema_feature(ok) is None
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}
    assert unsupported_schema_feature(nested) == "#/properties/a/items: not"
    assert unsupported_schema_feature({"allOf": [{"type": "string"}]}) is None
    assert "allOf" in unsupported_schema_feature({"allOf": [{}, {}]})


def test_sampling_params_accepts_a_dict():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(p.structured_outputs, SO) and p.structured_outputs.kind == "choice"


# -- vocabularies --------------------------------------------------------------------------


def _bitmask_allows(compiled: xgr.CompiledGrammar, vocab: int, prefix_ids: list[int]) -> set[int]:
    m = xgr.GrammarMatcher(compiled)
    for t in prefix_ids:
        assert m.accept_token(t), t
    mask = xgr.allocate_token_bitmask(1, vocab)
    m.fill_next_token_bitmask(mask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, mask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_padded_model_vocab_never_allows_padding_ids(aidreams_path):
    """A model whose logits are wider than the tokenizer (padded embedding): ids past the
    vocabulary are never allowed; EOS only where the text is complete."""
    tok = Tokenizer.from_pretrained(aidreams_path)
    info = tokenizer_info(tok, 640, [2])
    assert info.vocab_size == 640 and info.vocab_type == xgr.VocabType.BYTE_FALLBACK
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar_of(SO(choice=["ab", "c"])))
    allowed = _bitmask_allows(compiled, 640, [])
    assert allowed and max(allowed) < 512 and 2 not in allowed
    c_id = tok._tok.token_to_id("<0x63>")  # "c" as its byte-fallback token
    assert 2 in _bitmask_allows(compiled, 640, [c_id])


def test_byte_level_bpe_vocabulary(tmp_path):
    """A GPT-2 style byte-level BPE tokenizer (as SmolLM2 / Qwen ship): detected as BYTE_LEVEL,
    and the token ids of a valid answer are accepted by the grammar, to the end."""
    from support.bpe import byte_level_bpe

    hf = byte_level_bpe(['{"c": "red", "n": 12}', "héllo wörld ✓"])
    tok = Tokenizer(hf, eos_token="<|endoftext|>")
    eos = tok.eos_token_id
    info = tokenizer_info(tok, tok.vocab_size, [eos])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    mgr = StructuredOutputManager(tok, tok.vocab_size, [eos])
    schema = {"type": "object", "properties": {"c": {"enum": ["red"]}, "n": {"type": "integer"}}}
    g = mgr.request(SO(json={**schema, "required": ["c", "n"], "additionalProperties": False}))
    assert g.future.result(30) is not None and g.ready
    for t in tok.encode('{"c": "red", "n": 12}', add_special_tokens=False):
        g.accept(t)
        assert g.rejected is None
    g.accept(eos)
    assert g.terminated
    assert tok.token_bytes(tok.encode("✓", add_special_tokens=False)[0])[:1] == "✓".encode()[:1]
    mgr.shutdown()


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (dict(regex="a(b"), "structured_outputs.regex: invalid regex at position 4: "),
        (dict(regex="(?<=a)b"), "structured_outputs.regex: invalid regex at position 3: "),
        (dict(regex="a{3,1}"), "structured_outputs.regex: invalid regex: Lower bound"),
        (dict(regex="[z-a]"), "structured_outputs.regex: invalid regex: Invalid character"),
        (dict(grammar='root ::= "a'), "structured_outputs.grammar: invalid EBNF grammar at line 1"),
        (dict(grammar="root ::= foo"), "structured_outputs.grammar: invalid EBNF grammar at line"),
        (dict(json={"$ref": "#/nope"}), "structured_outputs.json: invalid JSON schema: "),
        (dict(json={"type": "foo"}), "structured_outputs.json: invalid JSON schema at type"),
    ],
)
def test_grammar_errors_name_the_problem_never_compiler_paths(spec, want):
    """xgrammar's C++ errors start with its log prefix and a source path of its build
    (``[03:16:06] /project/cpp/regex_converter.cc:94: ``): reworded, the field and the
    problem stay, the compiler's internals go."""
    with pytest.raises(ValueError) as info:
        grammar_of(SO(**spec))
    msg = str(info.value)
    assert msg.startswith(want), msg
    assert not re.search(r"\.(cc|h|cpp)\b|/cpp/|/project/|\[\d\d:\d\d", msg), msg


def test_a_schema_too_deep_to_compile_is_told_as_such():
    """A valid schema nested past what the compiler's recursion takes: the client reads that
    it is nested too deeply, never Python's "maximum recursion depth exceeded"."""
    from prefixgate.engine.sampling_params import StructuredOutputsParams
    from prefixgate.engine.structured_output import grammar_of, reworded_error

    assert reworded_error("json", RecursionError("maximum recursion depth exceeded")) == (
        "invalid JSON schema: nested too deeply to compile"
    )
    schema: dict = {"type": "string"}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}}
    try:
        grammar_of(StructuredOutputsParams(json=schema))
    except ValueError as exc:
        assert "recursion" not in str(exc), exc
