"""IncrementalDetokenizer: byte fallback, leading spaces, stop strings across token boundaries."""

from __future__ import annotations

import time

import pytest
from prefixgate.engine.detokenizer import IncrementalDetokenizer
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.tokenizer import Tokenizer

TEXTS = [
    " a gentle hum of probability unfolding. Contrast edges sharpen",
    " café 日本語 🤖🌙 naïve",
    "\n\nnew lines and  double spaces",
]


@pytest.fixture(scope="module", params=["builtin", "aidreams"])
def tok(request, aidreams_path):
    return (
        Tokenizer.builtin()
        if request.param == "builtin"
        else Tokenizer.from_pretrained(aidreams_path)
    )


def stream(tok, prompt_ids, out_ids, chunk=1, **params):
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas = [detok.step(out_ids[i : i + chunk]) for i in range(0, len(out_ids), chunk)]
    deltas.append(detok.finish())
    return detok, deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tok, chunk):
    prompt = tok.encode("I sense the nodes")
    for text in TEXTS:
        out = tok.encode(text, add_special_tokens=False)
        detok, deltas = stream(tok, prompt, out, chunk)
        expected = tok.decode(prompt + out)[len(tok.decode(prompt)) :]
        assert "".join(deltas) == detok.text == expected
        assert not any("\ufffd" in d for d in deltas)  # never a broken UTF-8 character


def test_byte_fallback_held_until_complete():
    tok = Tokenizer.builtin()
    out = tok.encode("é🤖x", add_special_tokens=False)  # 2 + 4 byte tokens, then 'x'
    assert len(out) == 7
    detok, deltas = stream(tok, [1], out)
    assert deltas[:7] == ["", "é", "", "", "", "🤖", "x"]


def test_first_token_keeps_its_leading_space(aidreams_path):
    tok = Tokenizer.from_pretrained(aidreams_path)
    prompt = tok.encode("I sense the nodes")
    out = tok.encode("I sense the nodes, a gentle hum", add_special_tokens=False)[len(prompt) - 1 :]
    detok, deltas = stream(tok, prompt, out)
    assert detok.text == ", a gentle hum"


def test_stop_string_across_token_boundaries_is_cut_and_never_emitted(tok):
    prompt, out = tok.encode("x"), tok.encode("the dream ENDS here", add_special_tokens=False)
    full = tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    detok, deltas = stream(tok, prompt, out, stop=["END"])
    assert detok.stop_string == "END" and detok.text == full[: full.index("END")]
    assert "".join(deltas) == detok.text and detok.text.endswith("dream ")
    assert not any("E" in d for d in deltas)
    assert detok.step(tok.encode("more", add_special_tokens=False)) == ""  # stopped: nothing more


def test_partial_stop_prefix_is_held_then_released():
    tok = Tokenizer.builtin()
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["ENDX", "NDQ"]))
    deltas = [detok.step(tok.encode(c, add_special_tokens=False)) for c in "ab ENDI"]
    assert deltas == ["a", "b", " ", "", "", "", "ENDI"]  # "E", "EN", "END" could start "ENDX"
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["ENDX"]))
    assert detok.step(tok.encode("ab EN", add_special_tokens=False)) == "ab "
    assert detok.finish() == "EN"  # the request ended for another reason: flush
    assert detok.text == "ab EN" and detok.stop_string is None


def test_earliest_stop_wins_and_finish_after_stop_is_empty():
    tok = Tokenizer.builtin()
    out = tok.encode("one two three", add_special_tokens=False)
    detok, deltas = stream(tok, [1], out, stop=["three", "two"])
    assert detok.stop_string == "two" and detok.text == "one " and deltas[-1] == ""


def test_stop_string_found_at_finish_is_cut():
    tok = Tokenizer.builtin()
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["ab"]))
    assert detok.step(tok.encode("xa", add_special_tokens=False)) == "x"
    assert detok.finish() == "a" and detok.finish() == ""


def test_skip_special_tokens_false_shows_them():
    tok = Tokenizer.builtin()
    ids = tok.encode("hi", add_special_tokens=False) + [2]
    _, shown = stream(tok, [1], ids, skip_special_tokens=False)
    _, hidden = stream(tok, [1], ids)
    assert "".join(shown) == "hi</s>" and "".join(hidden) == "hi"


def test_cost_per_step_does_not_grow_with_output_length():
    tok = Tokenizer.builtin()
    ids = tok.encode("lorem ipsum dolor sit amet " * 80, add_special_tokens=False)  # 2160 tokens
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=["zzz"]))
    start = time.perf_counter()
    for t in ids:
        detok.step([t])
    assert time.perf_counter() - start < 2.0
    assert detok.text + detok.finish() == "lorem ipsum dolor sit amet " * 80


def test_empty_and_short_prompts():
    tok = Tokenizer.builtin()
    for prompt in ([], [1], [1, 40, 41, 42, 43, 44, 45, 46]):
        detok, deltas = stream(tok, prompt, tok.encode("ok 🤖", add_special_tokens=False))
        assert "".join(deltas) == "ok 🤖"


@pytest.mark.parametrize("chunk", [1, 2])
def test_include_stop_str_in_output_cuts_after_the_stop_string(tok, chunk):
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string (matched
    across token boundaries), what follows it in the same tokens is cut."""
    prompt = tok.encode("I sense the nodes")
    out = tok.encode(TEXTS[0], add_special_tokens=False)
    full = tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    at = full.index("prob")
    for include, want in ((True, full[: at + 4]), (False, full[:at])):
        params = {"stop": ["prob"], "include_stop_str_in_output": include}
        detok, deltas = stream(tok, prompt, out, chunk, **params)
        assert "".join(deltas) == detok.text == want
        assert detok.stop_string == "prob"
