"""The tokenizers word cache is bounded: distinct prompts do not grow the heap.

``tokenizers``' BPE keeps each word's pieces in a cache of up to 10,000 words. The
``tiny-random`` tokenizer has no pre-tokenizer, so there a word is a whole prompt: before the
bound, every distinct prompt kept ~1.5 KB of C heap for the first 10,000 (the local server's
memory grew ~1.5 KB per request, invisible to tracemalloc). Heap bytes in use are read from
glibc's ``mallinfo2`` (``support.heap``: allocated bytes, not RSS).
"""

from __future__ import annotations

from unittest import mock

from prefixgate.engine import tokenizer as tokenizer_module
from prefixgate.engine.models.presets import build_tiny_tokenizer
from prefixgate.engine.tokenizer import MAX_CACHED_WORDS, Tokenizer, bound_word_cache
from support.heap import heap_in_use
from tokenizers import pre_tokenizers


def _prompts(n: int) -> list[str]:
    return [f"request {i}: " + "say something " * 14 for i in range(n)]  # ~210 characters


def test_every_tokenizer_object_is_bounded():
    with mock.patch.object(tokenizer_module, "bound_word_cache", wraps=bound_word_cache) as bound:
        tok = Tokenizer.builtin()
        tok.encode_plain("<s> as text")
    bounded = [call.args[0] for call in bound.call_args_list]
    assert any(b is tok._tok for b in bounded)
    assert any(b is tok._plain for b in bounded)


def test_cache_off_without_pre_tokenizer_capped_with_one(aidreams_path):
    assert bound_word_cache(build_tiny_tokenizer()) == 0
    # a sentencepiece-style BPE (Llama 2's shape): no pre-tokenizer, a word is a whole text
    assert bound_word_cache(Tokenizer.from_pretrained(aidreams_path)._tok) == 0
    words = build_tiny_tokenizer()
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert bound_word_cache(words) == MAX_CACHED_WORDS


def test_distinct_prompts_keep_no_heap():
    prompts = _prompts(3000)
    control = build_tiny_tokenizer()  # tokenizers' default cache: the measure sees it
    before = heap_in_use()
    for text in prompts:
        control.encode(text, add_special_tokens=False)
    control_growth = heap_in_use() - before
    tok = Tokenizer.builtin()
    before = heap_in_use()
    for text in prompts:
        tok.encode(text)
        tok.encode_chat([{"role": "user", "content": text}])
    growth = heap_in_use() - before
    assert control_growth > 8_000_000, control_growth  # ~6.6 KB a 210-character word
    assert growth < 1_000_000, growth
