"""What a token stands for in bytes, read from a ``tokenizers`` vocabulary: the inverse of
GPT-2's byte-to-unicode table (for ``Tokenizer.token_bytes``) and the most input bytes one
token can cover (``Tokenizer.max_token_bytes``, the bound behind ``min_num_tokens``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

__all__ = ["max_token_bytes", "unicode_to_bytes"]


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet; Radford et al.
    2019, ``encoder.py``): printable bytes map to themselves, the rest to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


# Worst-case shrink of the input's UTF-8 length per normalizer (the composed forms can merge
# a base letter and combining marks, 3 bytes into 1-2; lowercasing shortens a few letters).
_NORMALIZER_SHRINK = {
    "Prepend": 1,
    "NFC": 3,
    "NFKC": 3,
    "NFD": 3,
    "NFKD": 3,
    "Lowercase": 2,
    "StripAccents": 3,
}
# Pre-tokenizers that split without dropping any text.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def max_token_bytes(tok: HFTokenizer) -> int:
    """See ``Tokenizer.max_token_bytes``."""
    try:
        spec = json.loads(tok.to_str())
    except Exception:  # noqa: BLE001 - an unreadable spec: no bound
        return 0
    shrink = _shrink(spec.get("normalizer"))
    pre = spec.get("pre_tokenizer")
    model = spec.get("model") or {}
    if not shrink or not _keeps_text(pre) or model.get("type") != "BPE":
        return 0
    byte_level = "ByteLevel" in json.dumps(pre)
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        if not byte_level:
            return 0  # a run of unknown characters of any length becomes one <unk>
    vocab = tok.get_vocab(with_added_tokens=True)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)
    return longest * shrink


def _shrink(spec: Any) -> int:
    """The normalizer's worst shrink factor (product over a Sequence); 0 = unknown."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _shrink(part)
            if not f:
                return 0
            factor *= f
        return factor
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content", "")
        if pattern is None or len(content.encode()) < len(pattern.encode()):
            return 0  # a regex, or a replacement that shortens: no safe bound
        return 1
    return _NORMALIZER_SHRINK.get(kind, 0)


def _keeps_text(spec: Any) -> bool:
    """True when the pre-tokenizer never drops input text."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
