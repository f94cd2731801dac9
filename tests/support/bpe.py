"""A GPT-2 style byte-level BPE tokenizer trained in memory (as SmolLM2 / Qwen ship theirs):
for tests of the grammar on a byte-level vocabulary without model files."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def byte_level_bpe(corpus: Sequence[str], vocab_size: int = 400) -> HFTokenizer:
    """A ``tokenizers.Tokenizer``: byte-level pre-tokenizer and decoder, BPE trained on
    ``corpus`` repeated 50 times up to ``vocab_size`` ids, ``EOS`` its one special token."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(list(corpus) * 50, trainer)
    return hf
