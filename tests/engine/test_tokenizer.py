"""Tokenizer: same ids, text and chat rendering as transformers' AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from prefixgate.engine.models.errors import ModelFileNotFoundError
from prefixgate.engine.tokenizer import Tokenizer

TEXTS = [
    "I sense the nodes",
    "",
    " leading and  double  spaces ",
    "Line one\nLine two\n\n\ttab",
    "Unicode: café, naïve, 日本語, emoji 🤖🌙",
    "<s>special</s> tokens inline",
    "You dream.\n\nI sense the nodes, a gentle hum of probability unfolding.",
]
CONVERSATIONS = [
    [{"role": "user", "content": "I sense the nodes"}],
    [{"role": "system", "content": "You dream."}, {"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me more 🤖"},
    ],
]


@pytest.fixture(scope="module", params=["aidreams", "smollm2"])
def pair(request, aidreams_path, smollm2_shape_path):
    from transformers import AutoTokenizer

    path = aidreams_path if request.param == "aidreams" else smollm2_shape_path
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_decode_match_transformers(pair, add_special):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == hf(text, add_special_tokens=add_special).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_special_ids_and_vocab(pair):
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == {hf.eos_token_id}
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(pair, gen_prompt):
    ours, hf = pair
    for conv in CONVERSATIONS:
        text = ours.apply_chat_template(conv, add_generation_prompt=gen_prompt)
        assert text == hf.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=gen_prompt
        )
        ids = ours.apply_chat_template(conv, add_generation_prompt=gen_prompt, tokenize=True)
        ref = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen_prompt)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ids == list(ref)


def test_text_parts_are_joined(aidreams_path):
    tok = Tokenizer.from_pretrained(aidreams_path)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}
    ]
    assert tok.apply_chat_template(parts) == "<s>a b"


@pytest.mark.parametrize(
    "messages, exc",
    [
        ("hello", TypeError),
        ([], ValueError),
        (["hello"], TypeError),
        ([{"content": "no role"}], ValueError),
        ([{"role": "user", "content": 5}], ValueError),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ValueError),
    ],
)
def test_bad_messages_raise(messages, exc):
    with pytest.raises(exc):
        Tokenizer.builtin().apply_chat_template(messages)


def test_builtin_tokenizer_round_trip():
    tok = Tokenizer.builtin()
    assert tok.vocab_size == 354 and tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    text = "Hello, world!\nnaïve 🤖"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text
    assert tok.encode("ab", add_special_tokens=False) == [tok._id("a"), tok._id("b")]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s>user: hi\nassistant:"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)[0] == 1


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_template_list_and_add_bos_without_post_processor(tmp_path):
    """A named-template list, and add_bos_token filling in a post-processor that adds nothing."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(
        models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "<unk>": 3}, unk_token="<unk>")
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>"},
                "add_bos_token": True,
                "chat_template": [
                    {"name": "default", "template": "{{ messages[0]['content'] }}"},
                    {"name": "tool_use", "template": "T{{ messages[0]['content'] }}"},
                ],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("hi") == [0, 2] and tok.encode("hi", add_special_tokens=False) == [2]
    assert tok.eos_token_ids == {1, 3}
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, chat_template="tool_use") == "Thi"
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template(msgs, chat_template="{{ raise_exception('nope') }}")
