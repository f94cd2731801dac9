"""Results handed back to callers (vLLM's RequestOutput / CompletionOutput shape)."""

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
class CompletionOutput:
    """One generated sequence.

    ``text`` and ``token_ids`` are cumulative; ``delta_text`` and ``delta_token_ids`` hold what
    is new since the previous output yielded for this request (streaming).
    ``finish_reason`` is ``None`` while running, else ``"stop"`` (EOS, stop token id or stop
    string), ``"length"`` (max_tokens or max_model_len) or ``"abort"``. ``stop_reason`` is the
    matched stop string or stop token id, if any.
    """

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as reported to the caller.

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text, when given as text.
        prompt_token_ids: the tokenized prompt.
        outputs: one CompletionOutput (n > 1 is served by several requests in the gateway).
        finished: True on the last output of the request.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
        metrics: timestamps in seconds (``time.monotonic()``): ``arrival``, ``first_scheduled``,
            ``first_token``, ``last_token``, ``finished``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
