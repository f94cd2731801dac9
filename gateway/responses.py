"""OpenAI response objects built from engine outputs (chat, chat chunks, completions, usage).

Shapes follow the OpenAI API reference (chat.completion, chat.completion.chunk,
text_completion). Finish reasons map one to one (``"stop"``, ``"length"``); an engine
``"abort"`` is reported as ``"abort"`` (vLLM does the same). Logprobs are natural logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixgate.engine.outputs import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenTexts:
    """Token id → the text the token adds inside a sequence (a leading space kept).

    Decoding a token alone loses its leading space with sentencepiece-style tokenizers
    ("▁a" → "a"); decoded after a fixed anchor token it keeps it: text = decode([anchor, id])
    minus decode([anchor]). Results are cached (token ids are few).
    """

    def __init__(self, tokenizer: Any, max_cache: int = 1 << 16) -> None:
        self._tok = tokenizer
        self._anchor = list(tokenizer.encode("a", add_special_tokens=False)[-1:])
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._cache: dict[int, str] = {}
        self._max = max_cache

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            full = self._tok.decode(self._anchor + [token_id], skip_special_tokens=False)
            if self._anchor and full.startswith(self._anchor_text):
                text = full[len(self._anchor_text) :]
            else:
                text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._max:
                self._cache[token_id] = text
        return text


def chat_logprobs(token_text: Callable[[int], str], entries: list[TokenLogprobs]) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for entry in entries:
        text = token_text(entry.sampled.token_id)
        tops = []
        for alt in entry.top:
            alt_text = token_text(alt.token_id)
            tops.append(
                {"token": alt_text, "logprob": alt.logprob, "bytes": list(alt_text.encode())}
            )
        content.append(
            {
                "token": text,
                "logprob": entry.sampled.logprob,
                "bytes": list(text.encode()),
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
        tops.append({token_text(alt.token_id): alt.logprob for alt in entry.top})
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
