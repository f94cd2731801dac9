"""The seam between the gateway and an engine: ``EngineClient`` (vLLM's ``EngineClient``).

Everything the gateway calls on an engine is declared here, and nothing else: ``AsyncEngine``
implements it in-process, the fake engine of the gateway tests implements it too (checked by
mypy in ``tests/gateway/test_engine_client.py`` and by ``isinstance`` at run time). This
module imports no torch (only the engine's torch-free types), so the gateway imports it in
proxy mode as well.

Contract details (errors, ordering, what a cancelled call leaves behind) are in
docs/architecture.md, "gateway ↔ engine".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.outputs import StepOutput
from prefixgate.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """One generation request as its caller builds it, once, and the engine carries it to its
    ``Request`` (vLLM's ``EngineCoreRequest``): every per-request engine argument is a field
    here, so a new one is added here, where it is read, and where the caller sets it.

    Attributes:
        request_id: caller-chosen id, unique among the requests in flight (non-empty).
        prompt: the prompt as text (tokenized by the engine) or token ids (ints).
        sampling_params: how to sample and stop (``None``: ``SamplingParams()`` defaults).
        cache_salt: prefix-cache partition (tenant key): different salts never share KV
            blocks; ``None`` is the shared partition.
        tenant: who the ``fair`` scheduling policy charges (``None``: ``"default"``).
        priority: the ``priority`` scheduling policy's rank, lower first (vLLM's).
        arrival_time: ``time.monotonic()`` seconds when the request arrived (``None``: when
            the engine receives it).

    Raises:
        TypeError: a field of the wrong type (named): ``request_id`` not a non-empty string,
            ``prompt`` neither a string nor a sequence, ``sampling_params`` not
            ``SamplingParams``, ``cache_salt`` / ``tenant`` not a string, ``priority`` not an
            int, ``arrival_time`` not a number. The prompt's contents (empty, ids outside the
            vocabulary, too long) are checked by the engine (``LLMEngine.prepare_request``).
    """

    request_id: str
    prompt: str | Sequence[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    tenant: str | None = None
    priority: int = 0
    arrival_time: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TypeError("request_id must be a non-empty string")
        if isinstance(self.prompt, bytes | bytearray) or not isinstance(
            self.prompt, str | Sequence
        ):
            raise TypeError(
                f"prompt must be a string or a list of token ids, got {type(self.prompt).__name__}"
            )
        if self.sampling_params is None:
            self.sampling_params = SamplingParams()
        if not isinstance(self.sampling_params, SamplingParams):
            raise TypeError(
                f"sampling params must be SamplingParams, got {type(self.sampling_params).__name__}"
            )
        _check_optional_strings(self, ("cache_salt", "tenant"))
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"priority must be an int, got {type(self.priority).__name__}")
        t = self.arrival_time
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float)):
            raise TypeError(f"arrival_time must be a number or None, got {type(t).__name__}")


@dataclass(frozen=True, slots=True)
class PinRequest:
    """One prefix pin as its caller builds it, once (``LLM.pin_prefix`` from its keyword
    arguments, the gateway's prefix registry and cache breakpoints), and hands to the engine's
    ``pin_prefix``; its fields are checked here, the prefix against the engine (empty, ids
    outside the vocabulary, shorter than one block, prefix caching off) by the engine.

    Attributes:
        token_ids: the prefix's token ids (ints), kept as a tuple (the caller's list is copied).
        ttl_s: seconds the pin holds its blocks (> 0), a float.
        cache_salt: prefix-cache partition the prefix is computed and pinned under (``None``:
            the shared partition), as ``EngineRequest.cache_salt``.
        tenant: who the prefill and the pinned blocks are charged to (under the ``fair``
            policy they count against its share; ``None``: nobody).

    Raises:
        TypeError: ``token_ids`` is text (tokenize it first) or not a sequence;
            ``cache_salt`` / ``tenant`` not a string.
        ValueError: ``ttl_s`` not a positive number of seconds.
    """

    token_ids: Sequence[int]
    ttl_s: float
    cache_salt: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        ttl_s = self.ttl_s
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if isinstance(self.token_ids, str):
            raise TypeError("pin_prefix takes token ids; tokenize the text first")
        if isinstance(self.token_ids, bytes | bytearray) or not isinstance(
            self.token_ids, Sequence
        ):
            raise TypeError(
                f"token_ids must be a list of token ids, got {type(self.token_ids).__name__}"
            )
        _check_optional_strings(self, ("cache_salt", "tenant"))
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "ttl_s", float(ttl_s))


def _check_optional_strings(request: object, names: tuple[str, ...]) -> None:
    """Raise TypeError naming the first of ``request``'s fields ``names`` that is neither a
    string nor ``None``."""
    for name in names:
        value = getattr(request, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, got {type(value).__name__}")


@runtime_checkable
class TokenizerLike(Protocol):
    """What the gateway asks of an engine's tokenizer (``engine.tokenizer.Tokenizer``).

    All methods must be safe to call from a worker thread while the engine runs.
    """

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included); ids are in ``[0, vocab_size)``."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the BOS the tokenizer adds when ``add_special_tokens``)."""
        ...

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text (Hugging Face ``tokenizers`` releases the GIL here)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 decodes to U+FFFD)."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered with the chat template, as text."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text (a byte-fallback token's own byte, not
        U+FFFD); for logprobs' ``bytes``."""
        ...

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the conversation rendered with the chat template (the template's BOS
        included; special-token strings inside message content tokenized as plain text).
        ``kwargs`` are template variables (``tools``: OpenAI's function tools).

        Raises:
            ValueError: the template refuses the conversation.
        """
        ...

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` computed without tokenizing (0 when none is
        safe): lets the gateway refuse an over-context prompt before tokenizing it."""
        ...


@runtime_checkable
class PinHandle(Protocol):
    """A pinned prefix as the engine returns it from ``pin_prefix``."""

    @property
    def id(self) -> str:
        """The pin id, for ``unpin_prefix``."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the pin (whole KV blocks)."""
        ...

    @property
    def expires_at(self) -> float | None:
        """When the pin lapses, ``time.monotonic()`` seconds (``None``: never). The engine
        owns this clock; the gateway reads it and keeps none of its own."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the gateway uses it: generation, abort, prefix pins, stats, shutdown."""

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (``config.model`` names the served model folder)."""
        ...

    @property
    def tokenizer(self) -> TokenizerLike:
        """The model's tokenizer (the gateway renders and tokenizes prompts itself)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output in tokens."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        """Per-step deltas of ``request`` as tokens come (``StepOutput``: only what each
        step added; the last has ``finished=True``); leaving the iteration early aborts the
        request.

        Raises (from the first iteration):
            ValueError / TypeError: bad prompt or params, duplicate in-flight ``request_id``.
            EngineDeadError: the engine is shut down (or shut down while the request ran).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight (its iterator ends with ``finish_reason="abort"``).

        Raises:
            ValueError: ``request_id`` is not in flight.
        """
        ...

    async def pin_prefix(self, pin: PinRequest) -> PinHandle:
        """Prefill (if not cached) and pin the full KV blocks of ``pin.token_ids`` for
        ``pin.ttl_s`` s, charged to ``pin.tenant`` (under ``fair`` the pinned blocks count
        against its share).

        Raises:
            PinLimitError: the pins would exceed the engine's pinned share of the cache.
            ValueError / TypeError: bad input. EngineDeadError: the engine is shut down.
        """
        ...

    def get_pin(self, pin_id: str) -> PinHandle:
        """The pin ``pin_id`` while the engine still holds it (never blocks).

        Raises:
            KeyError: unknown, released, revoked, or past its ``expires_at``.
        """
        ...

    def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin.

        Raises:
            KeyError / ValueError: unknown (or already released) pin id.
        """
        ...

    def stats(self) -> dict[str, Any]:
        """Engine counters (keys in docs/architecture.md, ``stats()`` keys); never blocks."""
        ...

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        """Seconds until a new request of ``num_prompt_tokens`` would get its first token
        (``load_model.estimate_ttft`` on a ``stats()`` snapshot); ``None`` while the engine
        has not measured its rates; never blocks."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; requests in flight fail with ``EngineDeadError``."""
        ...
