"""Logprobs of byte tokens: each token keeps its own bytes and a text of its own (a
byte-fallback ``<0xC3>`` is ``[195]``, not U+FFFD), and the completions ``top_logprobs`` dict
never merges distinct tokens under one key."""

from __future__ import annotations

from prefixgate.engine.outputs import Logprob, TokenLogprobs
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.gateway.local import renderers as R


def test_token_bytes_byte_fallback_and_metaspace(aidreams_path):
    tok = Tokenizer.from_pretrained(aidreams_path)
    c3 = tok._tok.token_to_id("<0xC3>")
    assert tok.token_bytes(c3) == b"\xc3"
    assert tok.token_bytes(tok._tok.token_to_id("▁a")) == b" a"
    assert tok.token_bytes(tok._tok.token_to_id("<0x0A>")) == b"\n"
    assert tok.token_bytes(2) == b"</s>"  # special token: its text


def test_chat_and_completion_logprobs_keep_byte_tokens_apart(aidreams_path):
    tok = Tokenizer.from_pretrained(aidreams_path)
    texts = R.TokenTexts(tok)
    c3, a9, a = (tok._tok.token_to_id(t) for t in ("<0xC3>", "<0xA9>", "▁a"))
    entries = [
        TokenLogprobs(Logprob(c3, -0.1), [Logprob(c3, -0.1), Logprob(a9, -2.0), Logprob(a, -3.0)])
    ]
    chat = R.chat_logprobs(texts, entries).model_dump()["content"][0]
    assert chat["bytes"] == [0xC3] and chat["token"] == "bytes:\\xc3"
    assert [t["bytes"] for t in chat["top_logprobs"]] == [[0xC3], [0xA9], list(b" a")]
    assert "\ufffd" not in str(chat)
    comp = R.completion_logprobs(texts, entries).model_dump()
    assert len(comp["top_logprobs"][0]) == 3  # three distinct tokens, three keys
    assert comp["tokens"] == ["bytes:\\xc3"]


def test_top_logprobs_same_text_distinct_ids_not_merged():
    texts = lambda i: "x"  # noqa: E731 - two ids that render the same
    entries = [TokenLogprobs(Logprob(1, -0.5), [Logprob(1, -0.5), Logprob(2, -1.0)])]
    top = R.completion_logprobs(texts, entries).model_dump()["top_logprobs"][0]
    assert top == {"x": -0.5, "token_id:2": -1.0}
