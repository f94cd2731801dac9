"""Incremental detokenization with stop strings, for streaming.

Decoding token by token breaks on two things: tokenizers whose text depends on the neighbours
(SentencePiece's leading-space rules) and byte-fallback tokens that carry part of a UTF-8
character. As in vLLM's incremental detokenizer, each step decodes a short window of recent
tokens twice — up to the last emitted token (``prefix``) and up to the newest (``full``) —
and emits the difference, holding it back while the text ends in U+FFFD (an incomplete UTF-8
sequence). The window starts with a few prompt tokens so the first output token gets its
leading space right. The cost per step depends on the window, not on the output length.

Stop strings are matched on the decoded text across token boundaries: text that could still
be the start of a stop string is held back (never emitted), and when a stop string appears the
text is cut before it (after it with ``include_stop_str_in_output``, vLLM's). Like EOS and stop token ids, a stop string ends the request only once
``min_tokens`` tokens were generated (vLLM's semantics since 2025): one that ends in the text
of the first ``min_tokens`` tokens is ordinary text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixgate.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs (leading spaces)
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Args:
        tokenizer: has ``decode(ids, skip_special_tokens=...) -> str`` (``engine.tokenizer``).
        prompt_token_ids: the prompt (its last few tokens give the first output its context).
        params: the request's ``SamplingParams`` (``stop``, ``skip_special_tokens``,
            ``min_tokens``: stop strings are matched only in steps after that many tokens).

    Attributes:
        text: everything emitted so far (the concatenation of the returned deltas).
        stop_string: the stop string that matched, or ``None``; once set, later steps emit
            nothing and the text stays cut before it (after it with
            ``include_stop_str_in_output``).
        finished: True after :meth:`finish`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops: list[str] = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        self.stop_string: str | None = None
        self.finished = False
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens seen
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start in _ids
        self._read_offset = len(context)  # tokens up to here have been turned into text
        self._held = ""  # decoded text held back as a possible stop-string start

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add output tokens; returns the newly emitted text (possibly ``""``).

        Never returns a partial UTF-8 character or any part of a stop string.
        """
        if self.stop_string is not None or self.finished or not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        self.num_tokens += len(new_token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Flush held-back text when the request ends for a reason other than a stop string
        (EOS, length, stop token id). Returns the remaining text (``""`` after a stop string
        matched, or on a second call); a stop string still found in it is cut as usual."""
        if self.finished:
            return ""
        self.finished = True
        if self.stop_string is not None:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    flush = finish

    def _decode_new(self, final: bool) -> str:
        """Text of tokens past ``_read_offset``; ``""`` while it ends in an incomplete UTF-8
        sequence (unless ``final``)."""
        if self._read_offset >= len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        prefix = self.tokenizer.decode(
            window[: self._read_offset - self._prefix_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing visible yet, or a character still incomplete: wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _emit(self, new_text: str, final: bool) -> str:
        buf = self._held + new_text
        if not buf:
            return ""
        # before min_tokens a stop string is text (its possible start is still held back, so
        # one that ends in a later token's text is found then)
        matching = self.num_tokens > self.min_tokens
        cut, stop = self._find_stop(buf) if matching else (len(buf), None)
        if stop is not None:
            self.stop_string = stop
            self._held = ""
            delta = buf[: cut + len(stop)] if self.include_stop else buf[:cut]
        else:
            keep = 0 if final else self._stop_prefix_len(buf)
            delta, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += delta
        return delta

    def _find_stop(self, buf: str) -> tuple[int, str | None]:
        """Earliest stop string in ``buf`` (the longest one on a tie): (index, stop)."""
        best, found = len(buf) + 1, None
        for stop in self.stops:
            idx = buf.find(stop)
            if idx != -1 and (idx < best or (idx == best and len(stop) > len(found or ""))):
                best, found = idx, stop
        return best, found

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = min(max((len(s) for s in self.stops), default=1) - 1, len(buf))
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
