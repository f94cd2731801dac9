"""Built-in model presets: run the whole stack without any checkpoint on disk.

``"tiny-random"`` is a small Llama (hidden 128, 4 layers, 4 query heads, 2 KV heads) with seeded
random (dummy) weights and a character-level tokenizer built in code with the ``tokenizers``
library: the 95 printable ASCII characters, 256 byte-fallback tokens ``<0x00>``..``<0xFF>`` for
everything else, and ``<unk>`` / ``<s>`` / ``</s>``. Its outputs are meaningless text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer

TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_vocab() -> dict[str, int]:
    """Token → id of the built-in tokenizer: specials, 256 byte tokens, printable ASCII."""
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for code in range(0x20, 0x7F):
        vocab[chr(code)] = len(vocab)
    return vocab


TINY_VOCAB_SIZE = len(tiny_vocab())  # 354 tokens

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-random": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": TINY_VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    },
}


def build_tiny_tokenizer() -> HFTokenizer:
    """The ``tiny-random`` tokenizer as a ``tokenizers.Tokenizer`` (no files needed).

    BPE without merges and with byte fallback: one token per printable ASCII character, UTF-8
    bytes of anything else as ``<0xNN>`` tokens; ``<s>`` is prepended by the post-processor.
    """
    vocab = tiny_vocab()
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS]
    )
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tok
