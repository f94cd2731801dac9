"""Input processing: validate and tokenize a request before anything is queued.

Pure with respect to engine state (reads only the tokenizer and limits), so the event loop can
reject bad input at once while the engine thread steps (vLLM's input processor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from prefixgate.engine.protocol import EngineRequest
from prefixgate.engine.request import Request
from prefixgate.engine.sampling_params import SamplingParams


class InputProcessor:
    """Validates prompts and sampling parameters against the model's limits.

    Args:
        tokenizer: the engine's tokenizer (``encode``).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: longest prompt + output in tokens.
        structured_output: the ``StructuredOutputManager`` (``validate``), or ``None``.
        eos_token_ids: the model's end-of-sequence ids (given to each ``Request``).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        structured_output: Any | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured_output = structured_output  # StructuredOutputManager (validate)
        self.eos_token_ids = frozenset(eos_token_ids)

    def prepare(self, request: EngineRequest) -> Request:
        """Validate and tokenize a request into its ``Request``, not yet queued (safe from
        any thread: it reads no engine state). The one check of the prompt's ids; the
        ``Request`` holds a private, re-validated copy of the caller's ``SamplingParams`` and
        ``max_tokens = min(params.max_tokens, max_model_len - prompt)``.

        Raises:
            TypeError: ``request`` not an ``EngineRequest`` (its own fields are type-checked
                when it is built); prompt ids not ints.
            ValueError: empty prompt, token id outside the vocabulary, prompt of
                ``max_model_len`` tokens or more, or invalid sampling parameters (a
                ``stop_token_ids`` / ``logit_bias`` id outside the vocabulary, a
                ``structured_outputs`` constraint that does not compile).
        """
        if not isinstance(request, EngineRequest):
            raise TypeError(f"request must be an EngineRequest, got {type(request).__name__}")
        prompt = request.prompt
        params = dataclasses.replace(request.sampling_params)  # private copy, re-validated
        self._check_params(params)
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            ids = list(prompt)
            vocab = self.vocab_size
            # plain ints within the vocabulary: checked at C speed; anything else (int
            # subclasses, bad ids) goes through the loop, which names the first fault
            plain = ids and set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab
            for t in () if plain else ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"prompt token ids must be ints, got {type(t).__name__}")
                if not 0 <= t < vocab:
                    raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {vocab})")
        else:
            raise TypeError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, which "
                "leaves no room to generate (prompt must be shorter than max_model_len)"
            )
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            request.request_id,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            cache_salt=request.cache_salt,
            arrival_time=request.arrival_time,
            tenant=request.tenant,
            priority=request.priority,
        )
        req.prompt = text
        req.engine_request = request
        return req

    def _check_params(self, params: SamplingParams) -> None:
        """Vocabulary-dependent checks of ``params`` (field named in the message)."""
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"logit_bias: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
                )
        if params.allowed_token_ids is not None:
            bad = [t for t in params.allowed_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"allowed_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})"
                )
        if params.bad_words:  # vLLM's: as written and with a leading space
            seqs: list[list[int]] = []
            for word in params.bad_words:
                for text in (word, " " + word.lstrip()):
                    ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                    if ids and ids not in seqs:
                        seqs.append(ids)
            params.bad_words_token_ids = seqs
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs is not supported by this engine")
            self.structured_output.validate(params.structured_outputs)
