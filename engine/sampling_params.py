"""Per-request sampling parameters, validated on construction (vLLM's SamplingParams shape)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

# torch.Generator.manual_seed takes any int in [-2**63, 2**64) (negative ones wrap).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0  # OpenAI's range for logit_bias values

_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (dict, or its JSON text); the output is JSON valid against it.
        json_object: ``True``: the output is any JSON object (OpenAI's ``json_object`` mode).
        regex: the output matches this regular expression (whole text).
        choice: the output is exactly one of these strings.
        grammar: the output follows this EBNF grammar (GBNF / xgrammar syntax, root rule
            ``root``).
        structural_tag: an xgrammar structural tag (dict, or its JSON text):
            ``{"type": "structural_tag", "format": {...}}``, e.g. ``triggered_tags``: free text
            until a trigger string, then a tag (begin, content such as a JSON schema, end). The
            gateway builds one to honour ``strict`` tools under ``tool_choice="auto"``
            (``gateway/wire/tool_parsers.py``). Format reference: xgrammar's "Structural Tag" docs.

    Compiled by xgrammar (``prefixgate.engine.structured_output``); the engine masks every
    token the constraint forbids, and a request whose constraint is complete ends with
    finish reason ``"stop"``.

    Raises:
        ValueError / TypeError: none or more than one constraint given, or a wrong type (the
            message names the field). Whether a schema / regex / grammar compiles is checked
            when the request is prepared (``LLMEngine.prepare_request``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {given or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
                self.json = parsed
            if not isinstance(self.json, dict) and not isinstance(self.json, bool):
                raise TypeError("structured_outputs.json must be a JSON schema (an object)")
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except ValueError as exc:
                raise ValueError(
                    f"structured_outputs.structural_tag is not valid JSON: {exc}"
                ) from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise TypeError("structured_outputs.structural_tag must be an object (or its JSON)")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError("structured_outputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise TypeError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: ``"json"``, ``"json_object"``, ``"regex"``, ``"choice"``,
        ``"grammar"`` or ``"structural_tag"``."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical string of the constraint (the compiled-grammar cache key)."""
        value = getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


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
        stop: strings that end generation, matched across token boundaries; left out of the
            text unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (not included in the text); under a
            structured-output grammar they are allowed only where the grammar may end.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return the sampled token's logprob and this many top alternatives
            (``None`` = no logprobs, 0 = sampled token only, at most 20).
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the stop string that ended the request at the end of
            the text (the text is cut right after it), and the text of a stop token id or EOS
            that ended it (vLLM's; empty for a special token under ``skip_special_tokens``).
        min_tokens: generate at least this many tokens before the request may end: EOS and
            stop token ids are masked until then and a stop string ending in the first
            ``min_tokens`` tokens' text is ordinary text (vLLM's semantics). A structured-output
            grammar wins: when it allows only end-of-sequence (its answer is complete), the
            request ends there (``prefixgate.engine.logits_processors``).
        logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling
            (OpenAI's ``logit_bias``; ids checked against the vocabulary when the request is
            prepared); it never unmasks a token the grammar or ``min_tokens`` forbids.
        structured_outputs: constrain the output (``StructuredOutputsParams``), or ``None``.
        allowed_token_ids: only these ids may be sampled (vLLM's; ``None``: all). Under a
            grammar the two masks intersect; where they leave nothing, the grammar wins.
        bad_words: words never generated (vLLM's): each is tokenized as written and with a
            leading space, and the last token of such a sequence is banned whenever the output
            ends with the rest of it (a one-token word is always banned).
        bad_words_token_ids: the token sequences of ``bad_words``, filled by the engine when
            the request is prepared (not an argument).

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
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        def num(name: str, value: object, kinds: tuple[type, ...] = (int, float)) -> None:
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
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
        num("min_tokens", self.min_tokens, (int,))
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise TypeError("allowed_token_ids must be a list of integers")
            if not ids or any(t < 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of ids >= 0")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words):
                raise TypeError("bad_words must be a list of strings")
            if any(not w.strip() for w in words):
                raise ValueError("bad_words must not hold an empty or blank word")
            self.bad_words = list(words)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if isinstance(so, dict):
                self.structured_outputs = StructuredOutputsParams(**so)
            else:
                raise TypeError(
                    "structured_outputs must be StructuredOutputsParams or a dict, got "
                    f"{type(so).__name__}"
                )

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0


_DECIMAL = re.compile(r"-?(?:0|[1-9][0-9]*)")


def token_id_key(key: object) -> int | None:
    """A ``logit_bias`` key as a token id: an int (not a bool), or the canonical decimal
    digits of one (``"42"``, ``"-1"``); ``None`` for anything else. ``int()`` alone would
    read ``" 5"``, ``"+5"``, ``"5_0"`` (50), ``"٥"`` (an Arabic-Indic 5), ``"05"`` or a float
    ``5.7`` as some id, biasing a token the client never named."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    return None


def _check_logit_bias(bias: object) -> dict[int, float]:
    """``{token id: bias}`` with int ids (JSON's string keys accepted) and finite biases in
    [-100, 100]; raises ValueError / TypeError naming ``logit_bias``."""
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tid = token_id_key(k)
        if tid is None:
            raise TypeError(
                f"logit_bias keys must be token ids (an int, or its decimal digits as a JSON "
                f"key), got {str(k)[:80]!r}"
            )
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise TypeError(f"logit_bias[{tid}] must be a finite number, got {str(v)[:80]!r}")
        if not LOGIT_BIAS_MIN <= v <= LOGIT_BIAS_MAX:
            raise ValueError(f"logit_bias[{tid}] must be in [-100, 100], got {v}")
        if tid < 0:
            raise ValueError(f"logit_bias key {tid} is not a token id (must be >= 0)")
        out[tid] = float(v)
    return out
