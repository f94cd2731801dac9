"""Per-request state shared by the scheduler, the KV cache manager and the model runner.

Vocabulary and life cycle follow vLLM v1 (``vllm/v1/request.py``): a request is WAITING until
the scheduler admits it, RUNNING while it holds KV blocks and gets prefill chunks or decode
steps, PREEMPTED when its blocks were taken back (it waits again and is recomputed), and ends in
one of the FINISHED_* states.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from prefixgate.engine.protocol import EngineRequest
    from prefixgate.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life cycle. Every state after PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    def is_finished(self) -> bool:
        """True for FINISHED_*; call as ``status.is_finished()`` or ``RequestStatus.is_finished(s)``."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: ``"stop"``, ``"length"``, ``"abort"``, or ``None`` if not finished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request: its token ids, progress and KV bookkeeping.

    Args:
        request_id: caller-chosen unique id.
        prompt_token_ids: the tokenized prompt (at least one token).
        sampling_params: the request's ``SamplingParams`` (only ``ignore_eos`` and
            ``stop_token_ids`` are read here; the sampler reads the rest).
        eos_token_ids: end-of-sequence token ids of the model (ignored with ``ignore_eos``).
        max_tokens: most tokens to generate, already resolved to an int >= 1.
        cache_salt: tenant key; requests with different salts never share KV blocks.
        arrival_time: ``time.monotonic()`` seconds when the request arrived.
        tenant: who the request is charged to by the ``fair`` scheduling policy (``None``:
            tenant ``"default"``).
        priority: the ``priority`` policy's rank: lower runs first (vLLM's convention).

    Attributes:
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose KV is in the cache (prefix-cache hits included).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission
            (0 until then; a resumed preempted request keeps its first value).
        status, stop_reason, finish_reason: see ``RequestStatus``; ``stop_reason`` is the stop
            token id or stop string that ended the request, ``None`` for EOS / length / abort.
        generator: per-request ``torch.Generator`` (the model runner fills it for seeded sampling).
        structured_output: the request's grammar state (``StructuredOutputRequest``: compiled
            grammar future + matcher) when its params constrain the output, else ``None``.
        block_hashes: prefix-cache keys of the request's full blocks (filled by the KV cache
            manager, ``block_hashes[i]`` covers tokens ``[i*block_size, (i+1)*block_size)``).
        num_preemptions: times this request was preempted.
        arrival_time, first_scheduled_time, first_token_time, last_token_time, finished_time:
            ``time.monotonic()`` seconds (``None`` until it happens); ``metrics`` is them as a
            dict, the one copy ``StepOutput.metrics`` reports.
        steps_waited: engine steps that ran while it waited for its first admission.
        first_step_tokens, first_chunk_tokens: the query tokens of the whole step that first
            scheduled it, and its own share of them (its first prefill chunk); 0 until then.
        first_step_s: that step's model time (schedule to update, seconds; ``None`` until it
            ended). These four are in ``metrics`` too (``steps_waited``,
            ``first_step_tokens``, ``first_chunk_tokens``, ``first_step_s``) once admitted:
            where a first-token wait went.
        detokenizer: the ``IncrementalDetokenizer`` of a caller request (``None`` for internal
            requests and bare scheduler tests): ``check_stop`` feeds it each token and ends the
            request on a stop string.
        new_text: the text detokenized since the last output (stop strings excluded);
            ``new_logprobs``: the ``TokenLogprobs`` of the tokens since the last output when
            requested, else ``None``; ``num_sent_tokens``: output tokens earlier outputs
            reported. An output takes these and resets them: the request keeps no whole text.
        prompt: the prompt text when the caller gave text, else ``None``.
        pin_job: the pin in progress when this is the internal prefill of a prefix pin.
        engine_request: the caller's ``EngineRequest`` it was built from (``None`` for bare
            scheduler tests): a per-request field added there is read here as
            ``request.engine_request.<field>``.
        error: why the request failed (a sampled token its grammar rejected), else ``None``.
        spec: its speculative-decoding bookkeeping (``spec_decode.SpecDecodeState``), made by
            the scheduler at its first draft; ``None`` until then or without speculation.

    A ``Request`` is built by ``InputProcessor.prepare`` from a validated ``EngineRequest``
    (prompt ids, limits and field types are checked there, once); it checks nothing again.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int = 16,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        prompt = list(prompt_token_ids)
        self.tenant = tenant
        self.priority = priority
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        self.structured_output: Any | None = None
        self.block_hashes: list[Any] = []
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.arrival_step = 0  # the scheduler's count of non-empty steps when it arrived
        self.steps_waited = 0
        self.first_step_tokens = 0
        self.first_chunk_tokens = 0
        self.first_step_s: float | None = None
        self.prompt: str | None = None
        self.detokenizer: Any = None
        self.new_text = ""
        self.new_logprobs: list[Any] | None = None
        self.num_sent_tokens = 0
        self.pin_job: Any = None
        self.engine_request: EngineRequest | None = None
        self.error: BaseException | None = None
        self.spec: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``None`` while not finished."""
        return self.status.finish_reason

    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def metrics(self) -> dict[str, float]:
        """The timestamps that happened, by name (``arrival``, ``first_scheduled``,
        ``first_token``, ``last_token``, ``finished``), ``time.monotonic()`` seconds; once
        admitted also ``steps_waited``, ``first_step_tokens``, ``first_chunk_tokens`` (counts)
        and, once that step ended, ``first_step_s`` (seconds)."""
        times: dict[str, float | None] = {
            "arrival": self.arrival_time,
            "first_scheduled": self.first_scheduled_time,
            "first_token": self.first_token_time,
            "last_token": self.last_token_time,
            "finished": self.finished_time,
        }
        if self.first_scheduled_time is not None:
            times["steps_waited"] = self.steps_waited
            times["first_step_tokens"] = self.first_step_tokens
            times["first_chunk_tokens"] = self.first_chunk_tokens
            times["first_step_s"] = self.first_step_s
        return {k: v for k, v in times.items() if v is not None}

    def append_output_token(self, token_id: int, now: float | None = None) -> None:
        """Append one sampled token (its KV is computed next step, as a decode)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        now = time.monotonic() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Decide whether the last appended token ends the request: the one place that does.

        In order: EOS (unless ``ignore_eos``) or a stop token id (``stop_reason`` = the id;
        neither adds text but with ``include_stop_str_in_output``; under a grammar whose only
        tokens were stop ids, the logits pipeline marks them as its text, ``stop_ids_are_text``, and they do not stop); unless the length is reached, a structured-output grammar that
        ended (stop, no text) or rejected the token (aborted, ``error`` set: the request
        fails); then the token's text goes to the detokenizer and a stop string in it ends the
        request (``stop_reason`` = the string); else ``max_tokens`` or ``max_model_len``
        reached (length). Returns the finished status, or ``None``.

        ``min_tokens``: EOS and stop ids cannot be sampled before it (the logits pipeline masks
        them unless a complete grammar allows only them) and the detokenizer matches stop
        strings only after it, so the first ``min_tokens`` tokens never end the request but for
        a grammar that is complete or the length limit.
        """
        token = self.output_token_ids[-1]
        params = self.sampling_params
        if token in self.eos_token_ids and not (params is not None and params.ignore_eos):
            self._stop_token_text(token)
            return RequestStatus.FINISHED_STOPPED
        so = self.structured_output
        if (
            params is not None
            and token in params.stop_token_ids
            and not (so is not None and so.stop_ids_are_text)
        ):
            self._stop_token_text(token)
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        length = self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len
        if so is not None and not length:
            if so.terminated:  # the grammar is complete (also with ignore_eos)
                return RequestStatus.FINISHED_STOPPED
            if so.rejected is not None:
                self.error = RuntimeError(
                    f"request {self.request_id!r}: token {so.rejected} was sampled outside its "
                    "structured_outputs grammar (no allowed token left)"
                )
                return RequestStatus.FINISHED_ABORTED
        detok = self.detokenizer
        if detok is not None:
            self.new_text += detok.step([token])
            if detok.stop_string is not None:
                self.stop_reason = detok.stop_string
                return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH if length else None

    def _stop_token_text(self, token: int) -> None:
        """With ``include_stop_str_in_output`` (vLLM's), the text of the EOS or stop token id
        that ends the request goes to the text ("" for a special token the detokenizer
        skips)."""
        params, detok = self.sampling_params, self.detokenizer
        if params is not None and params.include_stop_str_in_output and detok is not None:
            self.new_text += detok.step([token])

    @property
    def waits_for_grammar(self) -> bool:
        """True while the request's grammar is still compiling: the scheduler skips it (vLLM's
        WAITING_FOR_FSM) without holding back the requests behind it."""
        so = self.structured_output
        return so is not None and not so.ready

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
