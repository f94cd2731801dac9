"""OpenAI response objects built from engine outputs (chat, chat chunks, completions, usage).

Shapes follow the OpenAI API reference (chat.completion, chat.completion.chunk,
text_completion). Finish reasons map one to one (``"stop"``, ``"length"``); an engine
``"abort"`` is reported as ``"abort"`` (vLLM does the same). Logprobs are natural logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.outputs import TokenLogprobs
from prefixgate.engine.protocol import TokenizerLike


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


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
        self._token_bytes = getattr(tokenizer, "token_bytes", None)

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
        raw = self._token_bytes(token_id) if self._token_bytes is not None else text.encode()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            if "\ufffd" in text:  # the decoder lost bytes: the token's own are the truth
                text = raw.decode("utf-8")
        hit = (text, list(raw) if self._token_bytes is not None else list(text.encode()))
        if len(self._cache) < self._max:
            self._cache[token_id] = hit
        return hit


def _info(token_text: Callable[[int], str], token_id: int) -> tuple[str, list[int]]:
    info = getattr(token_text, "info", None)
    if info is not None:
        return info(token_id)
    text = token_text(token_id)
    return text, list(text.encode())


def chat_logprobs(token_text: Callable[[int], str], entries: list[TokenLogprobs]) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for entry in entries:
        text, raw = _info(token_text, entry.sampled.token_id)
        tops = []
        for alt in entry.top:
            alt_text, alt_raw = _info(token_text, alt.token_id)
            tops.append({"token": alt_text, "logprob": alt.logprob, "bytes": alt_raw})
        content.append(
            {
                "token": text,
                "logprob": entry.sampled.logprob,
                "bytes": raw,
                "top_logprobs": tops,
            }
        )
    return {"content": content}


def completion_logprobs(
    token_text: Callable[[int], str], entries: list[TokenLogprobs], offset: int = 0
) -> dict[str, Any]:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = token_text(entry.sampled.token_id)
        tokens.append(text)
        token_logprobs.append(entry.sampled.logprob)
        top: dict[str, float] = {}
        for alt in entry.top:
            key = token_text(alt.token_id)
            if key in top:  # two tokens with one text: never merged (vLLM's id form)
                key = f"token_id:{alt.token_id}"
            top[key] = alt.logprob
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_completion(
    rid: str, created: int, model: str, choices: list[dict], use: dict
) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None
) -> dict[str, Any]:
    """One choice of a chat completion."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice (``usage: null`` when usage will follow)."""
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict[str, Any]:
    """The final chunk of a stream with ``include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }


def completion(
    rid: str, created: int, model: str, choices: list[dict], use: dict
) -> dict[str, Any]:
    """A ``text_completion`` object."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None
) -> dict[str, Any]:
    """One choice of a text completion (also the shape of a streamed completion chunk)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    rid: str, created: int, model: str, choice: dict, with_usage: bool = False
) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk with one choice."""
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk
