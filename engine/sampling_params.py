"""Per-request sampling parameters, validated on construction (vLLM's SamplingParams shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# torch.Generator.manual_seed takes any int in [-2**63, 2**64) (negative ones wrap).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) keeps all.
        min_p: drop tokens whose probability is below ``min_p`` times the top one, in [0, 1].
        seed: per-request seed in [-2**63, 2**64); the same seed gives the same output
            whatever else is batched.
        presence_penalty, frequency_penalty: OpenAI's additive penalties over output tokens, in
            [-2, 2] (https://platform.openai.com/docs/advanced-usage, "frequency and presence
            penalties").
        repetition_penalty: CTRL's multiplicative penalty over prompt and output tokens, > 0
            (Keskar et al. 2019; 1.0 is off).
        max_tokens: most tokens to generate (>= 1); ``None`` means up to ``max_model_len``.
        stop: strings that end generation; never included in the text, matched across token
            boundaries.
        stop_token_ids: token ids that end generation (not included in the text).
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return the sampled token's logprob and this many top alternatives
            (``None`` = no logprobs, 0 = sampled token only, at most 20).
        skip_special_tokens: leave special tokens out of the text.

    Raises:
        ValueError / TypeError: on any out-of-range or non-finite (NaN, inf) value or wrong
            type (bool fields included), naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def num(name: str, value: object, kinds: tuple[type, ...] = (int, float)) -> None:
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")

        num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, (int,))
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all), 0 (all) or >= 1, got {self.top_k}")
        num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            num("seed", self.seed, (int,))
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            num(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        num("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            num("max_tokens", self.max_tokens, (int,))
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(s, str) for s in self.stop
        ):
            raise TypeError("stop must be a string or a list of strings")
        self.stop = list(self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise TypeError("stop_token_ids must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is not None:
            num("logprobs", self.logprobs, (int,))
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0
