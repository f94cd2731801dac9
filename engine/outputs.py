"""What the engine hands back: one step's delta per request (``StepOutput``, vLLM's
``RequestOutputKind.DELTA`` outputs), the accumulator of a whole generation
(``CompletionOutput``) and the finished request ``LLM`` returns (``RequestOutput``, vLLM's
shape: ``outputs[0].text``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class Logprob:
    """Log-probability (natural log, from the raw model distribution) of one token."""

    token_id: int
    logprob: float
    decoded: str = ""


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob plus the top-n alternatives at that position."""

    sampled: Logprob
    top: list[Logprob] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    """What one engine step added to one request: only the new part, never the whole.

    Attributes:
        request_id: the caller's id.
        delta_token_ids: the tokens generated since the request's previous output.
        delta_text: their text (stop strings excluded; text that may still become part of a
            stop string or of a UTF-8 character is held back to a later output).
        logprobs: one ``TokenLogprobs`` per token of ``delta_token_ids`` when the request
            asked for logprobs, else ``None``.
        finish_reason: ``None`` while running, else ``"stop"`` (EOS, stop token id or stop
            string), ``"length"`` (max_tokens or max_model_len) or ``"abort"``.
        stop_reason: on the last output, the stop string or stop token id that ended the
            request, else ``None``.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
        metrics: on the request's first output with tokens and on its last (else empty), its
            timeline (``Request.metrics``): timestamps in seconds (``time.monotonic()``:
            ``arrival``, ``first_scheduled``, ``first_token``, ``last_token``,
            ``finished``), once admitted ``steps_waited``, ``first_step_tokens``,
            ``first_chunk_tokens``, ``first_step_s``.
    """

    request_id: str
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    """One request's whole generation, accumulated from its ``StepOutput`` deltas
    (``add``): ``RequestOutput.outputs[0]`` of ``LLM.generate`` and what a non-streamed
    answer is built from.

    Attributes:
        request_id: the caller's id; index: the choice's index (the gateway's ``n``).
        token_ids: every generated token; text: their text (joined once, when read).
        logprobs: one ``TokenLogprobs`` per token when asked for, else ``None``.
        finish_reason, stop_reason, num_cached_tokens, metrics: the last output's.
    """

    request_id: str = ""
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    _texts: list[str] = field(default_factory=list, repr=False)
    _num_chars: int = field(default=0, repr=False)

    def add(self, out: StepOutput) -> None:
        """Take in the request's next output (in order)."""
        self.token_ids.extend(out.delta_token_ids)
        if out.delta_text:
            self._texts.append(out.delta_text)
            self._num_chars += len(out.delta_text)
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.logprobs)
        self.num_cached_tokens = out.num_cached_tokens
        if out.metrics:
            self.metrics = out.metrics
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    @property
    def text(self) -> str:
        """The generated text so far (the joined ``delta_text`` of the outputs added)."""
        texts = self._texts
        if len(texts) > 1:
            texts[:] = ["".join(texts)]
        return texts[0] if texts else ""

    @property
    def num_chars(self) -> int:
        """``len(text)``, without joining the text."""
        return self._num_chars

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        """True once the request's last output was added."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One finished request as ``LLM.generate`` / ``LLM.chat`` return it (vLLM's
    ``RequestOutput``), built once at its end.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text when given as text, else ``None``.
        prompt_token_ids: the tokenized prompt.
        outputs: the one ``CompletionOutput`` of the request (``outputs[0].text``,
            ``token_ids``, ``logprobs``, ``finish_reason``, ``stop_reason``).
        finished: always ``True`` (only finished requests are returned).
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: the request's timeline (``StepOutput.metrics``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
