"""Token id -> text and bytes of the served tokenizer, for logprobs (``TokenTexts``)."""

from __future__ import annotations

from prefixgate.engine.protocol import TokenizerLike


class TokenTexts:
    """Token id → the text the token adds inside a sequence (a leading space kept) and its
    bytes.

    Decoding a token alone loses its leading space with sentencepiece-style tokenizers
    ("▁a" → "a"); decoded after a fixed anchor token it keeps it: text = decode([anchor, id])
    minus decode([anchor]). A token that is not whole UTF-8 on its own (a byte-fallback
    ``<0xC3>``, part of a byte-level character) keeps its own bytes (``[195]``) and is named
    ``"bytes:\\xc3"`` (OpenAI's form) rather than U+FFFD, so distinct tokens never share a
    text. Results are cached (token ids are few).
    """

    def __init__(self, tokenizer: TokenizerLike, max_cache: int = 1 << 16) -> None:
        self._tok = tokenizer
        self._anchor = list(tokenizer.encode("a", add_special_tokens=False)[-1:])
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._max = max_cache

    def __call__(self, token_id: int) -> str:
        return self.info(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes (its raw bytes for a partial character)."""
        return self.info(token_id)[1]

    def info(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        full = self._tok.decode(self._anchor + [token_id], skip_special_tokens=False)
        if self._anchor and full.startswith(self._anchor_text):
            text = full[len(self._anchor_text) :]
        else:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        raw = self._tok.token_bytes(token_id)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            if "\ufffd" in text:  # the decoder lost bytes: the token's own are the truth
                text = raw.decode("utf-8")
        hit = (text, list(raw))
        if len(self._cache) < self._max:
            self._cache[token_id] = hit
        return hit
